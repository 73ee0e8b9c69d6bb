"""The ray executor on a Ray cluster of this machine (2 CPUs) started by the flow: two engines that are Ray
actors, each a real vLLM CPU engine on the tiny model writing real Parquet parts into the store, which the flow
checks and publishes. Faults come from LAYERTAP_FAULTS, which a run hands to its engines with each batch.

The module's runs share the two engines (the registry is pinned); they are stopped at the module's end.
"""

from __future__ import annotations

from pathlib import Path

import duckdb
import numpy as np
import pytest

pytest.importorskip("ray")

from task_runs import extract_run_counts  # noqa: E402

from bench.incremental import write_csv  # noqa: E402
from layertap import Store, faults  # noqa: E402
from layertap.runner import engine_cache  # noqa: E402
from flows.cli import main  # noqa: E402
from layertap.settings import load_settings  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("prefect_harness", "shared_engine")]

RAY = {"executor": "ray", "engines": 2}


def prompts(n: int, topic: str) -> list[str]:
    return [f"{topic} prompt {i}: the river {i * 7 % 13} passes the clock tower {i % 11} at dawn" for i in range(n)]


@pytest.fixture(scope="module")
def engines(tiny_model):
    """The module's two Ray engines (started by its first run), stopped with their cluster at its end."""
    settings = load_settings(env_file=None, model=tiny_model, **RAY)
    yield lambda: engine_cache.open_runner(settings)
    engine_cache.discard_runner(settings)
    import ray

    assert not ray.is_initialized()  # the local cluster went with its engines


@pytest.fixture(autouse=True)
def fresh_fault_counters():
    faults.reset()
    yield
    faults.reset()


@pytest.fixture
def run(tiny_model, tmp_path):
    from flows.embed import embed_flow

    def go(source: str, store: Path, **params):
        params = {"layers": "all", "parity_sample": 2, **params}
        state = embed_flow(input=[source], model=tiny_model, store=str(store), env_file=None, return_state=True,
                           **params)
        return state.result(), state.state_details.flow_run_id

    return go


def layer_vectors(store: Path, layer: int) -> tuple[list[str], np.ndarray]:
    table = Store(store).embeddings(layer=layer).sort_by("prompt_hash")
    vectors = table["embedding"].combine_chunks().flatten().to_numpy().reshape(table.num_rows, -1)
    return table["prompt_hash"].to_pylist(), vectors


def published(store: Path) -> tuple[list[str], list[tuple[str, int]]]:
    """Published part files (paths), and how often each prompt appears across them."""
    with duckdb.connect(str(store / "layertap.duckdb"), read_only=True) as con:
        paths = [row[0] for row in con.execute("SELECT path FROM parts ORDER BY path").fetchall()]
        counts = con.execute("SELECT prompt_hash, count(*) FROM part_prompts GROUP BY prompt_hash").fetchall()
    return paths, counts


def files_in_parts(store: Path) -> list[str]:
    return sorted(p.relative_to(store).as_posix() for p in (store / "parts").rglob("*.parquet"))


def batch_of(path: str) -> str:
    """The batch's content id of a part file named <content>-a<attempt>.parquet."""
    return Path(path).stem.rsplit("-a", 1)[0]


def test_two_engines_store_what_a_local_run_stores(run, engines, tmp_path):
    source = write_csv(tmp_path / "in.csv", prompts(600, "parity"))
    local, _ = run(source, tmp_path / "local", batch_size=64)
    remote, _ = run(source, tmp_path / "ray", batch_size=64, **RAY)
    assert remote["embedded"] == local["embedded"] == 600 and not remote["quarantined"]
    assert remote["ledger"] == local["ledger"]
    assert remote["layers"] == local["layers"] == [0, 1, 2, 3, 4]
    for layer in remote["layers"]:
        ours, theirs = layer_vectors(tmp_path / "ray", layer), layer_vectors(tmp_path / "local", layer)
        assert ours[0] == theirs[0]  # the same (prompt, layer) set
        np.testing.assert_allclose(ours[1], theirs[1], rtol=0, atol=1e-6)
    assert main(["validate", "--store", str(tmp_path / "ray")]) == 0
    done = engines().batches_done()
    assert len(done) == 2 and all(n > 0 for n in done.values()) and sum(done.values()) == 10, done
    paths, counts = published(tmp_path / "ray")
    assert all(Path(p).stem.endswith("-a1") for p in paths)  # named by batch and attempt

    # A rerun plans nothing and starts no engine: from the command line without Prefect or the cluster, and
    # as a flow run (a deployment's), which asks no engine for anything.
    started, asked = engine_cache.engines_started(), engine_cache.runner_requests()
    argv = ["run", "--input", source, "--model", engines().settings.model, "--store", str(tmp_path / "ray"),
            "--layers", "all", "--executor", "ray", "--engines", "2", "--batch-size", "64"]
    assert main(argv) == 0
    again, _ = run(source, tmp_path / "ray", batch_size=64, **RAY)
    assert again["planned"] == again["embedded"] == 0 and again["ledger"]["embedded"] == 600
    assert (engine_cache.engines_started(), engine_cache.runner_requests()) == (started, asked)
    assert engines().batches_done() == done


def test_an_engine_killed_once_mid_batch(run, engines, tmp_path, monkeypatch):
    """The actor dies after its part file reached parts/, before it answered: that file is an orphan."""
    marker = tmp_path / "killed"
    monkeypatch.setenv(faults.ENV, f"write.renamed:killonce={marker}")
    texts = prompts(192, "killed")
    summary, flow_run_id = run(write_csv(tmp_path / "in.csv", texts), tmp_path / "store", batch_size=32, **RAY)
    assert marker.exists()  # an engine was killed
    assert summary["embedded"] == len(texts) and not summary["quarantined"]
    assert not (tmp_path / "store" / "quarantine").exists()
    counts = extract_run_counts(flow_run_id)
    assert len(counts) == 6 and counts[-1] == 2, counts  # the killed batch (and any beside it) retried once
    paths, per_prompt = published(tmp_path / "store")
    assert len(per_prompt) == len(texts) and {n for _, n in per_prompt} == {1}  # every (prompt, layer) once
    assert len({batch_of(p) for p in paths}) == len(paths) == 6  # one attempt of each batch published
    assert any(Path(p).stem.endswith("-a2") for p in paths)
    assert files_in_parts(tmp_path / "store") == paths  # the orphan (an -a1 beside an -a2) never published, swept
    assert Store(tmp_path / "store").embeddings(layer=-1).num_rows == len(texts)


def test_a_probe_answered_by_the_instance_going_down_does_not_bring_its_engine_back(engines, tiny_model):
    """A hung engine is killed and probed at once; the instance being killed can answer before the kill lands
    (an actor serves calls beside the hung batch). Its answer must not mark the engine up, or the batch's
    retry goes to the engine that is restarting. Here the kill never lands, so every answer is the old one."""
    import ray

    ray_engines = engine_cache.get_runner(load_settings(env_file=None, model=tiny_model, **RAY))
    engine = ray_engines.engines[0]
    ray_engines._settle(engine, wait=True)
    alive = engine.report["pid"]
    ray_engines._restarting(engine)
    try:
        ray.wait([engine.probe])
        ray_engines._settle(engine, wait=False)
        assert engine.probe is not None and not engine.dead  # asked again: still taken as restarting
    finally:
        engine.gone_pid, engine.deaths = None, engine.deaths - 1
        ray_engines._settle(engine, wait=True)
    assert engine.probe is None and engine.report["pid"] == alive


def test_a_hung_batch_times_out_and_is_retried_on_another_engine(run, engines, tmp_path, monkeypatch):
    marker = tmp_path / "hung"
    monkeypatch.setenv(faults.ENV, f"extract:hangonce={marker}")
    texts = prompts(96, "hung")
    summary, flow_run_id = run(write_csv(tmp_path / "in.csv", texts), tmp_path / "store", batch_size=32,
                               layers="0,-1", batches_in_flight=1, batch_timeout=10, **RAY)
    assert marker.exists()  # a batch hung
    assert summary["embedded"] == len(texts) and not summary["quarantined"]
    assert extract_run_counts(flow_run_id) == [1, 1, 2]
    paths, per_prompt = published(tmp_path / "store")
    assert len(per_prompt) == len(texts) and {n for _, n in per_prompt} == {1}
    assert files_in_parts(tmp_path / "store") == paths


def test_a_batch_that_kills_its_engine_every_time(run, engines, tmp_path, monkeypatch):
    texts = prompts(12, "poison")
    source = write_csv(tmp_path / "in.csv", texts)
    monkeypatch.setenv(faults.ENV, f"extract:killon={texts[5]}")
    # One batch at a time: a batch in flight beside it on the engine it kills would fail with it.
    summary, flow_run_id = run(source, tmp_path / "store", batch_size=4, layers="0,-1", batches_in_flight=1, **RAY)
    assert [q["prompts"] for q in summary["quarantined"]] == [4]
    assert "died during batch" in summary["quarantined"][0]["error"]
    assert summary["embedded"] == 8
    assert extract_run_counts(flow_run_id) == [1, 1, 3]  # three attempts, each on an engine that was up
    ledger = [(row["status"], row["reason"]) for row in Store(tmp_path / "store").ledger().to_pylist()]
    assert [s for s, _ in ledger].count("quarantined") == 4 and [s for s, _ in ledger].count("embedded") == 8
    assert all("died during batch" in reason for status, reason in ledger if status == "quarantined")

    monkeypatch.delenv(faults.ENV)
    again, _ = run(source, tmp_path / "store", batch_size=4, layers="0,-1", **RAY)
    assert again["planned"] == again["embedded"] == 4 and not again["quarantined"]
    assert [row["status"] for row in Store(tmp_path / "store").ledger().to_pylist()] == ["embedded"] * 12


def test_an_engine_serving_another_model_is_refused(engines):
    """Every engine reports what it serves when it is up; the flow refuses one that differs from its own."""
    from layertap.errors import EngineError

    pool = engines()
    engine = next(e for e in pool.engines if not e.dead)
    if engine.probe is None:
        engine.probe = engine.handle.ready.remote()  # ask it again, as once it has restarted
    expected = pool.expected
    pool.expected = {**expected, "fingerprint": "0" * 64}  # the fault: the flow's model changed meanwhile
    try:
        with pytest.raises(EngineError, match=r"serves fingerprint \w+ where this flow has 0{64}: refusing it"):
            pool._settle(engine, wait=True)
    finally:
        pool.expected = expected
    assert engine.dead
