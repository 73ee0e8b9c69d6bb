"""Check a written part, then make it visible in one store transaction (or quarantine it)."""

from __future__ import annotations

import os
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from layertap import faults
from layertap import validate as checks
from layertap.errors import ValidationError as CheckFailed
from layertap.file_modes import make_dirs
from layertap.settings import Settings
from layertap.store import StoreDB


def _expected(store: str, part: dict) -> list[str]:
    """The batch's prompts the part must hold, in plan order (from the store for results cached without them)."""
    if part.get("prompt_hashes") is not None:
        return part["prompt_hashes"]
    hashes, _ = StoreDB(store).batch_prompts(part["batch_id"])
    return [h for h in hashes if h not in part["rejected"]]


def quarantine(store: str, extraction_id: str, relpath: str) -> str | None:
    """Move a failed part out of parts/ so nothing can ever publish it; keep it for inspection."""
    source = Path(store) / relpath
    if not source.exists():
        return None
    target = Path(store) / "quarantine" / extraction_id / source.name
    make_dirs(target.parent)
    os.replace(source, target)
    return str(target.relative_to(store))


@task(name="validate-batch", cache_policy=NO_CACHE, result_serializer="json")
def validate_batch(store: str, part: dict, hidden_size: int, settings: Settings, parity: bool) -> dict:
    """Every part: its file against the batch, and the values' check made before writing; on the run's first
    part also a parity sample against Hugging Face.

    Checks are deterministic, so there are no retries: a failure quarantines the part and stops the run
    with a message naming the check.
    """
    logger = get_run_logger()
    if part["relpath"] is None:
        return {"batch_id": part["batch_id"], "checks": []}
    expected = _expected(store, part)
    path = str(Path(store) / part["relpath"])
    done = []
    try:
        stored = checks.check_part(path, expected, part["layers"], hidden_size)
        if part.get("problem"):
            raise CheckFailed(part["problem"])
        done.append("part")
        faults.hit("validate-batch.checked")  # a whole part in parts/, checked, not yet in the manifest
        truncated = part.get("truncated") or {}  # the reference would see the whole prompt: leave them out
        candidates = [i for i, h in enumerate(stored) if h not in truncated]
        if parity and settings.parity_sample > 0 and candidates:
            text_of = dict(zip(*StoreDB(store).batch_prompts(part["batch_id"])))
            picked = checks.parity_sample([stored[i] for i in candidates], settings.parity_sample)
            rows = [candidates[i] for i in picked]
            report = checks.parity_check(
                settings.model,
                [text_of[stored[i]] for i in rows],
                checks.stored_rows(path, part["layers"], rows),
                part["layers"],
                settings.pooling,
                settings.dtype,
                trust_remote_code=settings.trust_remote_code,
            )
            done.append(f"parity on {report.prompts} prompts")
            logger.info(
                "parity vs Hugging Face, batch %s: min cosine %.6f, max abs error %.2e over %d prompts",
                part["batch_id"],
                min(report.min_cosine.values()),
                max(report.max_abs_error.values()),
                report.prompts,
            )
    except CheckFailed as exc:
        moved = quarantine(store, part["extraction_id"], part["relpath"])
        raise CheckFailed(
            f"batch {part['batch_id']} not published: {exc}" + (f" (part moved to {moved})" if moved else "")
        ) from exc
    logger.info("validate batch %s: %s ok", part["batch_id"], " + ".join(done))
    return {"batch_id": part["batch_id"], "checks": done}


@task(name="publish-batch", cache_policy=NO_CACHE, result_serializer="json")
def publish_batch(store: str, part: dict) -> dict:
    """One DuckDB transaction makes the part (already fsynced on disk) visible to readers."""
    db = StoreDB(store)
    rejected = part["rejected"]
    if rejected:
        db.reject_prompts(part["extraction_id"], rejected)
    if part.get("truncated"):
        db.note_prompts(part["extraction_id"], part["truncated"])
    if part["relpath"] is not None:
        db.publish_part(part["extraction_id"], part["part_id"], part["relpath"], part["layers"],
                        _expected(store, part))
    get_run_logger().info(
        "publish batch %s: %d prompts x %d layers%s",
        part["batch_id"],
        part["num_prompts"],
        len(part["layers"]),
        f", {len(rejected)} rejected by the engine" if rejected else "",
    )
    return {"batch_id": part["batch_id"], "published": part["num_prompts"], "rejected": len(rejected)}
