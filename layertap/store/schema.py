"""The store's database: its tables, the upgrade of older stores, and opening it.

One DuckDB file tracks rows, prompts, plans and published parts beside the Parquet parts. Connections are
short-lived (one per operation) because DuckDB lets only one process hold a database file for writing.
"""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import duckdb

from layertap.errors import StoreError
from layertap.settings import DTYPE_BYTES, stored_dtype_for

SCHEMA_VERSION = "3"
# Version 1 lacked the dataset registry, the run history, input-level rejects, truncation, notes and the
# quarantine; opening it for writing adds them (readers ask for that first).
UPGRADABLE_VERSIONS = ("1", "2")
DB_NAME = "layertap.duckdb"
LOCK_WAIT_S = 30.0

# Columns of random hex hashes are stored uncompressed: compressing them saves half their size but makes
# writing them about six times slower, and the store writes a million of them per million input rows.
HASH_COLUMN = "VARCHAR USING COMPRESSION uncompressed"

# The dataset registry (name -> input files and the extraction they get) and the history of runs.
# Tables version 2 added; `upgrade` creates them in a version-1 store.
_ADDED_IN_2 = """
CREATE TABLE IF NOT EXISTS prompt_notes (
    extraction_id VARCHAR NOT NULL, prompt_hash VARCHAR NOT NULL, note VARCHAR NOT NULL);
CREATE TABLE IF NOT EXISTS quarantined (
    batch_id VARCHAR PRIMARY KEY, extraction_id VARCHAR NOT NULL, error VARCHAR NOT NULL,
    quarantined_at TIMESTAMPTZ NOT NULL);
CREATE TABLE IF NOT EXISTS datasets (
    name VARCHAR PRIMARY KEY, text_column VARCHAR NOT NULL, options VARCHAR NOT NULL,
    created_at TIMESTAMPTZ NOT NULL);
CREATE TABLE IF NOT EXISTS dataset_sources (
    dataset VARCHAR NOT NULL, source VARCHAR NOT NULL, added_at TIMESTAMPTZ NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
    run_id VARCHAR PRIMARY KEY, dataset VARCHAR, flow_run_id VARCHAR, status VARCHAR NOT NULL,
    started_at TIMESTAMPTZ NOT NULL, seconds DOUBLE, summary VARCHAR NOT NULL);
"""

_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS meta (key VARCHAR PRIMARY KEY, value VARCHAR NOT NULL);
CREATE TABLE IF NOT EXISTS sources (
    source VARCHAR PRIMARY KEY, fingerprint VARCHAR NOT NULL, text_column VARCHAR NOT NULL,
    num_rows BIGINT NOT NULL, ingested_at TIMESTAMPTZ NOT NULL);
CREATE TABLE IF NOT EXISTS rows (
    source VARCHAR NOT NULL, row_number BIGINT NOT NULL, raw_text VARCHAR, input_reject VARCHAR);
CREATE TABLE IF NOT EXISTS row_prompts (
    rules_id VARCHAR NOT NULL, source VARCHAR NOT NULL, row_number BIGINT NOT NULL,
    prompt_hash {HASH_COLUMN}, reject_reason VARCHAR);
CREATE TABLE IF NOT EXISTS prompts (prompt_hash {HASH_COLUMN} NOT NULL, text VARCHAR NOT NULL);
CREATE TABLE IF NOT EXISTS extractions (
    extraction_id VARCHAR PRIMARY KEY, model_fingerprint VARCHAR NOT NULL, model_path VARCHAR NOT NULL,
    pooling VARCHAR NOT NULL, dtype VARCHAR NOT NULL, rules_id VARCHAR NOT NULL,
    hidden_size INTEGER NOT NULL, num_layers INTEGER NOT NULL, created_at TIMESTAMPTZ NOT NULL,
    truncate_to INTEGER, stored_dtype VARCHAR NOT NULL);
CREATE TABLE IF NOT EXISTS prompt_rejects (
    extraction_id VARCHAR NOT NULL, prompt_hash VARCHAR NOT NULL, reason VARCHAR NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    batch_id VARCHAR PRIMARY KEY, extraction_id VARCHAR NOT NULL, layers INTEGER[] NOT NULL,
    prompt_hashes_digest VARCHAR NOT NULL, num_prompts BIGINT NOT NULL, created_at TIMESTAMPTZ NOT NULL);
CREATE TABLE IF NOT EXISTS planned (batch_id VARCHAR NOT NULL, ord INTEGER NOT NULL, prompt_hash {HASH_COLUMN} NOT NULL);
CREATE TABLE IF NOT EXISTS parts (
    part_id VARCHAR PRIMARY KEY, extraction_id VARCHAR NOT NULL, path VARCHAR NOT NULL,
    layers INTEGER[] NOT NULL, num_prompts BIGINT NOT NULL, created_at TIMESTAMPTZ NOT NULL);
CREATE TABLE IF NOT EXISTS part_prompts (part_id VARCHAR NOT NULL, prompt_hash {HASH_COLUMN} NOT NULL);
{_ADDED_IN_2}"""
# The big tables (rows, row_prompts, prompts, planned, part_prompts) have no keys on purpose: a key index on
# 700k random hashes doubles the cost of inserting them. The anti-joins that insert them keep them unique.


def quote_literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def first_line(exc: BaseException) -> str:
    return next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)


# Opening a database file that is not open yet in this process creates DuckDB's instance for it; a second
# thread opening the same file meanwhile can get that instance before its Python scan functions are
# registered ("Table Function with name python_arrow_scan does not exist"). Opens are therefore one at a time.
_OPENING = threading.Lock()


def connect(db_path: Path, read_only: bool = False) -> duckdb.DuckDBPyConnection:
    """Wait out a lock held by another process, or a connection of the other mode in this one."""
    deadline = time.monotonic() + LOCK_WAIT_S
    delay = 0.02
    while True:
        try:
            with _OPENING:
                con = duckdb.connect(str(db_path), read_only=read_only)
                con.execute("SET enable_progress_bar = false")  # a library must not draw on the caller's terminal
            return con
        except (duckdb.IOException, duckdb.ConnectionException) as exc:
            busy = "lock" in str(exc).lower() or "different configuration" in str(exc)
            if not busy or time.monotonic() > deadline:
                raise StoreError(f"{db_path}: cannot open the store: {first_line(exc)}") from None
            time.sleep(delay)
            delay = min(delay * 2, 0.5)


def one(con: duckdb.DuckDBPyConnection, sql: str, params: list | dict | None = None) -> tuple | None:
    """First row or None; reads the whole result, since DuckDB refuses new work while one is unfinished."""
    rows = con.execute(sql, params).fetchall()
    return rows[0] if rows else None


def check_version(con: duckdb.DuckDBPyConnection, db_path: Path, readable: tuple[str, ...] = ()) -> str:
    """The store's schema version; anything but this layertap's (or one of `readable`) is refused."""
    found = one(con, "SELECT value FROM meta WHERE key = 'schema_version'")
    if found is not None and found[0] in readable:
        return found[0]
    if found is None or found[0] != SCHEMA_VERSION:
        version = found[0] if found else "unknown"
        raise StoreError(
            f"{db_path}: store has schema version {version}; this layertap needs {SCHEMA_VERSION}"
        )
    return found[0]


def upgrade(con: duckdb.DuckDBPyConnection, db_path: Path) -> None:
    """Bring an older store up to this schema in one transaction; only ever adds tables and columns."""
    if check_version(con, db_path, readable=UPGRADABLE_VERSIONS) == SCHEMA_VERSION:
        return
    con.begin()
    con.execute("ALTER TABLE rows ADD COLUMN IF NOT EXISTS input_reject VARCHAR")
    con.execute("ALTER TABLE extractions ADD COLUMN IF NOT EXISTS truncate_to INTEGER")
    con.execute(_ADDED_IN_2)
    # Version 3: the dtype each extraction's vectors are stored in (until then, the engine dtype's default).
    con.execute("ALTER TABLE extractions ADD COLUMN IF NOT EXISTS stored_dtype VARCHAR")
    for dtype in DTYPE_BYTES:
        con.execute("UPDATE extractions SET stored_dtype = ? WHERE dtype = ? AND stored_dtype IS NULL",
                    [stored_dtype_for(dtype), dtype])
    con.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", [SCHEMA_VERSION])
    con.commit()


def create_or_upgrade(con: duckdb.DuckDBPyConnection, db_path: Path) -> str:
    """Create the tables of a new store or upgrade an older one (refusing a newer one); returns its uuid.

    A store of this schema, the usual case, answers in one statement: each one can wait milliseconds for
    Python's lock when the engine loop computes in this process, and every task opens the store.
    """
    try:
        meta = dict(con.execute(
            "SELECT key, value FROM meta WHERE key IN ('schema_version', 'store_uuid')").fetchall())
    except duckdb.CatalogException:  # a new file: no meta table yet
        meta = {}
    if meta.get("schema_version") == SCHEMA_VERSION and meta.get("store_uuid"):
        return meta["store_uuid"]
    con.execute("CREATE TABLE IF NOT EXISTS meta (key VARCHAR PRIMARY KEY, value VARCHAR NOT NULL)")
    if one(con, "SELECT count(*) FROM meta")[0] == 0:
        con.execute(_SCHEMA)
        con.execute(
            "INSERT INTO meta VALUES ('schema_version', ?), ('store_uuid', ?)",
            [SCHEMA_VERSION, str(uuid.uuid4())],
        )
    upgrade(con, db_path)
    return one(con, "SELECT value FROM meta WHERE key = 'store_uuid'")[0]
