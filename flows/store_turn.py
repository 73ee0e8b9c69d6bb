"""Deployment runs that share a store take turns through a Prefect global concurrency limit of one slot per
store, named from the store's path (`layertap-store-<folder>-<hash>`).

The three deployments (embed, embed-new-rows, embed-nightly) may all point at one store. A run holds its
store's slot for its whole duration, so a triggered run that arrives while the nightly run works waits its
turn (visible in the Prefect UI's concurrency limits, and in the run's logs) and then runs; the slot is a
lease that Prefect frees if its holder dies. The store's own lock (`layertap.store.lock`) still guards the
store against runs that take no slot (`layertap run` from a shell).
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import time
from collections.abc import Iterator
from pathlib import Path

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.concurrency.sync import concurrency
from prefect.exceptions import ObjectAlreadyExists

from layertap.store.lock import LOCK_NAME, StoreLocked, describe_holder


def limit_name(store_dir: str | Path) -> str:
    """The concurrency limit of one store: readable (its folder's name) and unique (a hash of its path)."""
    root = str(Path(store_dir).expanduser().resolve())
    folder = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(root).name).strip("-")[:40] or "store"
    return f"layertap-store-{folder}-{hashlib.sha256(root.encode()).hexdigest()[:12]}"


def _ensure_limit(name: str) -> int:
    """Create the store's one-slot limit if no run has yet; returns the slots taken now."""
    with get_client(sync_client=True) as client:
        try:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
        except ObjectAlreadyExists:
            pass
        return client.read_global_concurrency_limit_by_name(name).active_slots


@contextlib.contextmanager
def store_turn(store_dir: str | Path, timeout_s: float, logger) -> Iterator[float]:
    """Hold the store's concurrency slot inside the block, waiting up to `timeout_s` for it; yields the seconds
    left of `timeout_s` for the store's own lock."""
    name = limit_name(store_dir)
    if _ensure_limit(name):
        logger.info("store %s: waiting for its turn (concurrency limit %s): another deployment run holds it: %s",
                    store_dir, name, describe_holder(Path(store_dir) / LOCK_NAME))
    started = time.monotonic()
    turn = contextlib.ExitStack()
    try:
        turn.enter_context(concurrency(name, occupy=1, timeout_seconds=max(timeout_s, 1.0), strict=True,
                                       raise_on_lease_renewal_failure=False))
    except TimeoutError:
        raise StoreLocked(
            f"{store_dir}: another deployment run held the store (concurrency limit {name}) for longer than "
            f"{timeout_s:g}s: {describe_holder(Path(store_dir) / LOCK_NAME)} (set lock_timeout, e.g. "
            "LAYERTAP_LOCK_TIMEOUT, to wait longer)"
        ) from None
    with turn:
        waited = time.monotonic() - started
        if waited >= 1.0:
            logger.info("store %s: our turn after %.1fs", store_dir, waited)
        yield max(timeout_s - waited, 0.0)
