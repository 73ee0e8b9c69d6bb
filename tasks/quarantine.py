"""Set aside a batch that keeps failing, so the rest of the run can finish."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from layertap.store.plan import WorkBatch
from layertap.store.store_db import StoreDB


@task(name="quarantine-batch", cache_policy=NO_CACHE, result_serializer="json")
def quarantine_batch(store: str, batch: WorkBatch, error: str) -> dict:
    """Record the batch and its error: the ledger shows its rows as quarantined, a rerun tries it again.
    Returns the summary's record of it."""
    StoreDB(store).quarantine_batch(batch.batch_id, batch.extraction_id, error)
    get_run_logger().error(
        "quarantined batch %s (%d prompts) after its retries: %s", batch.batch_id, batch.num_prompts, error
    )
    return {"batch_id": batch.batch_id, "prompts": batch.num_prompts, "error": error}
