"""Serve the deployments of prefect.yaml from one process (`layertap serve`), without a work pool.

prefect.yaml stays the one place that says which deployments exist, with which triggers and schedules;
this reads it and hands the same definitions to a Prefect `Runner`, as `prefect.serve` does, with
flows/run_wake.py starting each triggered run as soon as the server has created it, in a process forked
ready-imported (flows/run_launcher.py).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import anyio
import yaml
from prefect.events.schemas.deployment_triggers import DeploymentEventTrigger
from prefect.exceptions import TerminationSignal
from prefect.flows import load_flow_from_entrypoint
from prefect.runner import Runner
from prefect.schedules import Cron

from flows.run_launcher import preload_modules, start_runs_forked
from flows.run_wake import start_runs_when_scheduled

_KEYS = ("description", "tags", "parameters", "concurrency_limit")
# How often the runner looks for due runs on its own: scheduled runs (the nightly one) start at most this
# late. Triggered runs start as soon as they are created (flows/run_wake.py); each look is a write on the
# server that a trigger's flow-run creation can collide with, so looks are rare.
POLL_SECONDS = 5.0


def deployments_from_prefect_file(prefect_file: str | Path) -> list:
    """One RunnerDeployment per entry of the file's `deployments`, entrypoints relative to the file."""
    path = Path(prefect_file).expanduser().resolve()
    spec = yaml.safe_load(path.read_text())
    found = []
    for entry in spec.get("deployments") or []:
        file, _, name = entry["entrypoint"].partition(":")
        flow = load_flow_from_entrypoint(f"{path.parent / file}:{name}")
        options = {key: entry[key] for key in _KEYS if entry.get(key) is not None}
        triggers = [
            DeploymentEventTrigger(**{k: v for k, v in trigger.items() if k != "type"})
            for trigger in entry.get("triggers") or []
            if trigger.get("type", "event") == "event"
        ]
        schedules = [
            Cron(s["cron"], timezone=s.get("timezone"), active=s.get("active", True))
            for s in entry.get("schedules") or []
        ]
        found.append(
            flow.to_deployment(name=entry["name"], triggers=triggers or None, schedules=schedules or None, **options)
        )
    return found


def serve_from_prefect_file(prefect_file: str | Path) -> None:
    """Register the deployments and run their flow runs here until interrupted. Due runs are looked for
    every POLL_SECONDS (Prefect's default is 10 s; PREFECT_RUNNER_POLL_FREQUENCY, in whole seconds, still
    wins) and whenever the server announces a new run of one of them."""
    poll = os.environ.get("PREFECT_RUNNER_POLL_FREQUENCY")
    runner = Runner(pause_on_shutdown=True, query_seconds=float(poll) if poll else POLL_SECONDS)
    deployment_ids = [runner.add_deployment(d) for d in deployments_from_prefect_file(prefect_file)]
    start_runs_forked(preload_modules())  # with the flows loaded: the fork server imports what they did
    try:
        asyncio.run(_serve(runner, deployment_ids))
    except (KeyboardInterrupt, TerminationSignal):
        pass


async def _serve(runner: Runner, deployment_ids: list) -> None:
    async with anyio.create_task_group() as group:
        group.start_soon(start_runs_when_scheduled, runner, deployment_ids)
        await runner.start()
        group.cancel_scope.cancel()
