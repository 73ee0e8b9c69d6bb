"""The end-of-run check that the store holds exactly what the run was asked for."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from layertap import faults
from layertap.validate import check_ledger
from layertap.store import StoreDB


@task(name="validate-store", cache_policy=NO_CACHE, result_serializer="json")
def validate_store(
    store: str, rules_id: str, extraction_id: str, layers: list[int], sources: list[str] | None = None
) -> dict:
    """One result per planned prompt and layer (but those of quarantined batches), and a ledger that accounts
    for every input row (of `sources`, or of the whole store if None)."""
    db = StoreDB(store)
    db.sweep_staging(min_age_s=0)  # the run holds the store's lock: any unpublished file is a leftover
    counts = db.ledger_counts(rules_id, extraction_id, list(layers), sources)
    faults.hit("validate-store.counted")  # every batch published, the ledger not yet checked
    check_ledger(counts, layers)
    get_run_logger().info(
        "validate store: %s",
        ", ".join(f"{k} {v}" for k, v in counts.items() if not isinstance(v, dict)),
    )
    return counts
