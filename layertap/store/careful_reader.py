"""A row-by-row reader for the input files DuckDB's fast scanners refuse as a whole.

One invalid UTF-8 byte in a CSV, or one lone surrogate or broken line in a JSON-lines file, makes DuckDB
reject the entire file. Real data has such rows, and losing a million good rows over one bad one is worse
than slow: this reader keeps every row, and marks the bad ones with the reason they cannot be embedded.
It runs only when the fast scan failed, so clean files never pay for it. It streams: rows go to the store
in Arrow batches of bounded size as the file is read, so a file of any size is never held in memory whole
(a `.json` file holding one JSON array is the exception: it is one JSON value, parsed as one).

Both readers return (row_number, text, reject_reason) columns that follow DuckDB's conventions, so a row
means the same whichever reader produced it: CSV cells are never NULL (an empty cell is ''), blank JSON
lines are skipped, a missing key or JSON null is NULL.
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Iterator

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

# A batch goes to the store once it holds this many rows or characters, whichever comes first.
BATCH_ROWS = 8192
BATCH_CHARS = 16 * 2**20
# Python's csv module refuses cells over 131,072 characters by default; prompts can be longer. A cell over this
# many characters (usually a quote that is never closed, swallowing the rest of the file) fails the file.
CSV_CELL_LIMIT = 64 * 2**20


def _batch(rows: list[tuple[int, str | None, str | None]]) -> pa.RecordBatch:
    numbers, texts, rejects = zip(*rows) if rows else ((), (), ())
    return pa.record_batch([list(numbers), list(texts), list(rejects)], schema=SCHEMA)


class CarefulRows:
    """The (row_number, text, reject) rows of one file, read as a stream of Arrow batches.

    The header (CSV) or the file's shape (JSON array or lines) is checked when this is made; a problem met
    while streaming (a cell too long to be one, no JSON object in the whole file) is raised from `batches()`
    and kept in `error`, so a caller whose reader was consumed by DuckDB can raise it as it was.
    """

    def __init__(self, path: str, text_column: str, kind: str, delimiter: str = ",") -> None:
        self.path, self.text_column, self.kind, self.delimiter = path, text_column, kind, delimiter
        self.error: InputError | None = None
        self.index = self.columns = 0
        if kind == "csv":
            self.index, self.columns = self._csv_header()

    def reader(self) -> pa.RecordBatchReader:
        return pa.RecordBatchReader.from_batches(SCHEMA, self.batches())

    def table(self) -> pa.Table:
        return pa.Table.from_batches(list(self.batches()), schema=SCHEMA)

    def batches(self) -> Iterator[pa.RecordBatch]:
        rows: list[tuple[int, str | None, str | None]] = []
        chars = 0
        try:
            for row in self._csv_rows() if self.kind == "csv" else self._json_rows():
                rows.append(row)
                chars += len(row[1] or "")
                if len(rows) >= BATCH_ROWS or chars >= BATCH_CHARS:
                    yield _batch(rows)
                    rows, chars = [], 0
        except InputError as exc:
            self.error = exc
            raise
        if rows:
            yield _batch(rows)

    def _open_text(self):
        return open(self.path, encoding="utf-8", errors="surrogateescape", newline="")

    def _csv_header(self) -> tuple[int, int]:
        with self._open_text() as handle:
            header = next(csv.reader(handle, delimiter=self.delimiter), None)
        if header is None:
            raise InputError(f"{self.path}: empty file, no header row")
        header = [name.lstrip("\ufeff") if i == 0 else name for i, name in enumerate(header)]
        if self.text_column not in header:
            shown = ", ".join(_SURROGATE.sub("\ufffd", name) for name in header)
            raise InputError(f"{self.path}: no column {self.text_column!r} (columns: {shown})")
        return header.index(self.text_column), len(header)

    def _csv_rows(self) -> Iterator[tuple[int, str | None, str | None]]:
        """Cells with bytes that are not UTF-8 are rejected; every other row is kept as it is."""
        csv.field_size_limit(CSV_CELL_LIMIT)
        with self._open_text() as handle:
            reader = csv.reader(handle, delimiter=self.delimiter)
            next(reader)
            number = 0
            while True:
                try:
                    record = next(reader)
                except StopIteration:
                    return
                except csv.Error as exc:
                    reason = str(exc)
                    if "field larger than field limit" in reason:
                        reason = f"a cell longer than {CSV_CELL_LIMIT:,} characters (a quote never closed?)"
                    raise InputError(f"{self.path}: line {reader.line_num}: cannot read as CSV: {reason}") from None
                cell = record[self.index] if self.index < len(record) else ""
                yield (number, None, REJECT_BAD_UTF8) if _SURROGATE.search(cell) else (number, cell, None)
                number += 1

    def _json_lines(self) -> Iterator[str]:
        with open(self.path, "rb") as handle:
            start = handle.read(4096).lstrip()
            handle.seek(0)
            if start.startswith(b"["):  # a .json file holding one array of records: one value, parsed whole
                content = handle.read().decode("utf-8", errors="surrogateescape")
                try:
                    records = json.loads(content)
                except (ValueError, TypeError):
                    raise InputError(f"{self.path}: cannot read as JSON: not a valid JSON array") from None
                del content
                for record in records:
                    yield json.dumps(record)
                return
            for raw in handle:
                yield raw.decode("utf-8", errors="surrogateescape").rstrip("\n")

    def _json_rows(self) -> Iterator[tuple[int, str | None, str | None]]:
        """One record per non-blank line; a line that is not JSON, or whose value is not text, is rejected.

        A file in which no line is a JSON object is not JSON lines at all, and fails as a whole.
        """
        number, objects, has_column = 0, 0, False
        for line in self._json_lines():
            if not line.strip():
                continue
            if _SURROGATE.search(line):  # raw bytes that are not UTF-8 (escaped surrogates are plain ASCII here)
                row = (number, None, REJECT_BAD_UTF8)
            else:
                try:
                    record = json.loads(line)
                except ValueError:
                    record, row = None, (number, None, REJECT_BAD_JSON)
                else:
                    if not isinstance(record, dict):
                        row = (number, None, REJECT_NOT_OBJECT)
                    else:
                        objects += 1
                        has_column = has_column or self.text_column in record
                        row = (number, *_json_value(record.get(self.text_column)))
            yield row
            number += 1
        if not objects:
            raise InputError(f"{self.path}: cannot read as JSON lines: no line holds a JSON object")
        if not has_column:
            raise InputError(f"{self.path}: no column {self.text_column!r} in any record")


def _json_value(value) -> tuple[str | None, str | None]:
    if value is None or isinstance(value, str):
        if value is not None and _SURROGATE.search(value):
            return None, REJECT_SURROGATE
        return value, None
    for kinds, name in _JSON_TYPES:
        if isinstance(value, kinds):
            return None, NOT_TEXT.format(name)
    return None, NOT_TEXT.format(type(value).__name__)


def read_csv_rows(path: str, text_column: str, delimiter: str = ",") -> pa.Table:
    """All rows of a CSV file as one table (small files and tests; the store streams `CarefulRows`)."""
    return CarefulRows(path, text_column, "csv", delimiter).table()


def read_json_lines(path: str, text_column: str) -> pa.Table:
    """All rows of a JSON-lines (or JSON array) file as one table (small files and tests)."""
    return CarefulRows(path, text_column, "json").table()
