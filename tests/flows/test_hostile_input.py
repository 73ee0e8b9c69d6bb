"""Over a thousand hostile rows through the real flow: the run succeeds and every row is accounted for,
each rejected one with the specific reason it cannot be embedded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("prefect_harness", "shared_engine")

LONG_TOKENS = 4096  # the tiny model's context (max_position_embeddings)


def long_text(i: int) -> str:
    return f"long {i} " + "x" * (LONG_TOKENS + 500)  # byte-level tokenizer: one token per byte


def hostile_csv(path: Path) -> list[tuple[str, str | None]]:
    """CSV rows as raw bytes (invalid UTF-8 included); returns the expected (status, reason) per row."""
    rows: list[tuple[bytes, tuple[str, str | None]]] = []
    for i in range(100):
        rows.append((b"", ("rejected", "empty after normalisation")))
        rows.append(([b" \t ", "\u3000".encode(), "\u00a0 \u2028".encode()][i % 3],
                     ("rejected", "empty after normalisation")))
        rows.append((f"nul \x00 inside {i}".encode(), ("rejected", "contains a NUL character")))
        rows.append((b"bad \xff\xfe bytes " + str(i).encode(), ("rejected", "invalid UTF-8 bytes")))
        rows.append((f"plain csv prompt {i % 50}".encode(), None))  # 50 distinct, each twice
    for i in range(5):
        rows.append((long_text(i).encode(), ("rejected", "too long")))
    rows.append((("y" * 200_000).encode(), ("rejected", "too long")))  # past Python csv's 131,072 limit
    # Lines DuckDB cannot parse, the last one running to the end of the file: rejected where they stand.
    raw = {len(rows): b"x,too,many,columns\n"}
    rows.append((b"", ("rejected", "malformed CSV: too many columns")))
    rows.append((b"after the malformed line", None))
    raw[len(rows)] = b'z,"a quote never closed\n'
    rows.append((b"", ("rejected", "malformed CSV: a quote not closed where the cell ends")))
    with path.open("wb") as handle:
        handle.write(b"id,text\n")
        for n, (cell, _) in enumerate(rows):
            handle.write(raw.get(n) or str(n).encode() + b',"' + cell.replace(b'"', b'""') + b'"\n')
    return [expected for _, expected in rows]


def hostile_jsonl(path: Path) -> list[tuple[str, str | None]]:
    lines: list[tuple[str, tuple[str, str | None] | None]] = []
    for i in range(50):
        lines.append((json.dumps({"text": None}), ("rejected", "null text")))
        lines.append((json.dumps({"id": i}), ("rejected", "null text")))  # key missing
        lines.append((json.dumps({"text": i}), ("rejected", "not text: number")))
        lines.append((json.dumps({"text": i + 0.5}), ("rejected", "not text: number")))
        lines.append((json.dumps({"text": i % 2 == 0}), ("rejected", "not text: boolean")))
        lines.append((json.dumps({"text": [i, "a"]}), ("rejected", "not text: array")))
        lines.append((json.dumps({"text": {"k": i}}), ("rejected", "not text: object")))
        lines.append(('{"text": "lone \\ud800 surrogate %d"}' % i, ("rejected", "invalid Unicode: lone surrogate")))
        lines.append(('{"text": "low \\udc80 first %d"}' % i, ("rejected", "invalid Unicode: lone surrogate")))
        lines.append((json.dumps({"text": f"nul \u0000 {i}"}), ("rejected", "contains a NUL character")))
        lines.append((json.dumps({"text": ""}), ("rejected", "empty after normalisation")))
        lines.append((json.dumps({"text": " \n\t "}), ("rejected", "empty after normalisation")))
        lines.append(('{"text": "unterminated %d' % i, ("rejected", "malformed JSON line")))
        lines.append((json.dumps({"text": f"plain json prompt {i}"}), None))
    for i in range(5, 10):
        lines.append((json.dumps({"text": long_text(i)}), ("rejected", "too long")))
    path.write_text("".join(line + "\n" for line, _ in lines), encoding="utf-8")
    return [expected for _, expected in lines]


def run_flow(tiny_model, inputs, store, **params):
    from flows.embed import embed_flow

    return embed_flow(input=[str(p) for p in inputs], model=tiny_model, layers="0,-1", store=str(store),
                      parity_sample=2, env_file=None, **params)


def check_ledger(store: Path, sources: dict[Path, list], truncated: bool) -> dict:
    from layertap import Store

    ledger = Store(store).ledger().to_pylist()
    assert len(ledger) == sum(len(rows) for rows in sources.values())
    assert {row["status"] for row in ledger} <= {"embedded", "duplicate", "rejected"}
    by_row = {(row["source"], row["row_number"]): row for row in ledger}
    seen_prompts = set()
    for path, expected in sources.items():
        for number, want in enumerate(expected):
            row = by_row[(str(path.resolve()), number)]
            if want is None:
                status = "duplicate" if row["prompt_hash"] in seen_prompts else "embedded"
                assert (row["status"], row["reason"]) == (status, None), (path.name, number, row)
                seen_prompts.add(row["prompt_hash"])
            elif want[1] == "too long":
                if truncated:
                    assert row["status"] == "embedded", row
                    assert row["reason"].startswith("truncated: ") and row["reason"].endswith(f"to {LONG_TOKENS}")
                else:
                    assert row["status"] == "rejected" and row["reason"].startswith("too long: "), row
            else:
                assert (row["status"], row["reason"]) == want, (path.name, number, row)
    return {status: sum(r["status"] == status for r in ledger) for status in ("embedded", "duplicate", "rejected")}


def test_hostile_rows_are_each_rejected_with_their_reason(tiny_model, tmp_path):
    sources = {tmp_path / "hostile.csv": None, tmp_path / "hostile.jsonl": None}
    sources[tmp_path / "hostile.csv"] = hostile_csv(tmp_path / "hostile.csv")
    sources[tmp_path / "hostile.jsonl"] = hostile_jsonl(tmp_path / "hostile.jsonl")
    hostile = sum(want is not None for rows in sources.values() for want in rows)
    assert hostile >= 1000

    summary = run_flow(tiny_model, sources, tmp_path / "store")

    counts = check_ledger(tmp_path / "store", sources, truncated=False)
    assert counts == {"embedded": 101, "duplicate": 50, "rejected": hostile}
    assert summary["embedded"] == 101 and summary["refused"] == 11
    assert summary["ledger"]["rows"] == sum(counts.values()) == sum(len(rows) for rows in sources.values())


def test_over_long_rows_are_truncated_only_when_asked(tiny_model, tmp_path):
    from layertap import Store

    texts = ["short prompt", long_text(0), long_text(1), "another short one"]
    source = tmp_path / "long.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))

    plain = run_flow(tiny_model, [source], tmp_path / "plain")
    cut = run_flow(tiny_model, [source], tmp_path / "cut", truncate=True)

    assert plain["embedded"] == 2 and plain["refused"] == 2
    assert cut["embedded"] == 4 and cut["refused"] == 0
    assert cut["extraction_id"] != plain["extraction_id"]  # truncated vectors never mix with whole ones
    ledger = Store(tmp_path / "cut").ledger().to_pylist()
    assert [row["status"] for row in ledger] == ["embedded"] * 4
    assert [row["reason"] for row in ledger] == [
        None, f"truncated: {len(texts[1]) + 1} tokens cut to {LONG_TOKENS}",
        f"truncated: {len(texts[2]) + 1} tokens cut to {LONG_TOKENS}", None,
    ]
    # A truncated prompt is embedded as its first LONG_TOKENS tokens: the same as the cut text itself.
    prefix = tmp_path / "prefix.jsonl"
    prefix.write_text(json.dumps({"text": texts[1][: LONG_TOKENS - 1]}) + "\n")  # BOS + 4095 bytes
    run_flow(tiny_model, [prefix], tmp_path / "prefix")
    whole = Store(tmp_path / "cut").embeddings(layer=-1).to_pylist()
    ref = Store(tmp_path / "prefix").embeddings(layer=-1).to_pylist()[0]["embedding"]
    got = next(r["embedding"] for r in whole if r["text"] == texts[1])
    assert max(abs(a - b) for a, b in zip(got, ref)) < 1e-4
