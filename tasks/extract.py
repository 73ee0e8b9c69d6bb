"""Run one batch through the engine and write its vectors straight to Parquet (one part, one or more files)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from prefect import get_run_logger, task
from prefect.runtime import task_run
from prefect.tasks import exponential_backoff

from layertap.batch import Part, run_batch
from layertap.runner.engine_cache import get_runner
from layertap.errors import ModelUnusable, StoreUnwritable
from layertap.prepared_run import PreparedRun
from layertap.store.plan import WorkBatch
from layertap.store.store_db import StoreDB


def batch_cache_key(context: Any, parameters: dict[str, Any]) -> str:
    """sha256(store_uuid, extraction_id, layers, prompt digest).

    The store's uuid is created with the store, so a deleted and recreated store never hits a stale entry;
    the extraction id already covers model, pooling, dtype and normalisation rules.
    """
    batch = parameters["batch"]
    payload = json.dumps(
        [parameters["store_uuid"], batch.extraction_id, sorted(batch.layers), batch.prompt_hashes_digest],
        separators=(",", ":"),
    )
    return hashlib.sha256(payload.encode()).hexdigest()


def heals_on_retry(task, task_run, state) -> bool:
    """Retry any failure but the store's disk being full or read-only, or the model folder being unusable
    (gone, or without weights or tokenizer), which no retry or new engine can mend."""
    try:
        state.result()
    except (StoreUnwritable, ModelUnusable):
        return False
    except BaseException:  # noqa: BLE001 - any other failure may be the engine's, which a retry can mend
        return True
    return True


@task(
    name="extract-batch",
    retries=2,
    retry_delay_seconds=exponential_backoff(backoff_factor=2),
    retry_condition_fn=heals_on_retry,
    cache_key_fn=batch_cache_key,
    result_serializer="json",
)
def extract_batch(store: str, store_uuid: str, batch: WorkBatch, run: PreparedRun) -> Part:
    """Extract the batch's missing layers with the process's shared engine, or on a Ray engine with the ray
    executor (`layertap.batch.run_batch` either way); return the part's paths only.

    Out-of-memory halves the batch inside this attempt; any other failure is retried by Prefect with
    backoff, on a freshly started engine when the old one no longer answers (on another Ray engine when its
    engine died).
    """
    logger = get_run_logger()
    hashes, texts = StoreDB(store).batch_prompts(batch.batch_id)
    if len(hashes) != batch.num_prompts:
        raise RuntimeError(f"batch {batch.batch_id} lists {len(hashes)} prompts, the plan said {batch.num_prompts}")
    if run.settings.executor == "ray":  # on one of the cluster's engines, its part named by this attempt
        part = get_runner(run.settings).run_batch(store, batch, hashes, texts, run, attempt=task_run.run_count)
    else:
        part = run_batch(store, batch, hashes, texts, run)
    logger.info(
        "extract batch %s: %d prompts x %d layers in %.2fs (%d tokens), %d rejected -> %d files%s",
        batch.batch_id,
        part.num_prompts,
        len(part.layers),
        part.seconds,
        part.num_tokens,
        len(part.rejected),
        len(part.files),
        f" on engine {part.engine}" if part.engine else "",
    )
    return part
