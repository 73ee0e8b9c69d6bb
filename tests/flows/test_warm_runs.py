"""Triggered runs against `layertap serve` on a real Prefect server share one warm engine: the second run
starts none and stores exactly what a cold run stores; an engine killed between runs is replaced; a cold
run starts its engine while it still reads its inputs."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np
import pytest
from test_prefect_yaml import PREFECT, Server, write_csv

from layertap.runner import warm_engine
from layertap.store.lock import store_lock

BATCHES = [
    [f"Warm run one, row {i}." for i in range(30)] + ["", "Warm run one, row 3."],
    [f"Warm run two, row {i}." for i in range(30)] + ["Warm run one, row 5."],
    [f"Warm run three, row {i}." for i in range(20)],
]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A Prefect server and `layertap serve` serving prefect.yaml's deployments against it. Its engines run
    eagerly: these tests check who starts an engine and what runs store, which compiling only slows down."""
    home = tmp_path_factory.mktemp("warm-prefect-home")
    srv = Server(home)
    srv.env["LAYERTAP_ENFORCE_EAGER"] = "true"
    srv.start("server", PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(srv.port))
    try:
        srv.wait_healthy()
        srv.serve_deployments()
        yield srv
    finally:
        srv.stop()


def finished_runs(server: Server, count: int, timeout: float = 420) -> list[dict]:
    """The embed-new-rows runs, once `count` of them are in a final state."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runs = server.post("/flow_runs/filter", {"deployments": {"name": {"any_": ["embed-new-rows"]}},
                                                 "sort": "START_TIME_ASC"})
        done = [r for r in runs if r["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")]
        if len(done) >= count:
            return done
        time.sleep(1)
    pytest.fail(f"fewer than {count} finished embed-new-rows runs within {timeout}s\n{server.tail()}")


def starts(server: Server) -> int:
    path = os.path.join(server.env["LAYERTAP_ENGINE_DIR"], warm_engine.STARTS_LOG)
    return len(open(path).readlines()) if os.path.exists(path) else 0


def add(server: Server, store, path: str, *options: str) -> None:
    out = server.run(sys.executable, "-m", "flows.cli", "add", "--dataset", "warm", "--input", path,
                     "--store", str(store), "--json", *options)
    assert json.loads(out.stdout)["event"], out.stderr


def vectors(store, layer: int) -> dict[str, np.ndarray]:
    from layertap import Store

    table = Store(store).embeddings(layer=layer)
    matrix = table["embedding"].combine_chunks().flatten().to_numpy().reshape(table.num_rows, -1)
    return dict(zip(table["prompt_hash"].to_pylist(), matrix))


@pytest.mark.timeout(1200)
def test_triggered_runs_share_a_warm_engine(served, tmp_path, tiny_model, shared_engine, monkeypatch, capsys):
    from flows.embed import embed_flow
    from flows.cli import main
    from layertap.store.store_db import StoreDB

    store, files = tmp_path / "store", [write_csv(tmp_path / f"rows{i}.csv", rows) for i, rows in enumerate(BATCHES)]

    # The first triggered run starts the engine; the second attaches to it and starts nothing.
    add(served, store, files[0], "--model", tiny_model, "--layers", "0,2,-1")
    first = finished_runs(served, 1)[-1]
    assert first["state"]["type"] == "COMPLETED", served.tail()
    assert starts(served) == 1
    [engine] = warm_engine.list_engines(served.env["LAYERTAP_ENGINE_DIR"])
    add(served, store, files[1])
    second = finished_runs(served, 2)[-1]
    assert second["state"]["type"] == "COMPLETED", served.tail()
    assert starts(served) == 1, "the second run started an engine instead of using the warm one"
    assert warm_engine.list_engines(served.env["LAYERTAP_ENGINE_DIR"])[0]["pid"] == engine["pid"]

    # What the warm runs stored is what one cold run in this process stores from the same rows.
    cold = embed_flow(input=files[:2], model=tiny_model, layers="0,2,-1", store=str(tmp_path / "cold"),
                      parity_sample=0, warm_engine=False, env_file=None)
    assert cold["embedded"] == 60
    for layer in (0, 2, 4):
        ours, theirs = vectors(store, layer), vectors(tmp_path / "cold", layer)
        assert ours.keys() == theirs.keys() and len(ours) == 60
        for prompt, vector in theirs.items():
            np.testing.assert_allclose(ours[prompt], vector, rtol=0, atol=1e-5)

    # `layertap status` shows the warm engine: its model, since when, the memory it holds.
    monkeypatch.setenv("LAYERTAP_ENGINE_DIR", served.env["LAYERTAP_ENGINE_DIR"])
    capsys.readouterr()
    assert main(["status", "--store", str(store)]) == 0
    shown = capsys.readouterr().out
    assert "warm engines (1)" in shown and f"pid {engine['pid']}  {tiny_model} (float32)  since " in shown
    assert " GiB" in shown and "idle " in shown

    # An engine killed between runs: the next triggered run starts a fresh one and succeeds.
    os.kill(engine["pid"], signal.SIGKILL)
    add(served, store, files[2])
    third = finished_runs(served, 3)[-1]
    assert third["state"]["type"] == "COMPLETED", served.tail()
    assert starts(served) == 2
    assert len(vectors(store, 4)) == 80

    # A triggered run waits its turn while another run holds the store, then runs.
    with store_lock(store):
        add(served, store, write_csv(tmp_path / "later.csv", ["A row that waited for the lock."]))
        deadline = time.monotonic() + 120
        while not [r for r in served.post("/flow_runs/filter", {}) if r["state"]["type"] == "RUNNING"]:
            assert time.monotonic() < deadline, served.tail()
            time.sleep(0.5)
        time.sleep(3)
        assert len(finished_runs(served, 3)) == 3, "the run did not wait for the store's lock"
    fourth = finished_runs(served, 4)[-1]
    assert fourth["state"]["type"] == "COMPLETED", served.tail()
    assert len(vectors(store, 4)) == 81

    # A cold run starts (here: attaches to) its engine while it still reads its inputs, not after planning.
    calls = []
    attach, ingest = warm_engine.attach, StoreDB.ingest
    monkeypatch.setattr(warm_engine, "attach", lambda *a: calls.append("engine") or attach(*a))
    monkeypatch.setattr(StoreDB, "ingest", lambda *a: (calls.append("ingest started"), ingest(*a),
                                                         calls.append("ingest done"))[1])
    extra = write_csv(tmp_path / "extra.csv", ["One more row for an early engine."])
    early = embed_flow(input=files + [extra], model=tiny_model, layers="0,2,-1", store=str(store), parity_sample=0,
                       warm_engine=True, enforce_eager=True, engine_dir=served.env["LAYERTAP_ENGINE_DIR"],
                       env_file=None)
    assert early["embedded"] == 1 and starts(served) == 2
    assert calls.index("engine") < calls.index("ingest done"), calls


@pytest.mark.timeout(900)
def test_a_warm_engine_that_dies_during_a_run_is_replaced_and_the_run_succeeds(
    tmp_path, tiny_model, shared_engine, monkeypatch
):
    """The engine kills itself at its second batch, the first batch of the second run: Prefect retries the
    batch, the retry starts a fresh engine, and nothing is quarantined or stored twice. The engines run
    eagerly: compiling adds seconds to both starts and nothing to what is checked here."""
    import tempfile

    from flows.embed import embed_flow

    engines = tempfile.mkdtemp(prefix="lt-engines-", dir="/tmp")
    monkeypatch.setenv("LAYERTAP_FAULTS", "runner-process.extract:kill@2")  # engines started from here on
    store, files = tmp_path / "store", [write_csv(tmp_path / f"rows{i}.csv", rows) for i, rows in enumerate(BATCHES)]
    run = dict(model=tiny_model, layers="0,-1", store=str(store), parity_sample=0, warm_engine=True,
               engine_dir=engines, enforce_eager=True, env_file=None)
    try:
        first = embed_flow(input=files[:1], **run)
        assert first["embedded"] == 30
        [engine] = warm_engine.list_engines(engines)
        second = embed_flow(input=files[:2], **run)
        assert second["embedded"] == 30 and not second["quarantined"]
        assert not warm_engine.engine_alive(engine["pid"])
        assert len(open(os.path.join(engines, warm_engine.STARTS_LOG)).readlines()) == 2
        assert len(vectors(store, 4)) == 60 and second["ledger"]["pending"] == 0
    finally:
        warm_engine.stop_engines(engines)
