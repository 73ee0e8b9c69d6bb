"""The SQL rules and their Python twin must agree exactly, or dedup and hashes would differ by code path."""

from __future__ import annotations

import hashlib
import random
import sys
import unicodedata

import duckdb
import pyarrow as pa
import pytest

from layertap.store.normalise import WHITESPACE_CLASS, WHITESPACE_RANGES, NormaliseRules, prompt_hash

ALL_WHITESPACE = [chr(c) for c in range(sys.maxunicode + 1) if chr(c).isspace()]

# Pieces that stress each step: every whitespace char, combining marks NFC composes (or reorders), singleton
# decompositions (Angstrom sign, Ohm sign, en quad -> en space), Hangul jamo, dots and spaces at the end.
PIECES = [
    *ALL_WHITESPACE,
    "a", "Z", "é", "e\u0301", "A\u030a", "\u212b", "\u2126", "o\u0308\u0301", "q\u0323\u0307", "q\u0307\u0323",
    "\u1100\u1161\u11a8", "한", "東京", "ß", "ﬁ", "\u200b", "\u200d", "\ufeff", "😀", "👩\u200d💻",
    ".", ". ",
    " . . .", "...", "!", "'", '"', "\\", "%", "_", "\u0300", "\u0338", "=\u0338", "\u00a0.", ".\u3000",
]

HAND_PICKED = [
    "",
    " ",
    "\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f \x85\xa0",
    "".join(ALL_WHITESPACE),
    "  hello   world  ",
    "hello\u2003\u2003world",
    "line one\r\nline two",
    "Hello world.",
    "Hello world . . .",
    "Hello world.\u00a0.\u3000",
    "...",
    ". . .",
    "e\u0301t\u00e9",
    "\u212bngstr\u00f6m",
    "a\u200bb",
    "trailing dot inside quote.\"",
]


def tricky_strings(n: int = 400, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    return HAND_PICKED + ["".join(rng.choices(PIECES, k=rng.randint(1, 12))) for _ in range(n)]


def sql_apply(rules: NormaliseRules, texts: list[str | None]) -> list[tuple[str | None, str | None]]:
    """(normalised, sha256) per text, computed by DuckDB."""
    con = duckdb.connect()
    con.register("t", pa.table({"i": list(range(len(texts))), "s": pa.array(texts, pa.string())}))
    expr = rules.sql("s")
    return [
        (norm, digest)
        for _, norm, digest in con.sql(f"SELECT i, {expr}, sha256({expr}) FROM t ORDER BY i").fetchall()
    ]


def test_whitespace_ranges_are_exactly_str_isspace():
    listed = {chr(c) for a, b in WHITESPACE_RANGES for c in range(a, b + 1)}
    assert listed == set(ALL_WHITESPACE)


def test_whitespace_class_matches_the_same_chars_in_duckdb():
    found = duckdb.sql(
        "SELECT list(c ORDER BY c) FROM (FROM range(0, 55296) UNION ALL FROM range(57344, 1114112)) t(c) "
        "WHERE regexp_full_match(chr(c::INTEGER), ?)",
        params=[WHITESPACE_CLASS],
    ).fetchall()[0][0]
    assert [chr(c) for c in found] == ALL_WHITESPACE


@pytest.mark.parametrize("remove_period", [False, True])
def test_sql_equals_python_on_tricky_strings(remove_period):
    rules = NormaliseRules(remove_period=remove_period)
    texts = tricky_strings()
    got = sql_apply(rules, texts)
    mismatches = [(t, s, rules.apply(t)) for t, (s, _) in zip(texts, got) if s != rules.apply(t)]
    assert mismatches == []
    assert any(rules.apply(t) != t for t in texts) and any(rules.apply(t) == "" for t in texts)


def test_duckdb_sha256_is_prompt_hash_of_utf8():
    rules = NormaliseRules()
    texts = tricky_strings(100)
    for text, (norm, digest) in zip(texts, sql_apply(rules, texts)):
        assert digest == prompt_hash(norm) == hashlib.sha256(norm.encode("utf-8")).hexdigest()


def test_python_reference_steps():
    plain, strip = NormaliseRules(), NormaliseRules(remove_period=True)
    assert plain.apply("  Hello\u00a0\t world  ") == "Hello world"
    assert plain.apply("Hello world . . .") == "Hello world . . ."
    assert strip.apply("Hello world . . .") == "Hello world"
    assert strip.apply("Hello world.\u00a0.") == "Hello world"
    assert plain.apply("e\u0301") == "\u00e9" == unicodedata.normalize("NFC", "e\u0301")
    assert plain.apply("\u200b") == "\u200b"  # zero-width space is not whitespace to str.isspace()
    assert strip.apply(" . . ") == "" and plain.apply("\r\n") == ""


def test_null_stays_null_in_sql():
    assert sql_apply(NormaliseRules(remove_period=True), [None]) == [(None, None)]


def test_rules_id_names_the_rules():
    assert NormaliseRules().rules_id == "nfc+trim+ws"
    assert NormaliseRules(remove_period=True).rules_id == "nfc+trim+ws+rstrip_period"
