"""Served flow runs start in processes forked from a server that imported the flows beforehand: Prefect's
direct-subprocess starter, pointed at it, runs a real flow run there on the suite's Prefect server."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import prefect.runner._starter_direct as starter
from prefect import flow

from flows.run_launcher import RUN_MODULES, preload_modules, start_runs_forked


@flow
def where_am_i(report: str) -> None:
    """Writes which process ran it and whether the flows' pipeline was already imported when it started."""
    Path(report).write_text(json.dumps({"pid": os.getpid(), "parent": os.getppid(),
                                        "pipeline_loaded": "flows.pipeline" in sys.modules}))


def test_preload_is_the_loaded_flow_modules_and_what_a_run_imports():
    loaded = ["flows.pipeline", "tasks.extract", "layertap.store.plan", "prefect.flows", "torch", "embed"]
    assert preload_modules(loaded) == sorted({"flows.pipeline", "tasks.extract", "layertap.store.plan", *RUN_MODULES})


def test_a_flow_run_starts_in_a_process_forked_ready_imported(prefect_harness, tmp_path, monkeypatch):
    from prefect.client.orchestration import get_client

    monkeypatch.setattr(starter, "run_flow_in_subprocess", starter.run_flow_in_subprocess)  # restored after
    # What a served process has loaded: here only what the test imports, so the pipeline is named outright.
    assert start_runs_forked(preload_modules() + ["flows.pipeline"])

    report = tmp_path / "report.json"
    process = starter.run_flow_in_subprocess(where_am_i, parameters={"report": str(report)})
    process.join(timeout=120)
    assert process.exitcode == 0
    seen = json.loads(report.read_text())
    assert seen["pid"] == process.pid
    assert seen["parent"] != os.getpid()  # a child of the fork server, not of this process
    assert seen["pipeline_loaded"]  # a spawned interpreter would not have imported it

    with get_client(sync_client=True) as client:  # reported to the server as a spawned run would be
        runs = [run for run in client.read_flow_runs() if run.parameters.get("report") == str(report)]
    assert [run.state.type.value for run in runs] == ["COMPLETED"]
