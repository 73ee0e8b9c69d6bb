"""The store: one DuckDB file that tracks rows, prompts, plans and published parts, beside the Parquet parts.

Every set-shaped step (ingest, normalise, dedup, plan, ledger) is a single SQL statement over whole tables,
so a million rows cost seconds and Python only moves ids and counts. `StoreDB` is the writer the pipeline
uses; `Store` is the read-only view users open. Connections are short-lived (one per operation) because
DuckDB lets only one process hold a database file for writing.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from layertap import faults
from layertap.careful_reader import CarefulRows
from layertap.errors import InputError, StoreError
from layertap.file_modes import drop_world_write, make_dirs
from layertap.model_fingerprint import fingerprint_model, read_model_info
from layertap.normalise import REJECT_EMPTY, REJECT_NUL, REJECT_NULL, NormaliseRules
from layertap.settings import DTYPE_BYTES, stored_dtype_for
from layertap.sorted_layer import read_layer_sorted
from layertap.writer import layer_column

SCHEMA_VERSION = "3"
# Version 1 lacked the dataset registry, the run history, input-level rejects, truncation, notes and the
# quarantine; opening it for writing adds them (readers ask for that first).
UPGRADABLE_VERSIONS = ("1", "2")
DB_NAME = "layertap.duckdb"
LOCK_WAIT_S = 30.0
# The smallest batch a small run's work is cut into to keep several batches in flight (`StoreDB.plan`).
MIN_FILL_BATCH = 128

# Columns of random hex hashes are stored uncompressed: compressing them saves half their size but makes
# writing them about six times slower, and the store writes a million of them per million input rows.
_HASH = "VARCHAR USING COMPRESSION uncompressed"

# The dataset registry (name -> input files and the extraction they get) and the history of runs.
# Tables version 2 added; `_upgrade` creates them in a version-1 store.
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
    prompt_hash {_HASH}, reject_reason VARCHAR);
CREATE TABLE IF NOT EXISTS prompts (prompt_hash {_HASH} NOT NULL, text VARCHAR NOT NULL);
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
CREATE TABLE IF NOT EXISTS planned (batch_id VARCHAR NOT NULL, ord INTEGER NOT NULL, prompt_hash {_HASH} NOT NULL);
CREATE TABLE IF NOT EXISTS parts (
    part_id VARCHAR PRIMARY KEY, extraction_id VARCHAR NOT NULL, path VARCHAR NOT NULL,
    layers INTEGER[] NOT NULL, num_prompts BIGINT NOT NULL, created_at TIMESTAMPTZ NOT NULL);
CREATE TABLE IF NOT EXISTS part_prompts (part_id VARCHAR NOT NULL, prompt_hash {_HASH} NOT NULL);
{_ADDED_IN_2}"""
# The big tables (rows, row_prompts, prompts, planned, part_prompts) have no keys on purpose: a key index on
# 700k random hashes doubles the cost of inserting them. The anti-joins that insert them keep them unique.

# DuckDB's own default: a CSV line longer than this is rejected (its scan buffers are sized from it).
MAX_CSV_LINE_BYTES = 2_000_000
# Reasons for the CSV lines DuckDB cannot parse, by its error type (others read "malformed CSV: <type>").
MALFORMED_CSV = {
    "INVALID ENCODING": "invalid UTF-8 bytes",
    "TOO MANY COLUMNS": "malformed CSV: too many columns",
    "MISSING COLUMNS": "malformed CSV: missing columns",
    "UNQUOTED VALUE": "malformed CSV: a quote not closed where the cell ends",
    "LINE SIZE OVER MAXIMUM": f"malformed CSV: line over {MAX_CSV_LINE_BYTES:,} bytes",
}

_READERS = {
    ".csv": "csv", ".tsv": "csv", ".parquet": "parquet", ".jsonl": "json", ".ndjson": "json", ".json": "json"
}

# Prompts that still lack a requested layer: `todo(prompt_hash, missing)`, where `missing` is the lacking
# layers as text ("3,7") or NULL for all of them, the common case, kept NULL so sorting by it stays cheap.
# Parts holding every requested layer settle their prompts with one anti-join; only prompts in narrower
# parts get per-layer bookkeeping. Parameters: $rules, $eid, $layers (sorted, distinct), $sources (the
# input files in scope, or NULL for every file in the store).
_TODO_CTES = """
want AS (
    SELECT DISTINCT prompt_hash FROM row_prompts
    WHERE rules_id = $rules AND prompt_hash IS NOT NULL AND ($sources IS NULL OR list_contains($sources, source))),
refused AS (SELECT prompt_hash, reason FROM prompt_rejects WHERE extraction_id = $eid),
hits AS (
    SELECT part_id, list_has_all(layers, $layers) AS whole, list_intersect(layers, $layers) AS got
    FROM parts WHERE extraction_id = $eid AND list_has_any(layers, $layers)),
done AS (SELECT DISTINCT prompt_hash FROM part_prompts JOIN hits USING (part_id) WHERE whole),
partly AS (
    SELECT prompt_hash, flatten(list(got)) AS got
    FROM part_prompts JOIN hits USING (part_id) WHERE NOT whole GROUP BY prompt_hash),
todo AS (
    SELECT * FROM (
        SELECT w.prompt_hash,
               CASE WHEN p.got IS NOT NULL
                    THEN array_to_string(list_filter($layers, lambda l: NOT list_contains(p.got, l)), ',') END
               AS missing
        FROM want w ANTI JOIN done d ON w.prompt_hash = d.prompt_hash
             ANTI JOIN refused r ON w.prompt_hash = r.prompt_hash
             LEFT JOIN partly p ON w.prompt_hash = p.prompt_hash)
    WHERE missing IS NULL OR missing <> '')
"""

# One row per input row. The first row of a prompt (smallest (source, row_number)) carries its fate; later
# rows with the same prompt are duplicates. Rows of a prompt the engine refused are all rejected. A prompt
# still missing results whose batch was quarantined is `quarantined` (with the batch's error) until a rerun
# embeds it; an embedded prompt may carry a note (e.g. it was truncated to fit the model).
_LEDGER_SQL = f"""
WITH {_TODO_CTES},
held AS (
    SELECT pl.prompt_hash, any_value(q.error) AS error
    FROM quarantined q JOIN planned pl USING (batch_id) WHERE q.extraction_id = $eid GROUP BY pl.prompt_hash),
notes AS (SELECT prompt_hash, any_value(note) AS note FROM prompt_notes WHERE extraction_id = $eid GROUP BY ALL),
joined AS (
    SELECT r.source, r.row_number, rp.prompt_hash, rp.reject_reason, rp.source IS NULL AS unseen,
           row_number() OVER (PARTITION BY rp.prompt_hash ORDER BY r.source, r.row_number) AS k
    FROM rows r LEFT JOIN row_prompts rp
         ON rp.rules_id = $rules AND rp.source = r.source AND rp.row_number = r.row_number
    WHERE $sources IS NULL OR list_contains($sources, r.source))
SELECT j.source, j.row_number,
       CASE WHEN j.reject_reason IS NOT NULL OR x.reason IS NOT NULL THEN 'rejected'
            WHEN j.unseen THEN 'pending'
            WHEN j.k > 1 THEN 'duplicate'
            WHEN t.prompt_hash IS NOT NULL AND h.prompt_hash IS NOT NULL THEN 'quarantined'
            WHEN t.prompt_hash IS NOT NULL THEN 'pending'
            ELSE 'embedded' END AS status,
       CASE WHEN j.reject_reason IS NOT NULL OR x.reason IS NOT NULL THEN coalesce(j.reject_reason, x.reason)
            WHEN j.unseen OR j.k > 1 THEN NULL
            WHEN t.prompt_hash IS NOT NULL THEN h.error
            ELSE n.note END AS reason,
       j.prompt_hash
FROM joined j LEFT JOIN refused x ON j.prompt_hash = x.prompt_hash
     LEFT JOIN todo t ON j.prompt_hash = t.prompt_hash
     LEFT JOIN held h ON j.prompt_hash = h.prompt_hash
     LEFT JOIN notes n ON j.prompt_hash = n.prompt_hash
"""


@dataclass(frozen=True)
class IngestReport:
    sources_read: int
    sources_skipped: int
    rows_total: int
    rows_new: int
    sources: list[str]
    # One line per CSV file with lines DuckDB could not parse: how many (each a rejected row), the first's line.
    malformed: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class NormaliseReport:
    """`rows` = `new_prompts` + `duplicates` + sum(`rejected`) for the rows normalised by this call."""

    rows: int
    new_prompts: int
    duplicates: int
    rejected: dict[str, int]


@dataclass(frozen=True)
class ExtractionKey:
    """What makes results comparable; `extraction_id` hashes the fields that change the vectors (model,
    pooling, dtype, normalisation rules and, when prompts are truncated, the length they are cut to)."""

    model_fingerprint: str
    model_path: str
    pooling: str
    dtype: str
    rules_id: str
    hidden_size: int
    num_layers: int
    truncate_to: int | None = None
    # The dtype the vectors are stored in; None: the engine dtype's default (`stored_dtype_for`).
    store_dtype: str | None = None

    @property
    def stored_dtype(self) -> str:
        return stored_dtype_for(self.dtype, self.store_dtype)

    @property
    def extraction_id(self) -> str:
        fields = {"model_fingerprint": self.model_fingerprint, "pooling": self.pooling, "dtype": self.dtype,
                  "rules_id": self.rules_id}
        if self.truncate_to is not None:  # only then: ids of extractions without truncation stay as they were
            fields["truncate_to"] = self.truncate_to
        if self.stored_dtype != stored_dtype_for(self.dtype):  # likewise for the default stored dtype
            fields["stored_dtype"] = self.stored_dtype
        canon = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()[:16]

    @classmethod
    def for_model(
        cls, model_dir: str, pooling: str, dtype: str, rules_id: str, truncate_to: int | None = None,
        store_dtype: str | None = None,
    ) -> ExtractionKey:
        """The key of a model folder, read from its files (no engine needed)."""
        info = read_model_info(model_dir)
        return cls(model_fingerprint=fingerprint_model(model_dir), model_path=model_dir, pooling=pooling,
                   dtype=dtype, rules_id=rules_id, hidden_size=info.hidden_size, num_layers=info.num_layers,
                   truncate_to=truncate_to, store_dtype=store_dtype)


@dataclass(frozen=True)
class Publication:
    """One batch's results to make visible: its written files, (part id, path, prompt hashes) each, and the
    prompts the engine refused (with the reason) or noted (e.g. truncated)."""

    extraction_id: str
    layers: list[int]
    files: list[tuple[str, str, list[str]]]
    rejected: dict[str, str] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)

    def hashes(self) -> list[str]:
        return [h for _, _, hashes in self.files for h in hashes]


@dataclass(frozen=True)
class WorkBatch:
    """A unit of extraction; the prompts live in the `planned` table so tasks pass only the id.

    `prompt_hashes_digest` is the sha256 hex of the batch's prompt hashes joined by "," in order.
    """

    batch_id: str
    extraction_id: str
    layers: list[int]
    prompt_hashes_digest: str
    num_prompts: int


def _quote_literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _first_line(exc: BaseException) -> str:
    return next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)


# Opening a database file that is not open yet in this process creates DuckDB's instance for it; a second
# thread opening the same file meanwhile can get that instance before its Python scan functions are
# registered ("Table Function with name python_arrow_scan does not exist"). Opens are therefore one at a time.
_OPENING = threading.Lock()


def _connect(db_path: Path, read_only: bool = False) -> duckdb.DuckDBPyConnection:
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
                raise StoreError(f"{db_path}: cannot open the store: {_first_line(exc)}") from None
            time.sleep(delay)
            delay = min(delay * 2, 0.5)


def _one(con: duckdb.DuckDBPyConnection, sql: str, params: list | dict | None = None) -> tuple | None:
    """First row or None; reads the whole result, since DuckDB refuses new work while one is unfinished."""
    rows = con.execute(sql, params).fetchall()
    return rows[0] if rows else None


def _check_version(con: duckdb.DuckDBPyConnection, db_path: Path, readable: tuple[str, ...] = ()) -> str:
    """The store's schema version; anything but this layertap's (or one of `readable`) is refused."""
    found = _one(con, "SELECT value FROM meta WHERE key = 'schema_version'")
    if found is not None and found[0] in readable:
        return found[0]
    if found is None or found[0] != SCHEMA_VERSION:
        version = found[0] if found else "unknown"
        raise StoreError(
            f"{db_path}: store has schema version {version}; this layertap needs {SCHEMA_VERSION}"
        )
    return found[0]


def _upgrade(con: duckdb.DuckDBPyConnection, db_path: Path) -> None:
    """Bring an older store up to this schema in one transaction; only ever adds tables and columns."""
    if _check_version(con, db_path, readable=UPGRADABLE_VERSIONS) == SCHEMA_VERSION:
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


def _sorted_layers(layers: list[int]) -> list[int]:
    out = sorted({int(layer) for layer in layers})
    if not out:
        raise ValueError("at least one layer is needed")
    return out


def _todo_params(rules_id: str, extraction_id: str, layers: list[int], sources: list[str] | None) -> dict:
    """The parameters of `_TODO_CTES` (and `_LEDGER_SQL`, which builds on it)."""
    return {"rules": rules_id, "eid": extraction_id, "layers": _sorted_layers(layers), "sources": _scope(sources)}


def _scope(sources: list[str] | None) -> list[str] | None:
    """Input files a plan or ledger is limited to, as the store records them; None means all of them."""
    if sources is None:
        return None
    return [os.path.realpath(os.path.expanduser(str(s))) for s in sources]


def expand_inputs(paths: list[str]) -> list[str]:
    """Absolute paths of the input files, globs expanded (sorted, files only), duplicates dropped."""
    files: list[str] = []
    for given in paths:
        pattern = os.path.expanduser(str(given))
        if any(c in pattern for c in "*?["):
            matches = sorted(m for m in glob.glob(pattern, recursive=True) if os.path.isfile(m))
            if not matches:
                raise InputError(f"{given}: no file matches this pattern")
        elif os.path.isfile(pattern):
            matches = [pattern]
        else:
            raise InputError(f"{given}: no such file")
        for match in matches:
            if Path(match).suffix.lower() not in _READERS:
                raise InputError(f"{match}: unsupported file type (use {', '.join(_READERS)})")
            files.append(os.path.realpath(match))
    return list(dict.fromkeys(files))


def _file_sha256(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror or exc}") from None


def check_inputs(paths: list[str], text_column: str) -> list[str]:
    """Everything ingest would check, without a store: files exist, are readable, have the column.

    Returns the files. Runs on an in-memory database, so a bad input fails before the store is touched.
    """
    files = expand_inputs(paths)
    with duckdb.connect() as con:
        for path in files:
            _file_sha256(path)
            try:
                _row_source_sql(con, path, text_column)
            except _ScanRefused as refused:
                reader = _next_reader(con, path, text_column, refused)
                if isinstance(reader, CarefulRows) and reader.kind == "json":  # any record with the column?
                    for _ in reader.batches():
                        pass
    return files


# JSON values that are not text, by DuckDB's json_type, with the reason their rows are rejected.
_JSON_NOT_TEXT = {
    "BIGINT": "number", "UBIGINT": "number", "DOUBLE": "number", "BOOLEAN": "boolean", "ARRAY": "array",
    "OBJECT": "object",
}
_TEXT_TYPES = ("VARCHAR", "BLOB")


@dataclass(frozen=True)
class _Scan:
    """SQL yielding (row_number, text, reject) for one file; for a CSV, the temporary table where DuckDB
    records the lines it could not parse (`_record_malformed` turns them into rejected rows)."""

    sql: str
    params: dict
    rejects: str | None = None


def _row_source_sql(con: duckdb.DuckDBPyConnection, path: str, text_column: str) -> _Scan:
    """SQL yielding (row_number, text, reject) for one file, after checking it is readable and has the column.

    Row numbers follow file order: WITH ORDINALITY runs as an order-preserving streaming window over the
    scan. CSV has no NULL, so an empty cell is '' (rejected as empty); a JSON or Parquet null stays NULL
    (rejected as null text). JSON numbers, booleans, arrays and objects, and Parquet columns that do not
    hold text, are rejected as `not text: <type>` rather than embedded as their printed form. A CSV this
    sniffing scan refuses is read again by `_csv_rejects_scan`.
    """
    if os.path.getsize(path) == 0:
        raise InputError(f"{path}: the file is empty (not even a header or one record)")
    kind = _READERS[Path(path).suffix.lower()]
    params: dict = {"path": path}
    if kind == "csv":
        options = "header = true, all_varchar = true"
        if path.lower().endswith(".tsv"):
            options += ", delim = $delim"
            params["delim"] = "\t"
        scan = f"read_csv($path, {options})"
    elif kind == "parquet":
        scan = "read_parquet($path, binary_as_string = true, file_row_number = true)"
    else:
        scan = "read_json($path)"
    try:
        described = con.execute(f"DESCRIBE SELECT * FROM {scan}", params).fetchall()
    except duckdb.Error as exc:
        raise _ScanRefused(kind, exc) from None
    columns = {row[0]: row[1] for row in described}
    if text_column not in columns:
        if kind == "csv":  # the sniffer may have guessed the dialect wrong: the RFC 4180 reading decides
            raise _ScanRefused(kind, f"no column {text_column!r} (columns: {', '.join(columns)})")
        raise InputError(f"{path}: no column {text_column!r} (columns: {', '.join(columns)})")
    col = _quote_ident(text_column)
    if kind == "csv":
        sql = (f"SELECT ordinality - 1 AS row_number, coalesce({col}, '') AS text, NULL AS reject "
               f"FROM {scan} WITH ORDINALITY")
    elif kind == "parquet":
        text_type = columns[text_column]
        if text_type in _TEXT_TYPES:
            sql = f"SELECT file_row_number AS row_number, CAST({col} AS VARCHAR) AS text, NULL AS reject FROM {scan}"
        else:
            params["not_text"] = f"not text: {text_type}"
            sql = f"SELECT file_row_number AS row_number, NULL AS text, $not_text AS reject FROM {scan}"
    else:
        params["columns"] = {text_column: "JSON"}
        kinds = " ".join(f"WHEN '{k}' THEN 'not text: {v}'" for k, v in _JSON_NOT_TEXT.items())  # constants
        sql = (
            f"SELECT ordinality - 1 AS row_number, "
            f"CASE WHEN json_type({col}) = 'VARCHAR' THEN json_extract_string({col}, '$') END AS text, "
            f"CASE WHEN json_type({col}) NOT IN ('VARCHAR', 'NULL') "
            f"     THEN CASE json_type({col}) {kinds} ELSE 'not text: ' || lower(json_type({col})) END END AS reject "
            "FROM read_json($path, columns = $columns) WITH ORDINALITY"
        )
    return _Scan(sql, params)


def _csv_rejects_scan(con: duckdb.DuckDBPyConnection, path: str, text_column: str) -> _Scan:
    """The scan for a CSV file the sniffing scan refused: RFC 4180 quoting (as the careful reader reads it),
    columns named from the header, and DuckDB's rejects table for the lines it cannot parse (bytes that are
    not UTF-8, a column too many or too few, a quote never closed, a line over MAX_CSV_LINE_BYTES), so one
    bad line near the end of a large file costs that line, not the file. It streams like any DuckDB scan."""
    header = _careful_rows(path, text_column)  # reads the header only; names a missing column
    rejects = f"layertap_csv_rejects_{uuid.uuid4().hex[:16]}"
    params = {"path": path, "delim": header.delimiter,
              "columns": {f"c{i}": "VARCHAR" for i in range(header.columns)}}
    scan = ("read_csv($path, auto_detect = false, header = true, delim = $delim, quote = '\"', escape = '\"', "
            f"columns = $columns, max_line_size = {MAX_CSV_LINE_BYTES}, store_rejects = true, "
            f"rejects_table = '{rejects}', rejects_scan = '{rejects}_scans')")
    try:
        con.execute(f"DESCRIBE SELECT * FROM {scan}", params).fetchall()
    except duckdb.Error as exc:
        raise _ScanRefused("csv", exc) from None
    finally:
        _drop_rejects(con, rejects)
    sql = (f"SELECT ordinality - 1 AS row_number, coalesce(c{header.index}, '') AS text, NULL AS reject "
           f"FROM {scan} WITH ORDINALITY")
    return _Scan(sql, params, rejects)


def _next_reader(con: duckdb.DuckDBPyConnection, path: str, text_column: str, refused: _ScanRefused, source=None):
    """What reads a file after `source` (the sniffing scan when None) was refused: for a CSV, the scan with a
    rejects table, then the careful reader; for JSON lines, the careful reader."""
    if not refused.recoverable:
        raise refused.as_input_error(path) from None
    if refused.kind == "csv" and (source is None or isinstance(source, _Scan) and source.rejects is None):
        try:
            return _csv_rejects_scan(con, path, text_column)
        except _ScanRefused as again:
            if not again.recoverable:
                raise again.as_input_error(path) from None
    return _careful_rows(path, text_column)


def _drop_rejects(con: duckdb.DuckDBPyConnection, rejects: str) -> None:
    for table in (rejects, f"{rejects}_scans", f"{rejects}_rows"):
        con.execute(f"DROP TABLE IF EXISTS temp.{_quote_ident(table)}")


def _record_malformed(con: duckdb.DuckDBPyConnection, path: str, rejects: str) -> tuple[int, str | None]:
    """The CSV lines DuckDB could not parse in this scan, as rejected rows of the file; returns how many, and
    one line naming the file, the first such line and what is wrong with it.

    DuckDB's `line` counts records from the header (1): a record's row number is `line - 2`. The rows read
    were numbered 0, 1, ... without them, so each moves up by the rejected lines before it: row g becomes
    g + k, where k counts the rejected records r_j with r_j - (j - 1) <= g (j = 1, 2, ... in line order).
    """
    exists = _one(con, "SELECT count(*) FROM duckdb_tables() WHERE table_name = $t", {"t": rejects})[0]
    if not exists or not _one(con, f"SELECT count(*) FROM temp.{_quote_ident(rejects)}")[0]:
        return 0, None
    bad = _quote_ident(f"{rejects}_rows")
    reasons = " ".join(f"WHEN {_quote_literal(kind)} THEN {_quote_literal(reason)}"
                       for kind, reason in MALFORMED_CSV.items())
    con.execute(f"""
        CREATE TEMP TABLE {bad} AS
        SELECT line - 2 AS r, line, kind, message,
               CASE kind {reasons} ELSE 'malformed CSV: ' || lower(kind) END AS reason,
               line - 2 - (row_number() OVER (ORDER BY line) - 1) AS s,
               row_number() OVER (ORDER BY line) AS k
        FROM (SELECT line, min_by(CAST(error_type AS VARCHAR), byte_position) AS kind,
                     min_by(error_message, byte_position) AS message
              FROM temp.{_quote_ident(rejects)} WHERE line >= 2 GROUP BY line)""")
    con.execute(f"""
        UPDATE rows SET row_number = rows.row_number + moved.k
        FROM (SELECT g.row_number AS g, b.k FROM (SELECT row_number FROM rows WHERE source = $path) g
              ASOF JOIN (SELECT s, max(k) AS k FROM {bad} GROUP BY s) b ON g.row_number >= b.s) moved
        WHERE rows.source = $path AND rows.row_number = moved.g""", {"path": path})
    con.execute(f"INSERT INTO rows SELECT $path, r, NULL, reason FROM {bad}", {"path": path})
    count, line, reason, message = _one(
        con, f"SELECT count(*), min(line), arg_min(reason, line), arg_min(message, line) FROM {bad}")
    lines = "line" if count == 1 else "lines"
    return count, (f"{path}: {count} malformed CSV {lines} rejected, the first at line {line}: {reason} "
                   f"({' '.join(str(message).split())})")


class _ScanRefused(Exception):
    """DuckDB could not scan a whole file; some of these the careful reader can still read row by row."""

    def __init__(self, kind: str, exc: duckdb.Error | str):
        super().__init__(_first_line(exc))
        self.kind = kind
        message = str(exc)
        csv_refused = "CSV Error" in message or "sniffing" in message or "no column" in message
        self.recoverable = kind == "csv" and csv_refused or kind == "json" and "Malformed JSON" in message

    def as_input_error(self, path: str) -> InputError:
        return InputError(f"{path}: cannot read as {self.kind}: {self}")


def _careful_rows(path: str, text_column: str) -> CarefulRows:
    """The row-by-row reader for a file DuckDB refused whole; it streams."""
    kind = _READERS[Path(path).suffix.lower()]
    return CarefulRows(path, text_column, kind, "\t" if path.lower().endswith(".tsv") else ",")


def part_path(root: Path, relpath: str) -> Path:
    """Where a part named in the manifest lies: always under the store's `parts/`, whatever the manifest
    says (an edited or corrupted manifest never makes layertap read or write elsewhere)."""
    path = (root / relpath).resolve()
    if not path.is_relative_to((root / "parts").resolve()):
        raise StoreError(f"{root}: the manifest names {relpath!r}, which is not inside the store's parts/")
    return path


def _check_files(root: Path, files: list[tuple[str, str, list[str]]]) -> None:
    """A batch's files each exist in the store and list prompts, no prompt twice across them."""
    for part_id, relpath, hashes in files:
        if not hashes:
            raise StoreError(f"part {part_id}: prompt hashes must be non-empty and distinct")
        if not part_path(root, relpath).is_file():
            raise StoreError(f"part {part_id}: {relpath} is not a file in the store")
    every_hash = [h for _, _, hashes in files for h in hashes]
    if len(set(every_hash)) != len(every_hash):
        part_ids = [part_id for part_id, _, _ in files]
        what = f"part {part_ids[0]}" if len(files) == 1 else f"parts {', '.join(part_ids)}"
        raise StoreError(f"{what}: prompt hashes must be non-empty and distinct")


def _check_disjoint(publications: list[Publication]) -> None:
    """Batches published together never give one prompt the same layer twice (the store is checked in SQL)."""
    for i, first in enumerate(publications):
        for second in publications[i + 1:]:
            if first.extraction_id != second.extraction_id or not set(first.layers) & set(second.layers):
                continue
            if set(first.hashes()) & set(second.hashes()):
                raise StoreError(f"parts {first.files[0][0]} and {second.files[0][0]} share prompts and layers")


def _insert_once(con: duckdb.DuckDBPyConnection, table: str, texts: list[tuple[str, dict[str, str]]]) -> int:
    """Insert (extraction, prompt_hash, text) rows into `table`, keeping a prompt's first text only."""
    rows: dict[tuple[str, str], str] = {}
    for extraction_id, by_hash in texts:
        for prompt_hash, text in by_hash.items():
            rows.setdefault((extraction_id, prompt_hash), text)
    if not rows:
        return 0
    con.register("incoming", pa.table({
        "extraction_id": pa.array([eid for eid, _ in rows], pa.string()),
        "prompt_hash": pa.array([h for _, h in rows], pa.string()),
        "text": pa.array(list(rows.values()), pa.string()),
    }))
    try:
        return _one(
            con,
            f"""INSERT INTO {table}
            SELECT i.extraction_id, i.prompt_hash, i.text FROM incoming i
            WHERE NOT EXISTS (SELECT 1 FROM {table} x
                              WHERE x.extraction_id = i.extraction_id AND x.prompt_hash = i.prompt_hash)""",
        )[0]
    finally:
        con.unregister("incoming")


class StoreDB:
    """Writer side of the store, used by the pipeline's tasks."""

    _publish_lock = threading.Lock()

    def __init__(self, store_dir: str | os.PathLike) -> None:
        self.root = Path(store_dir).expanduser().resolve()
        self.db_path = self.root / DB_NAME
        for sub in ("parts", "staging"):
            make_dirs(self.root / sub)
        self._store_uuid: str | None = None

    def prepare(self) -> StoreDB:
        """Create, upgrade or refuse the store now rather than on its first use."""
        if self._store_uuid is None:
            self._connect().close()
        return self

    @property
    def store_uuid(self) -> str:
        """The id the store got when it was created (a recreated store gets another)."""
        return self.prepare()._store_uuid

    def _connect(self) -> duckdb.DuckDBPyConnection:
        """A connection to the store; the first one also creates, upgrades or refuses it. Done then rather
        than on construction: opening the database file costs tens of milliseconds, and a task's StoreDB
        usually serves one operation."""
        con = _connect(self.db_path)
        if self._store_uuid is None:
            try:
                self._prepare(con)
            except BaseException:
                con.close()
                raise
        return con

    def _prepare(self, con: duckdb.DuckDBPyConnection) -> None:
        # A store of this schema, the usual case, answers in one statement: each one can wait milliseconds
        # for Python's lock when the engine loop computes in this process, and every task opens the store.
        try:
            meta = dict(con.execute(
                "SELECT key, value FROM meta WHERE key IN ('schema_version', 'store_uuid')").fetchall())
        except duckdb.CatalogException:  # a new file: no meta table yet
            meta = {}
        if meta.get("schema_version") == SCHEMA_VERSION and meta.get("store_uuid"):
            self._store_uuid = meta["store_uuid"]
            drop_world_write(self.db_path)
            return
        con.execute("CREATE TABLE IF NOT EXISTS meta (key VARCHAR PRIMARY KEY, value VARCHAR NOT NULL)")
        if _one(con, "SELECT count(*) FROM meta")[0] == 0:
            con.execute(_SCHEMA)
            con.execute(
                "INSERT INTO meta VALUES ('schema_version', ?), ('store_uuid', ?)",
                [SCHEMA_VERSION, str(uuid.uuid4())],
            )
        _upgrade(con, self.db_path)
        self._store_uuid = _one(con, "SELECT value FROM meta WHERE key = 'store_uuid'")[0]
        drop_world_write(self.db_path)

    def ingest(self, paths: list[str], text_column: str) -> IngestReport:
        """Record every row of the given files; unchanged files are skipped, changed ones replace their rows.

        All files are checked (readable, has the column) before any is written, so a typo fails fast.
        """
        files = expand_inputs(paths)
        read = skipped = total = new = 0
        malformed: list[str] = []
        with self._connect() as con:
            changed = []
            for path in files:
                fingerprint = _file_sha256(path)
                known = _one(
                    con, "SELECT fingerprint, text_column, num_rows FROM sources WHERE source = ?", [path]
                )
                if known is not None and known[:2] == (fingerprint, text_column):
                    skipped += 1
                    total += known[2]
                    continue
                try:
                    changed.append((path, fingerprint, _row_source_sql(con, path, text_column)))
                except _ScanRefused as refused:
                    changed.append((path, fingerprint, _next_reader(con, path, text_column, refused)))
            for path, fingerprint, source in changed:
                n, note = self._replace_rows(con, path, fingerprint, text_column, source)
                if note:
                    malformed.append(note)
                faults.hit("ingest.committed")
                read += 1
                total += n
                new += n
        return IngestReport(
            sources_read=read, sources_skipped=skipped, rows_total=total, rows_new=new, sources=files,
            malformed=malformed,
        )

    def changed_sources(self, paths: list[str], text_column: str) -> list[str]:
        """The input files `ingest` would read: new to the store, changed since, or read for another column."""
        files = expand_inputs(paths)
        with self._connect() as con:
            known = {source: (fingerprint, column) for source, fingerprint, column in con.execute(
                "SELECT source, fingerprint, text_column FROM sources WHERE list_contains($files, source)",
                {"files": files}).fetchall()}
        return [path for path in files if known.get(path) != (_file_sha256(path), text_column)]

    def rows_to_normalise(self, rules: NormaliseRules, sources: list[str]) -> int:
        """Rows of `sources` that `normalise` has not yet given a prompt (or a reason) under these rules."""
        with self._connect() as con:
            return _one(con, """SELECT count(*) FROM rows r ANTI JOIN (SELECT source, row_number FROM row_prompts
                                                             WHERE rules_id = $rules) d
                                ON r.source = d.source AND r.row_number = d.row_number
                                WHERE list_contains($sources, r.source)""",
                        {"rules": rules.rules_id, "sources": sources})[0]

    @staticmethod
    def _replace_rows(
        con: duckdb.DuckDBPyConnection, path: str, fingerprint: str, text_column: str, source
    ) -> tuple[int, str | None]:
        """Swap one file's rows in one transaction; returns how many, and a line about the CSV lines DuckDB
        could not parse (each kept as a rejected row) if there were any. A scan DuckDB refuses as a whole
        falls back to the next reader (`_next_reader`), the last being the careful reader, which keeps every
        row and marks the bad ones."""
        while True:
            con.begin()
            note = None
            try:
                con.execute("DELETE FROM rows WHERE source = $path", {"path": path})
                con.execute("DELETE FROM row_prompts WHERE source = $path", {"path": path})
                if isinstance(source, CarefulRows):
                    con.register("careful_rows", source.reader())
                    try:
                        n = _one(con, "INSERT INTO rows SELECT $path, row_number, text, reject FROM careful_rows",
                                 {"path": path})[0]
                    finally:
                        con.unregister("careful_rows")
                else:
                    n = _one(con, f"INSERT INTO rows SELECT $path, row_number, text, reject FROM ({source.sql})",
                             source.params)[0]
                    if source.rejects:
                        malformed, note = _record_malformed(con, path, source.rejects)
                        n += malformed
                        _drop_rejects(con, source.rejects)
                faults.hit("ingest.before-commit")
                con.execute(
                    "INSERT OR REPLACE INTO sources VALUES (?, ?, ?, ?, now())", [path, fingerprint, text_column, n]
                )
                con.commit()
                return n, note
            except duckdb.Error as exc:
                con.rollback()
                if isinstance(source, CarefulRows):
                    if source.error is not None:  # the reader's own one-line reason, not DuckDB's wrapping of it
                        raise source.error from None
                    raise _ScanRefused(source.kind, exc).as_input_error(path) from None
                if source.rejects:
                    _drop_rejects(con, source.rejects)
                source = _next_reader(con, path, text_column, _ScanRefused(_READERS[Path(path).suffix.lower()], exc),
                                      source)

    def normalise(self, rules: NormaliseRules) -> NormaliseReport:
        """Give every row not yet seen under these rules its prompt (or reject reason); add new prompts.

        New prompts are inserted sorted by hash: a batch is a run of consecutive hashes, so its prompts sit
        in one or two row groups and `batch_prompts` reads those instead of the whole table.
        """
        with self._connect() as con:
            con.begin()
            con.execute(
                f"""CREATE TEMP TABLE fresh AS
                SELECT source, row_number, text, CASE WHEN reject IS NULL THEN sha256(text) END AS prompt_hash,
                       reject
                FROM (SELECT source, row_number, text,
                             CASE WHEN input_reject IS NOT NULL THEN input_reject
                                  WHEN text IS NULL THEN $null
                                  WHEN strpos(text, chr(0)) > 0 THEN $nul
                                  WHEN text = '' THEN $empty END AS reject
                      FROM (SELECT r.source, r.row_number, r.input_reject, {rules.sql("r.raw_text")} AS text
                            FROM rows r ANTI JOIN (SELECT source, row_number FROM row_prompts
                                                   WHERE rules_id = $rules) d
                            ON r.source = d.source AND r.row_number = d.row_number))""",
                {"rules": rules.rules_id, "null": REJECT_NULL, "nul": REJECT_NUL, "empty": REJECT_EMPTY},
            )
            con.execute(
                "INSERT INTO row_prompts SELECT $rules, source, row_number, prompt_hash, reject FROM fresh",
                {"rules": rules.rules_id},
            )
            new_prompts = _one(
                con,
                """INSERT INTO prompts
                SELECT prompt_hash, any_value(text) FROM fresh f
                WHERE prompt_hash IS NOT NULL
                  AND NOT EXISTS (SELECT 1 FROM prompts p WHERE p.prompt_hash = f.prompt_hash)
                GROUP BY prompt_hash ORDER BY prompt_hash""",
            )[0]
            rows = _one(con, "SELECT count(*) FROM fresh")[0]
            rejected = dict(
                con.execute("SELECT reject, count(*) FROM fresh WHERE reject IS NOT NULL GROUP BY reject").fetchall()
            )
            faults.hit("normalise.before-commit")
            con.commit()
        faults.hit("normalise.committed")
        return NormaliseReport(
            rows=rows, new_prompts=new_prompts, duplicates=rows - sum(rejected.values()) - new_prompts,
            rejected=rejected,
        )

    def register_extraction(self, key: ExtractionKey) -> str:
        """Idempotent; refuses a key whose model shape disagrees with what was recorded for it."""
        eid = key.extraction_id
        with self._connect() as con:
            known = _one(con, "SELECT hidden_size, num_layers FROM extractions WHERE extraction_id = ?", [eid])
            if known is None:
                con.execute(
                    "INSERT INTO extractions VALUES (?, ?, ?, ?, ?, ?, ?, ?, now(), ?, ?)",
                    [eid, key.model_fingerprint, key.model_path, key.pooling, key.dtype, key.rules_id,
                     key.hidden_size, key.num_layers, key.truncate_to, key.stored_dtype],
                )
                faults.hit("register.committed")
            elif known != (key.hidden_size, key.num_layers):
                raise StoreError(
                    f"extraction {eid} was recorded with hidden_size={known[0]}, num_layers={known[1]}; "
                    f"got {key.hidden_size}, {key.num_layers}"
                )
        return eid

    def has_extraction(self, extraction_id: str) -> bool:
        with self._connect() as con:
            return _one(con, "SELECT count(*) FROM extractions WHERE extraction_id = ?", [extraction_id])[0] > 0

    def _extraction_rules(self, con: duckdb.DuckDBPyConnection, extraction_id: str) -> tuple[str, int]:
        found = _one(con, "SELECT rules_id, num_layers FROM extractions WHERE extraction_id = ?", [extraction_id])
        if found is None:
            raise StoreError(f"unknown extraction {extraction_id}")
        return found

    def plan(
        self, extraction_id: str, layers: list[int], rules_id: str, batch_size: int,
        sources: list[str] | None = None, fill: int = 1,
    ) -> list[WorkBatch]:
        """Batches of prompts lacking some requested layer, grouped by the set of layers they lack.

        Batches hold at most `batch_size` prompts. Work that would fill fewer than `fill` batches is cut into
        `fill` smaller ones (of at least `MIN_FILL_BATCH` prompts), so a small run still keeps `fill` batches
        in flight: one is written while the engine computes the next. Batch ids hash the extraction, the
        layers and the prompt list, so planning the same work twice gives the same batches (and the same
        Prefect cache keys).
        """
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        layers = _sorted_layers(layers)
        params = _todo_params(rules_id, extraction_id, layers, sources)
        with self._connect() as con:
            if self._extraction_rules(con, extraction_id)[0] != rules_id:
                raise StoreError(f"extraction {extraction_id} was registered with other normalisation rules")
            con.begin()
            con.execute(
                f"""CREATE TEMP TABLE numbered AS
                WITH {_TODO_CTES}
                SELECT missing, prompt_hash, row_number() OVER (ORDER BY missing NULLS FIRST, prompt_hash) AS rn
                FROM todo""",
                params,
            )
            pending = _one(con, "SELECT count(*) FROM numbered")[0]
            size = min(batch_size, max(MIN_FILL_BATCH, -(-pending // max(fill, 1))))
            con.execute(
                """CREATE TEMP TABLE plan AS
                WITH starts AS (SELECT missing, min(rn) AS start FROM numbered GROUP BY missing)
                SELECT n.missing, (rn - start) // $size AS chunk, CAST((rn - start) % $size AS INTEGER) AS ord,
                       prompt_hash
                FROM numbered n JOIN starts s ON n.missing IS NOT DISTINCT FROM s.missing""",
                {"size": size},
            )
            con.execute(
                """CREATE TEMP TABLE plan_batches AS
                SELECT substr(sha256(concat_ws(':', $eid, array_to_string(layers, ','), digest)), 1, 16)
                       AS batch_id, *
                FROM (SELECT missing, chunk, count(*) AS num_prompts,
                             coalesce(string_split(missing, ',')::INTEGER[], $layers) AS layers,
                             sha256(string_agg(prompt_hash, ',' ORDER BY ord)) AS digest
                      FROM plan GROUP BY missing, chunk)""",
                {"eid": extraction_id, "layers": layers},
            )
            con.execute(
                """INSERT INTO planned
                SELECT b.batch_id, p.ord, p.prompt_hash
                FROM plan p JOIN (SELECT * FROM plan_batches ANTI JOIN batches USING (batch_id)) b
                     ON p.missing IS NOT DISTINCT FROM b.missing AND p.chunk = b.chunk
                ORDER BY b.batch_id, p.ord"""
            )
            con.execute(
                """INSERT INTO batches
                SELECT batch_id, $eid, layers, digest, num_prompts, now()
                FROM plan_batches ANTI JOIN batches USING (batch_id)""",
                {"eid": extraction_id},
            )
            found = con.execute(
                "SELECT batch_id, layers, digest, num_prompts FROM plan_batches "
                "ORDER BY missing NULLS FIRST, chunk"
            ).fetchall()
            faults.hit("plan.before-commit")
            con.commit()
        faults.hit("plan.committed")
        return [WorkBatch(bid, extraction_id, list(lay), digest, n) for bid, lay, digest, n in found]

    def pending_prompts(
        self, extraction_id: str, layers: list[int], rules_id: str, sources: list[str] | None = None
    ) -> int:
        """How many prompts `plan` would plan, without planning them."""
        with self._connect() as con:
            return _one(con, f"WITH {_TODO_CTES} SELECT count(*) FROM todo",
                        _todo_params(rules_id, extraction_id, layers, sources))[0]

    def batch_prompts(self, batch_id: str) -> tuple[list[str], list[str]]:
        """(prompt hashes, normalised texts) of a planned batch, in plan order."""
        with self._connect() as con:
            found = con.execute(
                """SELECT p.prompt_hash, t.text FROM planned p JOIN prompts t ON p.prompt_hash = t.prompt_hash
                WHERE p.batch_id = ? ORDER BY p.ord""",
                [batch_id],
            ).fetchall()
        if not found:
            raise StoreError(f"unknown batch {batch_id}")
        return [h for h, _ in found], [t for _, t in found]

    def publish_part(
        self, extraction_id: str, part_id: str, relpath: str, layers: list[int], prompt_hashes: list[str]
    ) -> None:
        """Make one written file visible, in one transaction; refuses any (prompt, layer) already published."""
        self.publish_parts(extraction_id, layers, [(part_id, relpath, prompt_hashes)])

    def publish_parts(self, extraction_id: str, layers: list[int], files: list[tuple[str, str, list[str]]]) -> None:
        """Make a batch's written files, (part id, path, prompt hashes) each, visible together in one
        transaction: all of them or, on any refusal, none. Refuses any (prompt, layer) already published."""
        if not files:
            raise StoreError("no parts to publish")
        self.publish([Publication(extraction_id, layers, files)])

    def publish(self, publications: list[Publication]) -> None:
        """Make several batches' results visible in one transaction: all of them or, on any refusal, none.

        One transaction for many batches on purpose: each statement can wait milliseconds for Python's lock
        while vLLM's engine loop computes in this process, so a flow that falls behind publishes what is
        ready at once instead of paying those waits per batch.
        """
        publications = [replace(p, layers=_sorted_layers(p.layers)) for p in publications]
        part_ids = [part_id for p in publications for part_id, _, _ in p.files]
        if len(set(part_ids)) != len(part_ids):
            raise StoreError(f"part ids must be distinct, got {part_ids}")
        for p in publications:
            _check_files(self.root, p.files)
        _check_disjoint(publications)
        published = [p for p in publications if p.files]
        new = pa.table({
            "part_id": pa.array([part_id for p in published for part_id, _, hashes in p.files for _ in hashes],
                                pa.string()),
            "prompt_hash": pa.array([h for p in published for _, _, hashes in p.files for h in hashes], pa.string()),
        })
        new_parts = pa.table({
            "part_id": pa.array([part_id for p in published for part_id, _, _ in p.files], pa.string()),
            "extraction_id": pa.array([p.extraction_id for p in published for _ in p.files], pa.string()),
            "relpath": pa.array([relpath for p in published for _, relpath, _ in p.files], pa.string()),
            "layers": pa.array([p.layers for p in published for _ in p.files], pa.list_(pa.int32())),
            "num_prompts": pa.array([len(hashes) for p in published for _, _, hashes in p.files], pa.int64()),
        })
        with self._publish_lock, self._connect() as con:
            num_layers = dict(con.execute(
                "SELECT extraction_id, num_layers FROM extractions WHERE list_contains($eids, extraction_id)",
                {"eids": sorted({p.extraction_id for p in publications})},
            ).fetchall())
            for p in publications:
                if p.extraction_id not in num_layers:
                    raise StoreError(f"unknown extraction {p.extraction_id}")
                top = num_layers[p.extraction_id]
                if p.layers[0] < 0 or p.layers[-1] > top:
                    what = f"part {p.files[0][0]}" if p.files else "rejected prompts"
                    raise StoreError(f"{what}: layers must be within 0..{top}, got {p.layers}")
            con.begin()
            if published:
                con.register("new_part", new)
                con.register("new_parts", new_parts)
                known, unknown, unknown_part, clash, clash_part = _one(
                    con,
                    """SELECT
                        (SELECT min(part_id) FROM parts WHERE part_id IN (SELECT part_id FROM new_parts)),
                        (SELECT count(*) FROM new_part n ANTI JOIN prompts p USING (prompt_hash)),
                        (SELECT min(part_id) FROM new_part n ANTI JOIN prompts p USING (prompt_hash)),
                        c.n, c.part
                    FROM (SELECT count(*) AS n, min(n.part_id) AS part FROM new_part n
                          JOIN new_parts np ON n.part_id = np.part_id
                          JOIN part_prompts pp ON n.prompt_hash = pp.prompt_hash
                          JOIN parts p ON pp.part_id = p.part_id
                          WHERE p.extraction_id = np.extraction_id AND list_has_any(p.layers, np.layers)) c""",
                )
                if known is not None:
                    raise StoreError(f"part {known} is already published")
                if unknown:
                    raise StoreError(f"part {unknown_part}: {unknown} prompt hashes are not in the store")
                if clash:
                    layers = next(p.layers for p in published for part_id, _, _ in p.files if part_id == clash_part)
                    raise StoreError(f"part {clash_part}: {clash} prompts already have some of layers {layers}")
                con.execute("INSERT INTO parts SELECT part_id, extraction_id, relpath, layers, num_prompts, now() "
                            "FROM new_parts")
                con.execute("INSERT INTO part_prompts SELECT part_id, prompt_hash FROM new_part")
            _insert_once(con, "prompt_rejects", [(p.extraction_id, p.rejected) for p in publications])
            _insert_once(con, "prompt_notes", [(p.extraction_id, p.notes) for p in publications])
            faults.hit("publish.before-commit")
            con.commit()
        faults.hit("publish.committed")

    def reject_prompts(self, extraction_id: str, reasons: dict[str, str]) -> int:
        """Record prompts the engine refused (e.g. too long), so plans skip them and the ledger says why;
        a prompt keeps its first reason. Runs record them with their batch's files (`publish`)."""
        if not reasons:
            return 0
        # The same lock as publishing: a check-then-insert from two threads at once would record twice.
        with self._publish_lock, self._connect() as con:
            return _insert_once(con, "prompt_rejects", [(extraction_id, reasons)])

    def quarantine_batch(self, batch_id: str, extraction_id: str, error: str) -> None:
        """Remember a batch that kept failing; its prompts stay planned, so the next run tries them again."""
        with self._connect() as con:
            con.execute(
                "INSERT OR REPLACE INTO quarantined VALUES (?, ?, ?, now())", [batch_id, extraction_id, error]
            )

    def ledger_counts(
        self, rules_id: str, extraction_id: str | None, layers: list[int], sources: list[str] | None = None
    ) -> dict:
        """Rows per status, plus rows per reason (rejections, quarantine errors, notes): {"rows", "embedded",
        "duplicate", "rejected", "pending", "quarantined", "reasons": {reason: n}}. The statuses add up to
        "rows". `sources` limits it to those input files."""
        params = _todo_params(rules_id, extraction_id, layers, sources)
        with self._connect() as con:
            found = con.execute(
                f"SELECT status, reason, count(*) FROM ({_LEDGER_SQL}) GROUP BY ALL", params
            ).fetchall()
        counts = {"rows": 0, "embedded": 0, "duplicate": 0, "rejected": 0, "pending": 0, "quarantined": 0,
                  "reasons": {}}
        for status, reason, n in found:
            counts["rows"] += n
            counts[status] += n
            if reason is not None and status == "rejected":
                counts["reasons"][reason] = counts["reasons"].get(reason, 0) + n
        return counts

    def sweep_staging(self, min_age_s: float = 3600.0) -> int:
        """Delete files no reader can see: staged leftovers and unpublished parts older than `min_age_s`.

        The age guard keeps files of batches still being written or about to be published.
        """
        faults.hit("sweep")
        with self._connect() as con:
            published = {row[0] for row in con.execute("SELECT path FROM parts").fetchall()}
        cutoff = time.time() - min_age_s
        removed = 0
        for path in [*(self.root / "staging").rglob("*"), *(self.root / "parts").rglob("*")]:
            relpath = path.relative_to(self.root).as_posix()
            if path.is_file() and relpath not in published and path.stat().st_mtime < cutoff:
                path.unlink()
                removed += 1
        return removed


class Store:
    """Read-only view of a store: embeddings per layer, the ledger, and what has been extracted.

    Keyword filters (model = path or fingerprint, pooling, dtype, rules_id, store_dtype) pick one extraction
    when the store holds several.
    """

    def __init__(self, store_dir: str | os.PathLike) -> None:
        self.root = Path(store_dir).expanduser().resolve()
        self.db_path = self.root / DB_NAME
        if not self.db_path.is_file():
            raise StoreError(f"{self.root}: not a layertap store (no {DB_NAME})")
        with self._connect() as con:
            self.schema_version = _check_version(con, self.db_path, readable=UPGRADABLE_VERSIONS)
            self.store_uuid = _one(con, "SELECT value FROM meta WHERE key = 'store_uuid'")[0]

    def _connect(self) -> duckdb.DuckDBPyConnection:
        return _connect(self.db_path, read_only=True)

    def extractions(self) -> pa.Table:
        """One row per extraction key, with the layers that have published results."""
        with self._connect() as con:
            return con.sql(
                """SELECT e.extraction_id, e.model_path, e.model_fingerprint, e.pooling, e.dtype, e.stored_dtype,
                       e.rules_id, e.hidden_size, e.num_layers,
                       list_sort(list_distinct(flatten(list(p.layers) FILTER (p.layers IS NOT NULL)))) AS layers,
                       e.created_at
                FROM extractions e LEFT JOIN parts p USING (extraction_id)
                GROUP BY ALL ORDER BY e.created_at, e.extraction_id"""
            ).to_arrow_table()

    def _pick(
        self, con: duckdb.DuckDBPyConnection, model: str | None, pooling: str | None, dtype: str | None,
        rules_id: str | None, store_dtype: str | None = None,
    ) -> tuple[str, int, str, list[int]]:
        """(extraction_id, num_layers, rules_id, layers with results) of the one matching extraction."""
        found = con.execute(
            """SELECT e.extraction_id, e.num_layers, e.rules_id,
                      list_sort(list_distinct(flatten(list(p.layers) FILTER (p.layers IS NOT NULL)))),
                      e.model_path, e.pooling, e.dtype, e.stored_dtype
            FROM extractions e LEFT JOIN parts p USING (extraction_id)
            WHERE ($model IS NULL OR e.model_fingerprint = $model OR e.model_path IN ($model, $model_abs))
              AND ($pooling IS NULL OR e.pooling = $pooling) AND ($dtype IS NULL OR e.dtype = $dtype)
              AND ($rules IS NULL OR e.rules_id = $rules) AND ($stored IS NULL OR e.stored_dtype = $stored)
            GROUP BY ALL""",
            {"model": model, "model_abs": os.path.abspath(model) if model else None,
             "pooling": pooling, "dtype": dtype, "rules": rules_id, "stored": store_dtype},
        ).fetchall()
        if not found:
            raise StoreError(f"{self.root}: no extraction matches")
        if len(found) > 1:
            listed = "; ".join(f"model={m} pooling={p} dtype={d} store_dtype={sd} rules_id={r}"
                               for _, _, r, _, m, p, d, sd in found)
            raise StoreError(
                f"{self.root}: several extractions match ({listed}); pass model/pooling/dtype/store_dtype/rules_id")
        eid, num_layers, rules_id, layers = found[0][:4]
        return eid, num_layers, rules_id, list(layers or [])

    def layers(
        self, *, model: str | None = None, pooling: str | None = None, dtype: str | None = None,
        rules_id: str | None = None, store_dtype: str | None = None,
    ) -> list[int]:
        """Layers with at least one published result."""
        with self._connect() as con:
            return self._pick(con, model, pooling, dtype, rules_id, store_dtype)[3]

    def resolve_layer(
        self, layer: int, *, model: str | None = None, pooling: str | None = None, dtype: str | None = None,
        rules_id: str | None = None, store_dtype: str | None = None,
    ) -> int:
        """The 0..N index of `layer` (negative counts from the end) in the chosen extraction's model."""
        with self._connect() as con:
            num_layers = self._pick(con, model, pooling, dtype, rules_id, store_dtype)[1]
        return layer + num_layers + 1 if layer < 0 else layer

    def embeddings(
        self, layer: int, *, model: str | None = None, pooling: str | None = None, dtype: str | None = None,
        rules_id: str | None = None, store_dtype: str | None = None,
    ) -> pa.Table:
        """prompt_hash, text, embedding for one layer (negative counts from the end), sorted by prompt_hash.

        Reads only the prompt_hash and layer_{L} column chunks of each part, never other layers' bytes. The
        database is not held open while the vectors are read, so a long read never keeps a run from
        publishing (published parts are never changed, so what was listed stays readable).
        """
        with self._connect() as con:
            eid, num_layers, _, _ = self._pick(con, model, pooling, dtype, rules_id, store_dtype)
            layer = layer + num_layers + 1 if layer < 0 else layer
            found = con.execute(
                "SELECT path FROM parts WHERE extraction_id = ? AND list_contains(layers, ?) ORDER BY part_id",
                [eid, layer],
            ).fetchall()
        paths = [part_path(self.root, row[0]) for row in found]
        if not paths:
            raise StoreError(f"{self.root}: layer {layer} has no results for extraction {eid}")
        hashes, embedding = read_layer_sorted([str(path) for path in paths], layer_column(layer))
        with self._connect() as con:
            con.register("wanted", pa.table({"prompt_hash": hashes}))
            texts = con.sql("SELECT prompt_hash, text FROM prompts SEMI JOIN wanted USING (prompt_hash)")
            texts = texts.to_arrow_table()
        text = texts["text"].take(pc.index_in(hashes, value_set=texts["prompt_hash"]))
        return pa.table({"prompt_hash": hashes, "text": text, "embedding": embedding})

    def sql(
        self, query: str, *, model: str | None = None, pooling: str | None = None, dtype: str | None = None,
        rules_id: str | None = None, store_dtype: str | None = None,
    ) -> pa.Table:
        """Run DuckDB SQL over the published results of one extraction, e.g.
        `Store(path).sql("SELECT prompt_hash, layer_4 FROM vectors")`.

        Two views: `vectors` (prompt_hash, then a `layer_<L>` column per layer with results: one row per
        prompt, NULL where that prompt lacks the layer) over the published Parquet files only, never files a
        run has written but not published; and `prompts` (prompt_hash, text) of those prompts. The query runs
        in a connection of its own, after the store's database is closed again.
        """
        with self._connect() as con:
            eid, _, _, layers = self._pick(con, model, pooling, dtype, rules_id, store_dtype)
            paths = [str(part_path(self.root, row[0])) for row in con.execute(
                "SELECT path FROM parts WHERE extraction_id = ? ORDER BY part_id", [eid]).fetchall()]
            texts = con.sql("""SELECT t.prompt_hash, t.text FROM prompts t
                               WHERE t.prompt_hash IN (SELECT pp.prompt_hash FROM part_prompts pp
                                                       JOIN parts p USING (part_id) WHERE p.extraction_id = $eid)""",
                            params={"eid": eid}).to_arrow_table()
        if not paths:
            raise StoreError(f"{self.root}: extraction {eid} has no published results")
        with duckdb.connect() as con:
            con.execute("SET enable_progress_bar = false")
            columns = ", ".join(f"any_value({name}) AS {name}" for name in map(_quote_ident, map(layer_column, layers)))
            files = ", ".join(_quote_literal(path) for path in paths)  # a view takes no parameters
            con.execute(f"""CREATE VIEW vectors AS
                            SELECT prompt_hash, {columns} FROM read_parquet([{files}], union_by_name = true)
                            GROUP BY prompt_hash""")
            con.register("prompts", texts)
            return con.sql(query).to_arrow_table()

    def ledger(
        self, layers: list[int] | None = None, *, model: str | None = None, pooling: str | None = None,
        dtype: str | None = None, rules_id: str | None = None, store_dtype: str | None = None,
    ) -> pa.Table:
        """One row per input row: source, row_number, status (embedded|duplicate|rejected|pending), reason,
        prompt_hash. `layers` defaults to every layer with results (every layer if none has any yet)."""
        with self._connect() as con:
            eid, num_layers, rules_id, published = self._pick(con, model, pooling, dtype, rules_id, store_dtype)
            layers = _sorted_layers(layers or published or range(num_layers + 1))
            return con.sql(
                f"{_LEDGER_SQL} ORDER BY j.source, j.row_number",
                params=_todo_params(rules_id, eid, layers, None),
            ).to_arrow_table()
