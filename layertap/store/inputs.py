"""Reading input files into rows: which files a run names, and the scans that turn each into
(row_number, text, reject) rows.

DuckDB scans a whole file at once and streams; a CSV it refuses is read again with RFC 4180 quoting and a
rejects table (one bad line costs that line), and what DuckDB cannot read at all goes to the careful
reader (`careful_reader`), which keeps every row and marks the bad ones.
"""

from __future__ import annotations

import glob
import hashlib
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import duckdb

from layertap.errors import InputError
from layertap.store.careful_reader import CarefulRows
from layertap.store.schema import first_line, one, quote_ident, quote_literal

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

READERS = {
    ".csv": "csv", ".tsv": "csv", ".parquet": "parquet", ".jsonl": "json", ".ndjson": "json", ".json": "json"
}


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
            if Path(match).suffix.lower() not in READERS:
                raise InputError(f"{match}: unsupported file type (use {', '.join(READERS)})")
            files.append(os.path.realpath(match))
    return list(dict.fromkeys(files))


def file_sha256(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror or exc}") from None


def check_readable(path: str) -> None:
    """The file opens and yields its first byte: ingest's read (and fingerprint) of it will not be refused."""
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror or exc}") from None


def check_inputs(paths: list[str], text_column: str) -> list[str]:
    """Everything ingest would check, without a store: files exist, are readable, have the column.

    Returns the files. Runs on an in-memory database, so a bad input fails before the store is touched.
    """
    files = expand_inputs(paths)
    with duckdb.connect() as con:
        for path in files:
            check_readable(path)  # not a whole read: ingest fingerprints each file anyway
            try:
                row_source_sql(con, path, text_column)
            except ScanRefused as refused:
                reader = next_reader(con, path, text_column, refused)
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
    records the lines it could not parse (`record_malformed` turns them into rejected rows)."""

    sql: str
    params: dict
    rejects: str | None = None


def row_source_sql(con: duckdb.DuckDBPyConnection, path: str, text_column: str) -> _Scan:
    """SQL yielding (row_number, text, reject) for one file, after checking it is readable and has the column.

    Row numbers follow file order: WITH ORDINALITY runs as an order-preserving streaming window over the
    scan. CSV has no NULL, so an empty cell is '' (rejected as empty); a JSON or Parquet null stays NULL
    (rejected as null text). JSON numbers, booleans, arrays and objects, and Parquet columns that do not
    hold text, are rejected as `not text: <type>` rather than embedded as their printed form. A CSV this
    sniffing scan refuses is read again by `_csv_rejects_scan`.
    """
    if os.path.getsize(path) == 0:
        raise InputError(f"{path}: the file is empty (not even a header or one record)")
    kind = READERS[Path(path).suffix.lower()]
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
        raise ScanRefused(kind, exc) from None
    columns = {row[0]: row[1] for row in described}
    if text_column not in columns:
        if kind == "csv":  # the sniffer may have guessed the dialect wrong: the RFC 4180 reading decides
            raise ScanRefused(kind, f"no column {text_column!r} (columns: {', '.join(columns)})")
        raise InputError(f"{path}: no column {text_column!r} (columns: {', '.join(columns)})")
    col = quote_ident(text_column)
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
        raise ScanRefused("csv", exc) from None
    finally:
        drop_rejects(con, rejects)
    sql = (f"SELECT ordinality - 1 AS row_number, coalesce(c{header.index}, '') AS text, NULL AS reject "
           f"FROM {scan} WITH ORDINALITY")
    return _Scan(sql, params, rejects)


def next_reader(con: duckdb.DuckDBPyConnection, path: str, text_column: str, refused: ScanRefused, source=None):
    """What reads a file after `source` (the sniffing scan when None) was refused: for a CSV, the scan with a
    rejects table, then the careful reader; for JSON lines, the careful reader."""
    if not refused.recoverable:
        raise refused.as_input_error(path) from None
    if refused.kind == "csv" and (source is None or isinstance(source, _Scan) and source.rejects is None):
        try:
            return _csv_rejects_scan(con, path, text_column)
        except ScanRefused as again:
            if not again.recoverable:
                raise again.as_input_error(path) from None
    return _careful_rows(path, text_column)


def drop_rejects(con: duckdb.DuckDBPyConnection, rejects: str) -> None:
    for table in (rejects, f"{rejects}_scans", f"{rejects}_rows"):
        con.execute(f"DROP TABLE IF EXISTS temp.{quote_ident(table)}")


def record_malformed(con: duckdb.DuckDBPyConnection, path: str, rejects: str) -> tuple[int, str | None]:
    """The CSV lines DuckDB could not parse in this scan, as rejected rows of the file; returns how many, and
    one line naming the file, the first such line and what is wrong with it.

    DuckDB's `line` counts records from the header (1): a record's row number is `line - 2`. The rows read
    were numbered 0, 1, ... without them, so each moves up by the rejected lines before it: row g becomes
    g + k, where k counts the rejected records r_j with r_j - (j - 1) <= g (j = 1, 2, ... in line order).
    """
    exists = one(con, "SELECT count(*) FROM duckdb_tables() WHERE table_name = $t", {"t": rejects})[0]
    if not exists or not one(con, f"SELECT count(*) FROM temp.{quote_ident(rejects)}")[0]:
        return 0, None
    bad = quote_ident(f"{rejects}_rows")
    reasons = " ".join(f"WHEN {quote_literal(kind)} THEN {quote_literal(reason)}"
                       for kind, reason in MALFORMED_CSV.items())
    con.execute(f"""
        CREATE TEMP TABLE {bad} AS
        SELECT line - 2 AS r, line, kind, message,
               CASE kind {reasons} ELSE 'malformed CSV: ' || lower(kind) END AS reason,
               line - 2 - (row_number() OVER (ORDER BY line) - 1) AS s,
               row_number() OVER (ORDER BY line) AS k
        FROM (SELECT line, min_by(CAST(error_type AS VARCHAR), byte_position) AS kind,
                     min_by(error_message, byte_position) AS message
              FROM temp.{quote_ident(rejects)} WHERE line >= 2 GROUP BY line)""")
    con.execute(f"""
        UPDATE rows SET row_number = rows.row_number + moved.k
        FROM (SELECT g.row_number AS g, b.k FROM (SELECT row_number FROM rows WHERE source = $path) g
              ASOF JOIN (SELECT s, max(k) AS k FROM {bad} GROUP BY s) b ON g.row_number >= b.s) moved
        WHERE rows.source = $path AND rows.row_number = moved.g""", {"path": path})
    con.execute(f"INSERT INTO rows SELECT $path, r, NULL, reason FROM {bad}", {"path": path})
    count, line, reason, message = one(
        con, f"SELECT count(*), min(line), arg_min(reason, line), arg_min(message, line) FROM {bad}")
    lines = "line" if count == 1 else "lines"
    return count, (f"{path}: {count} malformed CSV {lines} rejected, the first at line {line}: {reason} "
                   f"({' '.join(str(message).split())})")


class ScanRefused(Exception):
    """DuckDB could not scan a whole file; some of these the careful reader can still read row by row."""

    def __init__(self, kind: str, exc: duckdb.Error | str):
        super().__init__(first_line(exc))
        self.kind = kind
        message = str(exc)
        csv_refused = "CSV Error" in message or "sniffing" in message or "no column" in message
        self.recoverable = kind == "csv" and csv_refused or kind == "json" and "Malformed JSON" in message

    def as_input_error(self, path: str) -> InputError:
        return InputError(f"{path}: cannot read as {self.kind}: {self}")


def _careful_rows(path: str, text_column: str) -> CarefulRows:
    """The row-by-row reader for a file DuckDB refused whole; it streams."""
    kind = READERS[Path(path).suffix.lower()]
    return CarefulRows(path, text_column, kind, "\t" if path.lower().endswith(".tsv") else ",")

