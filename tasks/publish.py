"""Check a written part's files (or quarantine them), then make checked parts visible in one store transaction."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from layertap import faults
from layertap.batch import Part
from layertap.errors import ValidationError as CheckFailed
from layertap.file_modes import make_dirs
from layertap.parts import checks
from layertap.prepared_run import PreparedRun
from layertap.runner import engine_cache
from layertap.store.publish import Publication
from layertap.store.store_db import StoreDB


def _expected(store: str, part: Part) -> list[str]:
    """The batch's prompts the part must hold, in plan order (from the store for results cached without them)."""
    if part.prompt_hashes is not None:
        return part.prompt_hashes
    hashes, _ = StoreDB(store).batch_prompts(part.batch_id)
    return [h for h in hashes if h not in part.rejected]


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
def validate_batch(store: str, part: Part, run: PreparedRun, parity: bool) -> dict:
    """Every part: its files against the batch, and the values' check made before writing; on the run's
    first part also a parity sample against Hugging Face.

    Checks are deterministic, so there are no retries: a failure quarantines the part's files and stops
    the run with a message naming the check.
    """
    logger = get_run_logger()
    if not part.files:
        return {"batch_id": part.batch_id, "checks": []}
    expected = _expected(store, part)
    paths = [str(Path(store) / file.relpath) for file in part.files]
    done = []
    try:
        listed = [file.prompt_hashes if file.prompt_hashes is not None else expected for file in part.files]
        checks.check_files_cover(listed, expected)
        stored = [checks.check_part(path, hashes, part.layers, run.hidden_size) for path, hashes in zip(paths, listed)]
        if part.problem:
            raise CheckFailed(part.problem)
        done.append("part" if len(part.files) == 1 else f"part in {len(part.files)} files")
        faults.hit("validate-batch.checked")  # a whole part in parts/, checked, not yet in the manifest
        if parity and run.settings.parity_sample > 0:
            report = _parity(store, part, run, paths, stored)
            if report is not None:
                done.append(f"parity on {report.prompts} prompts")
                logger.info(
                    "parity vs Hugging Face, batch %s: min cosine %.6f, max abs error %.2e over %d prompts",
                    part.batch_id,
                    min(report.min_cosine.values()),
                    max(report.max_abs_error.values()),
                    report.prompts,
                )
    except CheckFailed as exc:
        moved = [m for m in (quarantine(store, part.extraction_id, file.relpath) for file in part.files) if m]
        raise CheckFailed(
            f"batch {part.batch_id} not published: {exc}" + (f" (moved to {', '.join(moved)})" if moved else "")
        ) from exc
    logger.info("validate batch %s: %s ok", part.batch_id, " + ".join(done))
    return {"batch_id": part.batch_id, "checks": done}


def _parity(store: str, part: Part, run: PreparedRun, paths: list[str], stored: list[list[str]]):
    """Compare a deterministic sample of the part's rows (across its files) with Hugging Face; None when
    every row was truncated (the reference would see the whole prompt)."""
    settings = run.settings
    truncated = part.truncated or {}
    rows = [(path, i, h) for path, order in zip(paths, stored) for i, h in enumerate(order) if h not in truncated]
    if not rows:
        return None
    picked = [rows[i] for i in checks.parity_sample([h for _, _, h in rows], settings.parity_sample)]
    text_of = dict(zip(*StoreDB(store).batch_prompts(part.batch_id)))
    vectors: dict[int, list] = {layer: [] for layer in part.layers}
    for path in dict.fromkeys(path for path, _, _ in picked):  # file by file, in the sample's order
        got = checks.stored_rows(path, part.layers, [i for p, i, _ in picked if p == path])
        for layer in part.layers:
            vectors[layer].append(got[layer])
    return checks.parity_check(
        settings.model,
        [text_of[h] for _, _, h in picked],
        {layer: np.concatenate(chunks) for layer, chunks in vectors.items()},
        part.layers,
        settings.pooling,
        settings.dtype,
        trust_remote_code=settings.trust_remote_code,
        engine=engine_cache.open_runner(settings),
    )


@task(name="publish-batches", cache_policy=NO_CACHE, result_serializer="json")
def publish_batches(store: str, parts: list[Part]) -> list[dict]:
    """One DuckDB transaction makes the parts' files (already fsynced on disk) visible to readers, with the
    prompts the engine refused or truncated: a flow that fell behind publishes every checked part at once."""
    StoreDB(store).publish([
        Publication(
            part.extraction_id,
            part.layers,
            [(file.part_id, file.relpath, file.prompt_hashes if file.prompt_hashes is not None else _expected(store, part))
             for file in part.files],
            rejected=part.rejected,
            notes=part.truncated or {},
        )
        for part in parts
    ])
    logger = get_run_logger()
    for part in parts:
        logger.info(
            "publish batch %s: %d prompts x %d layers%s",
            part.batch_id,
            part.num_prompts,
            len(part.layers),
            f", {len(part.rejected)} rejected by the engine" if part.rejected else "",
        )
    return [{"batch_id": part.batch_id, "published": part.num_prompts, "rejected": len(part.rejected)}
            for part in parts]
