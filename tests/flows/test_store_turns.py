"""Deployment runs that share a store take turns: on a real Prefect server with `layertap serve`, the
nightly run holds the store (held at a fault point), a triggered run of another deployment on the same store
waits for the store's concurrency limit, then runs and completes once the first is done."""

from __future__ import annotations

import sys
import time

import httpx
import pytest
from test_prefect_yaml import PREFECT, Server, write_csv

FINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")


def post(server: Server, path: str, body: dict):
    """The server's answer, asking again while it is too busy to give one (503 on a loaded machine)."""
    for _ in range(20):
        try:
            return server.post(path, body)
        except httpx.HTTPStatusError as exc:
            if exc.response.status_code < 500:
                raise
        time.sleep(1)
    return server.post(path, body)


def flow_run(server: Server, run_id: str) -> dict:
    [run] = post(server, "/flow_runs/filter", {"flow_runs": {"id": {"any_": [run_id]}}})
    return run


def wait_until(what, timeout: float, server: Server, why: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = what()
        if found:
            return found
        time.sleep(0.5)
    pytest.fail(f"{why} within {timeout}s\n{server.tail()}")


@pytest.mark.timeout(600)
def test_a_triggered_run_waits_for_the_store_another_deployment_run_holds(tmp_path, tiny_model):
    from flows.store_turn import limit_name
    from flows.cli import main
    from layertap.store.registry import read_status
    from layertap.store.store_db import StoreDB

    # A dataset whose rows are all rejected and already read: its runs plan nothing and start no engine.
    store, gate = tmp_path / "store", tmp_path / "first-run-may-finish"
    rows = write_csv(tmp_path / "rows.csv", ["", "   "])
    assert main(["add", "--dataset", "turns", "--input", rows, "--store", str(store), "--model", tiny_model,
                 "--layers", "0,-1", "--no-event"]) == 0
    StoreDB(store).ingest([rows], "text")

    server = Server(tmp_path / "prefect-home")
    server.env["LAYERTAP_FAULTS"] = f"store-lock.acquired:wait={gate}"  # a run holding the store waits here
    server.start("server", PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(server.port))
    try:
        server.wait_healthy()
        server.start("serve", sys.executable, "-m", "flows.cli", "serve")
        deployments = wait_until(lambda: {d["name"]: d for d in post(server, "/deployments/filter", {})}
                                 if len(post(server, "/deployments/filter", {})) == 3 else None,
                                 180, server, "layertap serve did not register the deployments")

        def limit() -> dict | None:
            return next((c for c in post(server, "/v2/concurrency_limits/filter", {})
                         if c["name"] == limit_name(store)), None)

        def start(deployment: str, **parameters) -> str:
            return post(server, f"/deployments/{deployments[deployment]['id']}/create_flow_run",
                        {"parameters": parameters})["id"]

        # The nightly run takes the store's slot and holds the store.
        nightly = start("embed-nightly", store=str(store))
        wait_until(lambda: (limit() or {}).get("active_slots") == 1, 120, server, "the nightly run took no slot")
        # A run of another deployment on the same store: it runs, waiting for its turn.
        triggered = start("embed-new-rows", dataset="turns", store=str(store))

        def waiting() -> bool:
            logs = post(server, "/logs/filter", {"logs": {"flow_run_id": {"any_": [triggered]}}})
            return any("waiting for its turn" in log["message"] and limit_name(store) in log["message"]
                       for log in logs)

        wait_until(waiting, 120, server, "the triggered run did not wait for the store's concurrency limit")
        time.sleep(2)
        assert flow_run(server, triggered)["state"]["type"] == "RUNNING"
        assert flow_run(server, nightly)["state"]["type"] == "RUNNING"
        assert limit()["active_slots"] == 1

        opened = time.time()
        gate.touch()  # the nightly run finishes; then the triggered one has its turn
        for run_id in (nightly, triggered):
            done = wait_until(lambda: flow_run(server, run_id)["state"]["type"] in FINAL and flow_run(server, run_id),
                              180, server, f"run {run_id} did not finish")
            assert done["state"]["type"] == "COMPLETED", server.tail()
        assert limit()["active_slots"] == 0
    finally:
        server.stop()

    # The store's history: both completed, the triggered run in the store only after the gate let the nightly
    # run go on (the fault point lies before a run records itself), and after it.
    runs = {r["flow_run_id"]: r for r in read_status(store, last_runs=5)["runs"]}
    [triggered_run] = [runs.pop(triggered)]
    [nightly_run] = runs.values()  # recorded by the nightly run's sub-run for the dataset
    assert triggered_run["status"] == nightly_run["status"] == "completed"
    assert opened <= nightly_run["started_at"].timestamp() <= triggered_run["started_at"].timestamp()
