"""Start a served deployment's run as soon as the server has created it, without polling the server often.

Each time a Prefect runner looks for due runs, the server writes the deployments' last-polled time. On a
SQLite-backed server (`prefect server start`'s default) a write that lands while a trigger's
run-deployment action creates its flow run fails that creation as busy, and the server retries it only
after 2 s. So `layertap serve` looks rarely on its own and listens instead: the server streams each flow
run's Scheduled event over its events websocket (read only; Prefect's own cancellation observer listens the
same way), and on one for a served deployment the runner looks for due runs at once. If the stream is down,
the runner's own polling still finds every run.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Iterable
from uuid import UUID

from prefect.events.clients import get_events_subscriber
from prefect.events.filters import EventFilter, EventNameFilter, EventOccurredFilter, EventRelatedFilter
from prefect.logging import get_logger
from prefect.runner import Runner

SCHEDULED = "prefect.flow-run.Scheduled"
RECONNECT_SECONDS = 5.0

logger = get_logger("layertap.serve")


def scheduled_filter(deployment_ids: Iterable[UUID]) -> EventFilter:
    """Scheduled events of these deployments' flow runs, from now on (no backfill of older ones)."""
    return EventFilter(
        event=EventNameFilter(name=[SCHEDULED]),
        related=EventRelatedFilter(id=[f"prefect.deployment.{i}" for i in deployment_ids]),
        occurred=EventOccurredFilter(since=dt.datetime.now(dt.timezone.utc)),
    )


async def start_runs_when_scheduled(runner: Runner, deployment_ids: list[UUID]) -> None:
    """Until cancelled: on each Scheduled event of a served deployment, have `runner` look for due runs.

    The look is the runner's own poll (`_get_and_submit_flow_runs`, the step its polling loop repeats), so
    a run it starts is submitted, watched, cancelled and reported exactly as a polled one; a run both
    find is submitted once (the runner skips runs it is already submitting)."""
    look = getattr(runner, "_get_and_submit_flow_runs", None)
    if look is None:
        logger.warning("this Prefect's runner cannot be asked to look for runs: served runs start on its polls")
        return
    while True:
        try:
            async with get_events_subscriber(filter=scheduled_filter(deployment_ids)) as events:
                async for _ in events:
                    if runner.started and not runner.stopping:
                        try:
                            await look()
                        except Exception as exc:  # noqa: BLE001 - the next event or poll looks again
                            logger.warning("looking for due runs failed: %s", exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - polling goes on meanwhile
            logger.warning("the events stream is down (%s); served runs start on polls until it is back", exc)
        await asyncio.sleep(RECONNECT_SECONDS)
