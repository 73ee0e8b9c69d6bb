"""Thin Prefect tasks around the layertap library: retries, cache keys and one log line per stage.

Tasks pass paths, ids, hashes and counts between each other, never arrays: vectors go straight from the
engine to Parquet files on disk, and only the files' paths travel on.
"""

from tasks.extract import batch_cache_key, extract_batch
from tasks.ingest import ingest
from tasks.normalise import normalise
from tasks.plan import plan, register_extraction
from tasks.publish import publish_batches, validate_batch
from tasks.quarantine import quarantine_batch
from tasks.validate import validate_store

__all__ = [
    "batch_cache_key",
    "extract_batch",
    "ingest",
    "normalise",
    "plan",
    "publish_batches",
    "quarantine_batch",
    "register_extraction",
    "validate_batch",
    "validate_store",
]
