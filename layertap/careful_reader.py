"""A row-by-row reader for the input files DuckDB's fast scanners refuse as a whole.

One invalid UTF-8 byte in a CSV, or one lone surrogate or broken line in a JSON-lines file, makes DuckDB
reject the entire file. Real data has such rows, and losing a million good rows over one bad one is worse
than slow: this reader keeps every row, and marks the bad ones with the reason they cannot be embedded.
It runs only when the fast scan failed, so clean files never pay for it.

Both readers return (row_number, text, reject_reason) columns that follow DuckDB's conventions, so a row
means the same whichever reader produced it: CSV cells are never NULL (an empty cell is ''), blank JSON
lines are skipped, a missing key or JSON null is NULL.
"""

from __future__ import annotations

import csv
import io
import json
import re

import pyarrow as pa

from layertap.errors import InputError

REJECT_BAD_UTF8 = "invalid UTF-8 bytes"
REJECT_SURROGATE = "invalid Unicode: lone surrogate"
REJECT_BAD_JSON = "malformed JSON line"
REJECT_NOT_OBJECT = "not a JSON object"
NOT_TEXT = "not text: {}"  # formatted with the JSON type: number, boolean, array, object

_SURROGATE = re.compile("[\ud800-\udfff]")
_JSON_TYPES = ((bool, "boolean"), ((int, float), "number"), (list, "array"), (dict, "object"))

SCHEMA = pa.schema([("row_number", pa.int64()), ("text", pa.string()), ("reject", pa.string())])


def _table(rows: list[tuple[int, str | None, str | None]]) -> pa.Table:
    numbers, texts, rejects = zip(*rows) if rows else ((), (), ())
    return pa.table([list(numbers), list(texts), list(rejects)], schema=SCHEMA)


def read_csv_rows(path: str, text_column: str, delimiter: str = ",") -> pa.Table:
    """Cells with bytes that are not UTF-8 are rejected; every other row is kept as it is."""
    with open(path, "rb") as handle:
        decoded = handle.read().decode("utf-8", errors="surrogateescape")
    reader = csv.reader(io.StringIO(decoded, newline=""), delimiter=delimiter)
    header = next(reader, None)
    if header is None:
        raise InputError(f"{path}: empty file, no header row")
    header = [name.lstrip("\ufeff") if i == 0 else name for i, name in enumerate(header)]
    if text_column not in header:
        shown = ", ".join(_SURROGATE.sub("\ufffd", name) for name in header)
        raise InputError(f"{path}: no column {text_column!r} (columns: {shown})")
    index = header.index(text_column)
    rows = []
    for number, record in enumerate(reader):
        cell = record[index] if index < len(record) else ""
        if _SURROGATE.search(cell):
            rows.append((number, None, REJECT_BAD_UTF8))
        else:
            rows.append((number, cell, None))
    return _table(rows)


def _json_value(value) -> tuple[str | None, str | None]:
    if value is None or isinstance(value, str):
        if value is not None and _SURROGATE.search(value):
            return None, REJECT_SURROGATE
        return value, None
    for kinds, name in _JSON_TYPES:
        if isinstance(value, kinds):
            return None, NOT_TEXT.format(name)
    return None, NOT_TEXT.format(type(value).__name__)


def read_json_lines(path: str, text_column: str) -> pa.Table:
    """One record per non-blank line; a line that is not JSON, or whose value is not text, is rejected.

    A file in which no line is a JSON object is not JSON lines at all, and fails as a whole.
    """
    with open(path, "rb") as handle:
        content = handle.read().decode("utf-8", errors="surrogateescape")
    if content.lstrip().startswith("["):  # a .json file holding one array of records
        try:
            lines = [json.dumps(record) for record in json.loads(content)]
        except (ValueError, TypeError):
            raise InputError(f"{path}: cannot read as JSON: not a valid JSON array") from None
    else:
        lines = content.split("\n")
    rows, objects, has_column = [], 0, False
    for line in lines:
        if not line.strip():
            continue
        number = len(rows)
        if _SURROGATE.search(line):  # raw bytes that are not UTF-8 (escaped surrogates are plain ASCII here)
            rows.append((number, None, REJECT_BAD_UTF8))
            continue
        try:
            record = json.loads(line)
        except ValueError:
            rows.append((number, None, REJECT_BAD_JSON))
            continue
        if not isinstance(record, dict):
            rows.append((number, None, REJECT_NOT_OBJECT))
            continue
        objects += 1
        has_column = has_column or text_column in record
        rows.append((number, *_json_value(record.get(text_column))))
    if not objects:
        raise InputError(f"{path}: cannot read as JSON lines: no line holds a JSON object")
    if not has_column:
        raise InputError(f"{path}: no column {text_column!r} in any record")
    return _table(rows)
