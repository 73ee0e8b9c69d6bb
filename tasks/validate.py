"""The end-of-run check that the store holds exactly what the run was asked for."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from layertap.store.store_db import StoreDB
from layertap.parts.checks import check_store_complete


@task(name="validate-store", cache_policy=NO_CACHE, result_serializer="json")
def validate_store(
    store: str, rules_id: str, extraction_id: str, layers: list[int], sources: list[str] | None = None
) -> dict:
    """One result per planned prompt and layer (but those of quarantined batches), and a ledger that accounts
    for every input row (of `sources`, or of the whole store if None)."""
    counts = check_store_complete(StoreDB(store), rules_id, extraction_id, layers, sources)
    get_run_logger().info(
        "validate store: %s",
        ", ".join(f"{k} {v}" for k, v in counts.items() if not isinstance(v, dict)),
    )
    return counts
