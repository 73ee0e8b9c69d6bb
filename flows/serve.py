"""Serve the deployments of prefect.yaml from one process (`layertap serve`), without a work pool.

prefect.yaml stays the one place that says which deployments exist, with which triggers and schedules;
this reads it and hands the same definitions to `prefect.serve`.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml
from prefect import serve
from prefect.events.schemas.deployment_triggers import DeploymentEventTrigger
from prefect.flows import load_flow_from_entrypoint
from prefect.schedules import Cron

_KEYS = ("description", "tags", "parameters", "concurrency_limit")
# How often the runner asks the server for due runs. Each ask makes the server write the deployments'
# last-polled time; on a SQLite-backed server a write that lands while a trigger is creating its flow run
# makes that creation fail as busy, and Prefect's in-server client retries it only after 2 s. A poll every
# second keeps those collisions rare (bench/incremental.py counts them) for half a second of pick-up on
# average.
POLL_SECONDS = 1.0


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
    """Register the deployments and run their flow runs here until interrupted. Scheduled runs are looked
    for every POLL_SECONDS (Prefect's default is 10 s; PREFECT_RUNNER_POLL_FREQUENCY still wins), so a
    triggered run starts about a second after its event."""
    poll = os.environ.get("PREFECT_RUNNER_POLL_FREQUENCY")
    serve(*deployments_from_prefect_file(prefect_file), query_seconds=float(poll) if poll else POLL_SECONDS)
