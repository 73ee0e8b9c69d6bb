"""Record every input row in the store (unchanged files are skipped by their fingerprint)."""

from __future__ import annotations

from dataclasses import asdict

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from layertap.store.store_db import StoreDB


@task(name="ingest", cache_policy=NO_CACHE, result_serializer="json")
def ingest(store: str, inputs: list[str], text_column: str) -> dict:
    """Always runs: the store itself decides what is new, so a rerun costs one fingerprint per file."""
    report = asdict(StoreDB(store).ingest(list(inputs), text_column))
    logger = get_run_logger()
    for line in report["malformed"]:
        logger.warning("ingest: %s", line)
    logger.info(
        "ingest: %d rows from %d sources (%d new rows, %d sources unchanged)",
        report["rows_total"],
        report["sources_read"] + report["sources_skipped"],
        report["rows_new"],
        report["sources_skipped"],
    )
    return report
