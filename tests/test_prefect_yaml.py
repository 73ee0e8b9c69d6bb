"""prefect.yaml end to end: a real Prefect server on 127.0.0.1, `prefect deploy --all`, a process worker,
and the rows-added event sent by `layertap add` triggering an incremental run of that dataset only.

The dataset's first rows are embedded in this process (sharing the suite's engine); the worker's flow run
then has to embed only the rows added afterwards, in its own process, and leave earlier results untouched.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import duckdb
import httpx
import pytest

from bench.incremental import free_port, write_csv  # the benchmark drives the same path

ROOT = Path(__file__).resolve().parents[1]
PREFECT = str(Path(sys.executable).with_name("prefect"))
FIRST = [f"First batch row number {i}." for i in range(8)] + ["First batch row number 0.", ""]
ADDED = ["A row added later.", "Another later row", "First batch row number 3.", "A row added later."]


def parts(store: Path) -> list[tuple]:
    with duckdb.connect(str(store / "layertap.duckdb"), read_only=True) as con:
        return con.execute("SELECT part_id, path, num_prompts FROM parts ORDER BY created_at").fetchall()


class Server:
    """`prefect server start` in its own PREFECT_HOME, plus the processes started against it."""

    def __init__(self, home: Path) -> None:
        self.port = free_port()
        self.api = f"http://127.0.0.1:{self.port}/api"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("LAYERTAP_", "PREFECT_"))}
        self.env.update(
            PREFECT_HOME=str(home),
            PREFECT_API_URL=self.api,
            PREFECT_SERVER_ANALYTICS_ENABLED="false",
            PREFECT_CLI_PROMPT="false",
            PREFECT_WORKER_QUERY_SECONDS="2",
            PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            VLLM_LOGGING_LEVEL="WARNING",
            LAYERTAP_PARITY_SAMPLE="2",
            # Deployment runs keep their engine warm: here, where the test can stop it (socket paths stay short).
            LAYERTAP_ENGINE_DIR=tempfile.mkdtemp(prefix="lt-engines-", dir="/tmp"),
        )
        self.logs = home / "logs"
        self.logs.mkdir(parents=True)
        self.procs: list[subprocess.Popen] = []

    def serve_deployments(self, timeout: float = 180) -> None:
        """Start `layertap serve` against this server; return once it has registered prefect.yaml's three
        deployments."""
        self.start("serve", sys.executable, "-m", "flows.cli", "serve")
        deadline = time.monotonic() + timeout
        while len(self.post("/deployments/filter", {})) < 3:
            if time.monotonic() > deadline or self.procs[-1].poll() is not None:
                pytest.fail(f"layertap serve did not register the deployments\n{self.tail()}")
            time.sleep(1)

    def start(self, name: str, *args: str) -> subprocess.Popen:
        log = (self.logs / f"{name}.log").open("w")
        proc = subprocess.Popen(args, env=self.env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.procs.append(proc)
        return proc

    def run(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
        out = subprocess.run(args, env=self.env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        assert out.returncode == 0, f"{' '.join(args)}\n{out.stdout}\n{out.stderr}"
        return out

    def wait_healthy(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.procs[0].poll() is not None:
                pytest.fail(f"prefect server exited: {(self.logs / 'server.log').read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.api}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        pytest.fail("prefect server did not become healthy")

    def post(self, path: str, body: dict) -> list:
        response = httpx.post(f"{self.api}{path}", json=body, timeout=30)
        response.raise_for_status()
        return response.json()

    def stop(self) -> None:
        from layertap.runner.warm_engine import stop_engines

        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        stop_engines(self.env["LAYERTAP_ENGINE_DIR"])

    def tail(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.logs.glob("*.log")))


@pytest.fixture
def server(tmp_path):
    srv = Server(tmp_path / "prefect-home")
    srv.start("server", PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(srv.port))
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


def wait_for_run(server: Server, deployment_name: str, timeout: float = 420) -> dict:
    """The deployment's single flow run, once it is in a final state."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runs = server.post(
            "/flow_runs/filter", {"deployments": {"name": {"any_": [deployment_name]}}, "sort": "START_TIME_ASC"}
        )
        if runs and runs[-1]["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            return runs[-1]
        time.sleep(2)
    pytest.fail(f"no finished {deployment_name} run within {timeout}s\n{server.tail()}")


@pytest.mark.timeout(900)
def test_rows_added_event_runs_the_dataset_incrementally(server, tmp_path, tiny_model, shared_engine):
    from flows.embed_dataset import embed_dataset_flow
    from layertap import Store
    from flows.cli import main

    # Deployments and a worker, exactly as the README tells people to set them up.
    server.run(PREFECT, "work-pool", "create", "layertap", "--type", "process")
    server.run(PREFECT, "deploy", "--all", "--prefect-file", str(ROOT / "prefect.yaml"), timeout=300)
    deployments = {d["name"]: d for d in server.post("/deployments/filter", {})}
    assert set(deployments) == {"embed", "embed-new-rows", "embed-nightly"}
    assert [s["schedule"]["cron"] for s in deployments["embed-nightly"]["schedules"]] == ["0 2 * * *"]
    automations = server.post("/automations/filter", {})
    assert [a["trigger"]["expect"] for a in automations] == [["layertap.dataset.rows-added"]]
    server.start("worker", PREFECT, "worker", "start", "--pool", "layertap", "--type", "process")

    # The dataset's first rows, embedded here (no event: this process talks to the test harness).
    store = tmp_path / "store"
    first = write_csv(tmp_path / "first.csv", FIRST)
    assert main(["add", "--dataset", "reviews", "--input", first, "--store", str(store), "--model", tiny_model,
                 "--layers", "0,-1", "--no-event"]) == 0
    before = embed_dataset_flow("reviews", str(store), None, {"parity_sample": 2})
    assert before["embedded"] == 8 and before["ledger"]["rejected"] == 1
    parts_before = parts(store)

    # New rows through the CLI, as a user adds them: the event reaches the server, the trigger runs the flow.
    added = write_csv(tmp_path / "added.csv", ADDED)
    out = server.run(sys.executable, "-m", "flows.cli", "add", "--dataset", "reviews", "--input", added,
                     "--store", str(store), "--json")
    result = json.loads(out.stdout)
    assert result["new_files"] == [added] and result["event"], out.stderr

    run = wait_for_run(server, "embed-new-rows")
    assert run["state"]["type"] == "COMPLETED", server.tail()
    assert run["parameters"]["dataset"] == "reviews" and run["parameters"]["store"] == str(store)

    # Only the two new prompts were embedded; the first part is untouched; every row is accounted for.
    after = parts(store)
    assert after[: len(parts_before)] == parts_before
    assert [n for _, _, n in after[len(parts_before):]] == [2]
    ledger = Store(store).ledger().to_pylist()
    assert len(ledger) == len(FIRST) + len(ADDED)
    statuses = [row["status"] for row in ledger]
    assert (statuses.count("embedded"), statuses.count("duplicate"), statuses.count("rejected")) == (10, 3, 1)
    assert Store(store).embeddings(layer=-1).num_rows == 10

    # The run's page shows the counts table, the markdown summary and a finished progress bar.
    artifacts = server.post("/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [run["id"]]}}})
    by_type = {a["type"]: a for a in artifacts}
    assert set(by_type) >= {"table", "markdown", "progress"}
    table = {row["count"]: row["value"] for row in json.loads(by_type["table"]["data"])}
    assert table["input rows"] == len(FIRST) + len(ADDED) and table["new rows"] == len(ADDED)
    assert table["embedded"] == 2 and table["skipped by cache"] == 8 and table["rejected: empty after normalisation"] == 1
    assert "2 prompts embedded for dataset `reviews`" in by_type["markdown"]["data"]
    assert by_type["progress"]["data"] == 100.0
