"""Pin down the extraction key and work out which (prompt, layer) results are still missing."""

from __future__ import annotations

from dataclasses import asdict

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from layertap.model.layers import resolve_layers
from layertap.model.fingerprint import read_model_info
from layertap.store.normalise import NormaliseRules
from layertap.store.extraction_key import ExtractionKey
from layertap.store.store_db import StoreDB


@task(name="register-extraction", cache_policy=NO_CACHE, result_serializer="json")
def register_extraction(
    store: str, model_dir: str, pooling: str, dtype: str, remove_period: bool, layers: str | list[int],
    truncate_to: int | None = None, store_dtype: str | None = None,
) -> dict:
    """Fingerprint the model from its files (no engine needed) and record the extraction key."""
    rules = NormaliseRules(remove_period=remove_period)
    key = ExtractionKey.for_model(model_dir, pooling, dtype, rules.rules_id, truncate_to, store_dtype)
    resolved = resolve_layers(layers, key.num_layers)  # a bad index fails before the store is touched
    db = StoreDB(store)
    extraction_id = db.register_extraction(key)
    get_run_logger().info(
        "extraction %s: model %s (%s, %d layers, hidden %d), %s pooling, %s stored as %s, rules %s, layers %s",
        extraction_id,
        key.model_fingerprint[:12],
        read_model_info(model_dir).model_type,
        key.num_layers,
        key.hidden_size,
        pooling,
        dtype,
        key.stored_dtype,
        rules.rules_id,
        ",".join(map(str, resolved)),
    )
    return {
        "extraction_id": extraction_id,
        "store_uuid": db.store_uuid,
        "model_fingerprint": key.model_fingerprint,
        "model_dir": model_dir,
        "rules_id": rules.rules_id,
        "layers": resolved,
        "hidden_size": key.hidden_size,
        "num_layers": key.num_layers,
        "stored_dtype": key.stored_dtype,
    }


@task(name="plan", cache_policy=NO_CACHE, result_serializer="json")
def plan(
    store: str, extraction_id: str, layers: list[int], rules_id: str, batch_size: int,
    sources: list[str] | None = None, fill: int = 1,
) -> list[dict]:
    """Batches of prompts (of `sources`' rows; all rows if None) lacking some requested layer, at least
    `fill` of them when there is enough work (`StoreDB.plan`); each batch's prompt list stays in the store."""
    db = StoreDB(store)
    swept = db.sweep_staging()
    batches = [asdict(b) for b in db.plan(extraction_id, list(layers), rules_id, batch_size, sources, fill)]
    get_run_logger().info(
        "plan: %d prompts to extract in %d batches%s",
        sum(b["num_prompts"] for b in batches),
        len(batches),
        f" ({swept} stale unpublished files removed)" if swept else "",
    )
    return batches
