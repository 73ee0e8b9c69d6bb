"""`layertap serve` on a real Prefect server: it looks for due runs on its own only every POLL_SECONDS (each
look is a write on the server, which a trigger's flow-run creation must not collide with), yet starts each
triggered run right after the trigger created it, on the run's Scheduled event."""

from __future__ import annotations

import sys
import time

import httpx
import pytest
from test_prefect_yaml import PREFECT, Server, write_csv

from bench.incremental import parse_time
from flows.serve import POLL_SECONDS

FINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")


@pytest.fixture
def served(tmp_path):
    srv = Server(tmp_path / "prefect-home")
    srv.start("server", PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(srv.port))
    try:
        srv.wait_healthy()
        srv.serve_deployments()
        yield srv
    finally:
        srv.stop()


def polls_seen(server: Server, seconds: float) -> int:
    """How many times the server recorded a poll of the served deployments within `seconds`."""
    seen = set()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        seen.update(d["last_polled"] for d in server.post("/deployments/filter", {}) if d["name"] == "embed-new-rows")
        time.sleep(0.05)
    return len(seen)


@pytest.mark.timeout(600)
def test_serve_polls_rarely_and_starts_triggered_runs_on_their_scheduled_event(served, tmp_path, tiny_model):
    # Few recorded polls (Prefect jitters the interval by up to 30 %), so few writes a trigger could meet.
    window = 8.0
    polls = polls_seen(served, window)
    assert 1 <= polls <= window / POLL_SECONDS * 1.4 + 1, polls

    # Triggered runs (an empty file each: no engine) are picked up well before the next poll.
    store = tmp_path / "store"
    for i in range(3):
        options = ["--model", tiny_model] if i == 0 else []
        served.run(sys.executable, "-m", "flows.cli", "add", "--dataset", "quick", "--store", str(store),
                   "--input", write_csv(tmp_path / f"empty{i}.csv", []), "--json", *options)
        deadline = time.monotonic() + 300
        while True:
            runs = served.post("/flow_runs/filter", {"deployments": {"name": {"any_": ["embed-new-rows"]}}})
            if len(runs) == i + 1 and all(r["state"]["type"] in FINAL for r in runs):
                break
            assert time.monotonic() < deadline, f"run {i + 1} did not finish\n{served.tail()}"
            time.sleep(0.5)
    for run in runs:
        assert run["state"]["type"] == "COMPLETED", served.tail()
        states = {}
        found = httpx.get(f"{served.api}/flow_run_states/", params={"flow_run_id": run["id"]}, timeout=30)
        for state in found.json():
            states.setdefault(state["type"], parse_time(state["timestamp"]))
        picked_up = states["PENDING"] - states["SCHEDULED"]
        assert picked_up <= 1.5 < POLL_SECONDS * 0.7, (picked_up, states)
