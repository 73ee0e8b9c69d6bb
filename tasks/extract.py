"""Run one batch through the engine and write its vectors straight to Parquet (one part, one or more files)."""

from __future__ import annotations

import hashlib
import json
import time
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

from prefect import get_run_logger, task
from prefect.tasks import exponential_backoff

from layertap import faults
from layertap import validate as checks
from layertap.engine_cache import discard_if_dead, get_runner
from layertap.disk_space import as_unwritable
from layertap.errors import ModelUnusable, StoreUnwritable, ValidationError
from layertap.settings import Settings
from layertap.split_on_oom import extract_splitting
from layertap.store import StoreDB
from layertap.truncation import truncation_length, truncation_note
from layertap.writer import part_id_for, write_batch_files


# Value checks run beside the Parquet writers, on threads kept for the process: a thread started for each
# batch left glibc heap behind batch after batch (bench/host_side_memory.py: ~4.5 MB per batch, 1.5 without).
_CHECKERS = ThreadPoolExecutor(thread_name_prefix="layertap-check")


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


def part_files(part: dict) -> list[dict]:
    """The files a batch was written as: {"part_id", "relpath", "prompt_hashes"} each.

    Results cached before a batch could span files name one file and no hashes (the batch's, then).
    """
    if "files" in part:
        return part["files"]
    return [{"part_id": part["part_id"], "relpath": part["relpath"], "prompt_hashes": None}] if part["relpath"] else []


def _renewed(settings: Settings):
    """The process's engine after an out-of-memory error: the same one if it still answers, else a new one."""
    discard_if_dead(settings, get_runner(settings))
    return get_runner(settings)


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
def extract_batch(store: str, store_uuid: str, batch: dict, settings: Settings) -> dict:
    """Extract the batch's missing layers with the process's shared engine; return the part's path only.

    Out-of-memory halves the batch inside this attempt; any other failure is retried by Prefect with
    backoff, on a freshly started engine when the old one no longer answers.
    """
    logger = get_run_logger()
    hashes, texts = StoreDB(store).batch_prompts(batch["batch_id"])
    if len(hashes) != batch["num_prompts"]:
        raise RuntimeError(
            f"batch {batch['batch_id']} lists {len(hashes)} prompts, the plan said {batch['num_prompts']}"
        )
    layers = list(batch["layers"])
    truncate_to = truncation_length(settings.model, settings.truncate, settings.max_model_len)
    runner = get_runner(settings)
    runner.reserve_host_buffers(settings.batch_size, len(layers), settings.batches_in_flight, settings.pooling)
    started = time.perf_counter()
    try:
        options = {"truncate_to": truncate_to} if truncate_to else {}
        result = extract_splitting(runner, texts, layers, settings.pooling, renew=lambda: _renewed(settings),
                                   **options)
    except Exception:
        # An engine that failed mid-batch may be dead or wedged: if it fails a probe, the retry gets a fresh one.
        discard_if_dead(settings, runner)
        raise
    seconds = time.perf_counter() - started
    faults.hit("extract.returned")  # vectors in memory, nothing written yet
    kept = [hashes[i] for i in result.kept]
    rejected = {hashes[i]: reason for i, reason in sorted(result.rejected.items())}
    truncated = {hashes[i]: truncation_note(n, truncate_to) for i, n in sorted(result.truncated.items())}
    part_id = part_id_for(batch["extraction_id"], layers, batch["prompt_hashes_digest"])
    files, problem = [], None
    if kept:
        # Values are checked in memory while the files are encoded (both only read the vectors), so the
        # published part never has to be read back whole; a failing part is still written, for
        # validate-batch to quarantine and report.
        checked = _CHECKERS.submit(checks.check_vectors, result.vectors, layers, len(kept), runner.hidden_size,
                                   settings.stored_dtype())
        try:
            files = write_batch_files(store, batch["extraction_id"], part_id, kept, result.vectors,
                                      settings.stored_dtype(), max_file_bytes=int(settings.part_file_mb * 1e6))
        except OSError as exc:
            raise as_unwritable(exc, store) or exc from exc
        finally:
            wait([checked])  # the check is done with the vectors before their buffer is handed back
            result.release()
        try:
            checked.result()
        except ValidationError as exc:
            problem = str(exc)
    logger.info(
        "extract batch %s: %d prompts x %d layers in %.2fs (%d tokens), %d rejected -> %d files",
        batch["batch_id"],
        len(kept),
        len(layers),
        seconds,
        result.num_tokens,
        len(rejected),
        len(files),
    )
    return {
        "batch_id": batch["batch_id"],
        "extraction_id": batch["extraction_id"],
        "part_id": part_id,
        "files": files,
        "layers": layers,
        "num_prompts": len(kept),
        # What the part must hold, in plan order: passed on so that checking and publishing the part need
        # not read the batch from the store again (each store access opens the database file).
        "prompt_hashes": [h for h in hashes if h not in rejected],
        "rejected": rejected,
        "truncated": truncated,
        "problem": problem,
        "num_tokens": result.num_tokens,
    }
