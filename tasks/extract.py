"""Run one batch through the engine and write its vectors straight to a Parquet part."""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

from prefect import get_run_logger, task
from prefect.tasks import exponential_backoff

from layertap.engine_cache import discard_runner, get_runner
from layertap.settings import Settings
from layertap.store import StoreDB
from layertap.writer import write_part


def part_id_for(extraction_id: str, layers: list[int], prompt_digest: str) -> str:
    """Same batch, same part id: re-extracting an unpublished batch replaces its file, never adds one."""
    payload = json.dumps([extraction_id, sorted(layers), prompt_digest], separators=(",", ":"))
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


def batch_cache_key(context: Any, parameters: dict[str, Any]) -> str:
    """sha256(store_uuid, extraction_id, layers, prompt digest).

    The store's uuid is created with the store, so a deleted and recreated store never hits a stale entry;
    the extraction id already covers model, pooling, dtype and normalisation rules.
    """
    batch = parameters["batch"]
    payload = json.dumps(
        [parameters["store_uuid"], batch["extraction_id"], sorted(batch["layers"]), batch["prompt_hashes_digest"]],
        separators=(",", ":"),
    )
    return hashlib.sha256(payload.encode()).hexdigest()


@task(
    name="extract-batch",
    retries=2,
    retry_delay_seconds=exponential_backoff(backoff_factor=2),
    cache_key_fn=batch_cache_key,
    result_serializer="json",
)
def extract_batch(store: str, store_uuid: str, batch: dict, settings: Settings) -> dict:
    """Extract the batch's missing layers with the process's shared engine; return the part's path only."""
    logger = get_run_logger()
    hashes, texts = StoreDB(store).batch_prompts(batch["batch_id"])
    if len(hashes) != batch["num_prompts"]:
        raise RuntimeError(
            f"batch {batch['batch_id']} lists {len(hashes)} prompts, the plan said {batch['num_prompts']}"
        )
    layers = list(batch["layers"])
    runner = get_runner(settings)
    started = time.perf_counter()
    try:
        result = runner.extract(texts, layers, settings.pooling)
    except Exception:
        # An engine that failed mid-batch may be wedged; the retry gets a fresh one.
        discard_runner(settings)
        raise
    seconds = time.perf_counter() - started
    kept = [hashes[i] for i in result.kept]
    rejected = {hashes[i]: reason for i, reason in sorted(result.rejected.items())}
    part_id = part_id_for(batch["extraction_id"], layers, batch["prompt_hashes_digest"])
    relpath = None
    if kept:
        relpath = str(write_part(store, batch["extraction_id"], part_id, kept, result.vectors, settings.dtype))
    logger.info(
        "extract batch %s: %d prompts x %d layers in %.2fs (%d tokens), %d rejected -> %s",
        batch["batch_id"],
        len(kept),
        len(layers),
        seconds,
        result.num_tokens,
        len(rejected),
        relpath or "no part",
    )
    return {
        "batch_id": batch["batch_id"],
        "extraction_id": batch["extraction_id"],
        "part_id": part_id,
        "relpath": relpath,
        "layers": layers,
        "num_prompts": len(kept),
        "rejected": rejected,
        "num_tokens": result.num_tokens,
        "seconds": round(seconds, 4),
    }
