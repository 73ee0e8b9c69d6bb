"""Big and odd input files on a real store: long cells, a large CSV with malformed lines near its end, and
a file DuckDB refuses whole, read by the careful reader as a stream. Every row is accounted for: read, or
rejected with its reason and its place in the file."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import duckdb
import pytest

from layertap.store.careful_reader import BATCH_ROWS, CarefulRows, read_csv_rows
from layertap.errors import InputError
from layertap.store.store_db import StoreDB

LONG = 200_000  # past Python's csv default field limit of 131,072 characters


def rows(store: Path) -> list[tuple]:
    with duckdb.connect(str(store / "layertap.duckdb"), read_only=True) as con:
        return con.execute("SELECT row_number, raw_text, input_reject FROM rows ORDER BY row_number").fetchall()


def test_a_cell_longer_than_131072_characters_is_read_whole(tmp_path):
    """By DuckDB's scans, and by the careful reader; a line over DuckDB's 2 MB line limit is a rejected row."""
    plain = tmp_path / "long.csv"
    plain.write_text(f"id,text\n0,short\n1,{'a' * LONG}\n2,after\n")
    odd = tmp_path / "odd.csv"  # a line over 2 MB makes the sniffing scan give up: the RFC 4180 scan reads it
    odd.write_text(f"text\n{'x' * 2_100_000}\n{'b' * LONG}\n\"quoted, {'c' * LONG}\"\n")

    StoreDB(tmp_path / "s1").ingest([str(plain)], "text")
    assert [(n, len(t), r) for n, t, r in rows(tmp_path / "s1")] == [(0, 5, None), (1, LONG, None), (2, 5, None)]
    StoreDB(tmp_path / "s2").ingest([str(odd)], "text")
    assert [(n, t and len(t), r) for n, t, r in rows(tmp_path / "s2")] == [
        (0, None, "malformed CSV: line over 2,000,000 bytes"), (1, LONG, None), (2, LONG + 8, None)]
    careful = read_csv_rows(str(odd), "text").column("text").to_pylist()
    assert [len(t) for t in careful] == [2_100_000, LONG, LONG + 8]


def big_csv(path: Path, count: int, bad: dict[int, bytes]) -> None:
    """`count` records, a few of them malformed (`bad`: record index -> raw line); one quoted cell spans two
    lines, so record indices differ from line numbers."""
    with path.open("wb") as out:
        out.write(b"id,text\n")
        chunk = []
        for i in range(count):
            if i in bad:
                chunk.append(bad[i])
            elif i == 7:
                chunk.append(b'7,"a cell over\ntwo lines"\n')
            else:
                chunk.append(b"%d,row %d of a large file with some words in it\n" % (i, i))
            if len(chunk) == 65536:
                out.write(b"".join(chunk))
                chunk = []
        out.write(b"".join(chunk))


def test_a_large_csv_with_malformed_lines_near_its_end_keeps_every_row(tmp_path):
    """DuckDB reads the file at full speed and records the lines it cannot parse; each becomes a rejected row
    at its own place, and the ingest says which file and line, in one line."""
    count = 600_000  # about 30 MB
    bad = {count - 40: b"x,too,many,columns\n", count - 30: b"1,bad \xff\xfe bytes\n",
           count - 2: b'y,"a quote never closed\n'}
    path = tmp_path / "big.csv"
    big_csv(path, count, bad)
    assert path.stat().st_size > 25e6

    report = StoreDB(tmp_path / "store").ingest([str(path)], "text")

    got = rows(tmp_path / "store")
    assert report.rows_total == count - 1  # the unclosed quote runs to the end: the last line is inside it
    assert [n for n, _, _ in got] == list(range(count - 1))
    rejected = {n: reason for n, _, reason in got if reason}
    assert rejected == {count - 40: "malformed CSV: too many columns", count - 30: "invalid UTF-8 bytes",
                        count - 2: "malformed CSV: a quote not closed where the cell ends"}
    texts = {n: t for n, t, _ in got}
    for n in (0, 6, 8, count - 41, count - 39, count - 31, count - 29, count - 3):
        assert texts[n] == f"row {n} of a large file with some words in it"
    assert texts[7] == "a cell over\ntwo lines"
    [note] = report.malformed
    assert note.startswith(f"{path}: 3 malformed CSV lines rejected, the first at line {count - 40 + 2}: "
                           "malformed CSV: too many columns")
    assert "\n" not in note


def test_the_careful_reader_streams_a_file_duckdb_refuses(tmp_path):
    """A JSON-lines file with a broken line near its end: read in batches, never whole (Python's memory
    peaks far below the file's size), and every line is a row."""
    path = tmp_path / "big.jsonl"
    count = 150_000
    with path.open("w") as out:
        for i in range(count):
            record = json.dumps({"text": f"line {i} " + "w" * 40})
            out.write('{"text": "unterminated\n' if i == count - 5 else record + "\n")
    size = path.stat().st_size
    assert size > 9e6

    reader = CarefulRows(str(path), "text", "json")
    tracemalloc.start()
    try:
        batches = 0
        for batch in reader.batches():
            batches += 1
            assert batch.num_rows <= BATCH_ROWS
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert batches >= count // BATCH_ROWS and peak < size / 3, (batches, peak, size)

    StoreDB(tmp_path / "store").ingest([str(path)], "text")
    got = rows(tmp_path / "store")
    assert len(got) == count and [n for n, _, _ in got] == list(range(count))
    assert [(n, r) for n, _, r in got if r] == [(count - 5, "malformed JSON line")]


def test_a_careful_read_that_cannot_go_on_is_one_line_naming_file_and_line(tmp_path, monkeypatch):
    """A cell longer than the careful reader takes (in practice a quote never closed) fails the file with one
    line naming file and line, not the csv module's bare error."""
    import layertap.store.careful_reader as careful

    monkeypatch.setattr(careful, "CSV_CELL_LIMIT", 1000)
    path = tmp_path / "odd.csv"
    path.write_text(f"text\nok\n\"{'y' * 5000}\"\n")
    with pytest.raises(InputError) as raised:
        CarefulRows(str(path), "text", "csv").table()
    assert str(raised.value) == (f"{path}: line 3: cannot read as CSV: a cell longer than 1,000 characters "
                                 "(a quote never closed?)")
