"""Pin down the extraction key and work out which (prompt, layer) results are still missing."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from layertap.prepared_run import PreparedRun
from layertap.store.plan import WorkBatch
from layertap.store.store_db import StoreDB


@task(name="register-extraction", cache_policy=NO_CACHE, result_serializer="json")
def register_extraction(store: str, run: PreparedRun) -> str:
    """Record the run's extraction key (fingerprinted from the model's files, no engine needed); returns the
    store's uuid, which the batches' cache keys carry."""
    key = run.key
    db = StoreDB(store)
    extraction_id = db.register_extraction(key)
    get_run_logger().info(
        "extraction %s: model %s (%s, %d layers, hidden %d), %s pooling, %s stored as %s, rules %s, layers %s",
        extraction_id,
        key.model_fingerprint[:12],
        run.model.model_type,
        key.num_layers,
        key.hidden_size,
        key.pooling,
        key.dtype,
        key.stored_dtype,
        key.rules_id,
        ",".join(map(str, run.layers)),
    )
    return db.store_uuid


@task(name="plan", cache_policy=NO_CACHE, result_serializer="json")
def plan(store: str, run: PreparedRun, sources: list[str] | None = None, fill: int = 1) -> list[WorkBatch]:
    """Batches of prompts (of `sources`' rows; all rows if None) lacking some of the run's layers, at least
    `fill` of them when there is enough work (`StoreDB.plan`); each batch's prompt list stays in the store."""
    db = StoreDB(store)
    swept = db.sweep_staging()
    batches = db.plan(run.extraction_id, run.layers, run.rules_id, run.settings.batch_size, sources, fill)
    get_run_logger().info(
        "plan: %d prompts to extract in %d batches%s",
        sum(b.num_prompts for b in batches),
        len(batches),
        f" ({swept} stale unpublished files removed)" if swept else "",
    )
    return batches
