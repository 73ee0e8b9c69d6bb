"""The store on real DuckDB files and real Parquet parts: ingest, dedup, plan, publish, ledger, reads."""

from __future__ import annotations

import csv
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from layertap.errors import InputError, StoreError
from layertap.store.normalise import NormaliseRules, prompt_hash
from layertap.store.extraction_key import ExtractionKey
from layertap.store.publish import Publication
from layertap.store.reader import Store
from layertap.store.store_db import StoreDB
from layertap.parts.writer import write_batch_files, write_part

RULES = NormaliseRules()
HIDDEN = 4
KEY = ExtractionKey("fp-1", "/models/tiny", "last", "float32", RULES.rules_id, hidden_size=HIDDEN, num_layers=3)


def write_csv(path: Path, texts: list[str], delimiter: str = ",") -> Path:
    with open(path, "w", newline="", encoding="utf-8") as f:
        out = csv.writer(f, delimiter=delimiter, lineterminator="\n")
        out.writerow(["id", "text"])
        out.writerows([i, t] for i, t in enumerate(texts))
    return path


def vector(h: str, layer: int) -> np.ndarray:
    """A vector anyone can recompute from (prompt, layer), so reads can be checked exactly."""
    return np.arange(HIDDEN, dtype=np.float32) + int(h[:6], 16) % 1000 + layer / 10


def publish(db: StoreDB, eid: str, batches, dtype: str = "float32") -> None:
    """Stand-in for extraction: write and publish each batch's part."""
    for batch in batches:
        hashes, _ = db.batch_prompts(batch.batch_id)
        vecs = {layer: np.stack([vector(h, layer) for h in hashes]) for layer in batch.layers}
        relpath = write_part(db.root, eid, batch.batch_id, hashes, vecs, dtype)
        db.publish_part(eid, batch.batch_id, relpath, batch.layers, hashes)


def table(db: StoreDB, sql: str) -> list[tuple]:
    with duckdb.connect(str(db.db_path), read_only=True) as con:
        return con.execute(sql).fetchall()


@pytest.fixture
def db(tmp_path) -> StoreDB:
    return StoreDB(tmp_path / "store").prepare()


@pytest.fixture
def inputs(tmp_path) -> Path:
    """One file per format; 'hello world' appears in all of them (dup after normalising)."""
    data = tmp_path / "data"
    data.mkdir()
    write_csv(data / "a.csv", ["hello  world", "", "first", "hello world"])
    write_csv(data / "b.tsv", ["tab\tinside", "second", " hello world "], delimiter="\t")
    pq.write_table(
        pa.table({"text": ["third", None, "hello\u00a0world"], "n": [1, 2, 3]}), data / "c.parquet"
    )
    lines = [{"text": "fourth", "x": 1}, {"text": None}, {"text": "5"}, {"x": 2}, {"text": "hello world"}]
    (data / "d.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return data


def ingest_and_plan(db: StoreDB, inputs: Path, layers=(0, 1), batch_size: int = 4):
    db.ingest([str(inputs / "*")], "text")
    db.normalise(RULES)
    eid = db.register_extraction(KEY)
    return eid, db.plan(eid, list(layers), RULES.rules_id, batch_size)


# ingest


def test_ingest_reads_every_format_with_source_and_row_number(db, inputs):
    report = db.ingest([str(inputs / "*")], "text")
    assert (report.sources_read, report.sources_skipped, report.rows_total, report.rows_new) == (4, 0, 15, 15)
    rows = table(db, "SELECT source, row_number, raw_text FROM rows ORDER BY source, row_number")
    by_file = {}
    for source, row_number, raw in rows:
        assert os.path.isabs(source)
        by_file.setdefault(Path(source).name, []).append((row_number, raw))
    assert by_file["a.csv"] == [(0, "hello  world"), (1, ""), (2, "first"), (3, "hello world")]
    assert by_file["b.tsv"] == [(0, "tab\tinside"), (1, "second"), (2, " hello world ")]
    assert by_file["c.parquet"] == [(0, "third"), (1, None), (2, "hello\u00a0world")]
    assert by_file["d.jsonl"] == [(0, "fourth"), (1, None), (2, "5"), (3, None), (4, "hello world")]


def test_json_arrays_and_odd_column_names(db, tmp_path):
    name = 'the "prompt", quoted'
    (tmp_path / "a.json").write_text(json.dumps([{name: "x"}, {name: "y"}]))
    with open(tmp_path / "b.csv", "w", newline="") as f:
        csv.writer(f).writerows([["id", name], [0, "z"]])
    assert db.ingest([str(tmp_path / "a.json"), str(tmp_path / "b.csv")], name).rows_new == 3
    assert sorted(r[0] for r in table(db, "SELECT raw_text FROM rows")) == ["x", "y", "z"]


def test_row_numbers_follow_file_order_in_a_big_csv(db, tmp_path):
    n = 300_000  # several scan chunks, read by several threads
    write_csv(tmp_path / "big.csv", [f"row {i}" for i in range(n)])
    assert db.ingest([str(tmp_path / "big.csv")], "text").rows_new == n
    assert table(db, "SELECT count(*) FROM rows WHERE raw_text <> 'row ' || row_number") == [(0,)]


def test_unchanged_source_is_skipped_and_changed_source_replaced(db, tmp_path):
    path = write_csv(tmp_path / "in.csv", ["one", "two"])
    assert db.ingest([str(path)], "text").rows_new == 2
    again = db.ingest([str(path)], "text")
    assert (again.sources_read, again.sources_skipped, again.rows_total, again.rows_new) == (0, 1, 2, 0)
    with open(path, "a", encoding="utf-8") as f:
        f.write("2,three\n")
    changed = db.ingest([str(path)], "text")
    assert (changed.sources_read, changed.rows_total, changed.rows_new) == (1, 3, 3)
    assert table(db, "SELECT row_number, raw_text FROM rows ORDER BY row_number") == [
        (0, "one"), (1, "two"), (2, "three")
    ]


@pytest.mark.parametrize(
    "name, content, column, message",
    [
        ("in.csv", "id,body\n1,x\n", "text", "no column 'text' (columns: id, body)"),
        ("in.jsonl", '{"body": "x"}\n', "text", "no column 'text'"),
        ("in.parquet", "not parquet", "text", "cannot read as parquet"),
        ("in.xlsx", "x", "text", "unsupported file type"),
        ("in.csv", "", "text", "the file is empty"),
        ("in.jsonl", "", "text", "the file is empty"),
    ],
)
def test_input_errors_are_one_line_naming_file_and_column(db, tmp_path, name, content, column, message):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(InputError) as err:
        db.ingest([str(path)], column)
    assert message in str(err.value) and str(path) in str(err.value) and "\n" not in str(err.value)


def test_missing_paths_and_empty_globs(db, tmp_path):
    with pytest.raises(InputError, match="no such file"):
        db.ingest([str(tmp_path / "nope.csv")], "text")
    with pytest.raises(InputError, match="no file matches"):
        db.ingest([str(tmp_path / "*.csv")], "text")


def test_a_bad_file_stops_the_ingest_before_anything_is_written(db, tmp_path):
    write_csv(tmp_path / "good.csv", ["x"])
    (tmp_path / "bad.csv").write_text("id,body\n1,x\n")
    with pytest.raises(InputError, match="bad.csv"):
        db.ingest([str(tmp_path / "good.csv"), str(tmp_path / "bad.csv")], "text")
    assert table(db, "SELECT count(*) FROM rows") == [(0,)]


# normalise


def test_normalise_dedups_rejects_and_adds_up(db, inputs):
    db.ingest([str(inputs / "*")], "text")
    report = db.normalise(RULES)
    assert report.rows == 15
    assert report.rejected == {"null text": 3, "empty after normalisation": 1}
    # "hello world" appears 5 times in 4 spellings
    assert (report.new_prompts, report.duplicates) == (7, 4)
    assert report.new_prompts + report.duplicates + sum(report.rejected.values()) == report.rows
    texts = dict(table(db, "SELECT prompt_hash, text FROM prompts"))
    assert texts[prompt_hash("hello world")] == "hello world" and texts[prompt_hash("tab inside")] == "tab inside"
    again = db.normalise(RULES)
    assert (again.rows, again.new_prompts) == (0, 0)


def test_other_rules_get_their_own_rows(db, tmp_path):
    db.ingest([str(write_csv(tmp_path / "in.csv", ["Done.", "Done"]))], "text")
    assert db.normalise(RULES).new_prompts == 2
    strip = db.normalise(NormaliseRules(remove_period=True))
    assert (strip.rows, strip.new_prompts, strip.duplicates) == (2, 0, 2)


# plan and publish


def test_plan_batches_prompts_in_hash_order_with_stable_ids(db, inputs):
    eid, batches = ingest_and_plan(db, inputs, batch_size=3)
    assert [b.num_prompts for b in batches] == [3, 3, 1]
    assert all(b.layers == [0, 1] and b.extraction_id == eid for b in batches)
    hashes = [h for b in batches for h in db.batch_prompts(b.batch_id)[0]]
    assert hashes == [h for (h,) in table(db, "SELECT prompt_hash FROM prompts ORDER BY prompt_hash")]
    hashes, texts = db.batch_prompts(batches[0].batch_id)
    assert [prompt_hash(t) for t in texts] == hashes
    assert batches[0].prompt_hashes_digest == hashlib.sha256(",".join(hashes).encode()).hexdigest()
    assert db.plan(eid, [1, 0, 1], RULES.rules_id, 3) == batches  # same work, same batches


@pytest.mark.parametrize(("prompts", "sizes"), [(1000, [250] * 4), (300, [128, 128, 44]), (100, [100]),
                                                (5000, [1024] * 4 + [904])])
def test_a_small_run_is_cut_into_enough_batches_to_keep_them_in_flight(db, tmp_path, prompts, sizes):
    db.ingest([str(write_csv(tmp_path / "in.csv", [f"prompt {i}" for i in range(prompts)]))], "text")
    db.normalise(RULES)
    eid = db.register_extraction(KEY)
    assert db.pending_prompts(eid, [0, 1], RULES.rules_id) == prompts
    batches = db.plan(eid, [0, 1], RULES.rules_id, 1024, fill=4)
    assert [b.num_prompts for b in batches] == sizes
    assert db.plan(eid, [0, 1], RULES.rules_id, 1024, fill=4) == batches  # same work, same batches


def test_nothing_is_planned_once_everything_is_published(db, inputs):
    eid, batches = ingest_and_plan(db, inputs)
    publish(db, eid, batches)
    assert db.plan(eid, [0, 1], RULES.rules_id, 4) == []
    assert db.plan(eid, [1], RULES.rules_id, 4) == []


def test_appended_rows_plan_only_new_prompts(db, tmp_path):
    path = write_csv(tmp_path / "in.csv", ["one", "two"])
    db.ingest([str(path)], "text")
    db.normalise(RULES)
    eid = db.register_extraction(KEY)
    publish(db, eid, db.plan(eid, [0], RULES.rules_id, 10))
    with open(path, "a", encoding="utf-8") as f:
        f.write("2,three\n3, two \n")
    db.ingest([str(path)], "text")
    db.normalise(RULES)
    (batch,) = db.plan(eid, [0], RULES.rules_id, 10)
    assert db.batch_prompts(batch.batch_id) == ([prompt_hash("three")], ["three"])


def test_more_layers_plan_only_the_missing_layers(db, inputs):
    eid, batches = ingest_and_plan(db, inputs, layers=(0, 1), batch_size=100)
    publish(db, eid, batches)
    (more,) = db.plan(eid, [0, 1, 2, 3], RULES.rules_id, 100)
    assert more.layers == [2, 3] and more.num_prompts == 7


def test_missing_layer_sets_group_prompts(db, tmp_path):
    db.ingest([str(write_csv(tmp_path / "in.csv", ["p", "q", "r"]))], "text")
    db.normalise(RULES)
    eid = db.register_extraction(KEY)
    p, q, r = (prompt_hash(t) for t in "pqr")
    for part_id, hashes, layers in [("a", [p, q], [0, 1]), ("b", [p], [2]), ("c", [r], [1, 2, 3])]:
        vecs = {layer: np.zeros((len(hashes), HIDDEN)) for layer in layers}
        db.publish_part(eid, part_id, write_part(db.root, eid, part_id, hashes, vecs, "float32"), layers, hashes)
    plan = db.plan(eid, [0, 1, 2], RULES.rules_id, 10)
    got = {tuple(b.layers): db.batch_prompts(b.batch_id)[0] for b in plan}
    assert got == {(0,): [r], (2,): [q]}  # p is covered by two parts together


def test_publish_part_refuses_duplicates_and_bad_parts(db, inputs):
    eid, batches = ingest_and_plan(db, inputs, batch_size=100)
    publish(db, eid, batches)
    hashes, _ = db.batch_prompts(batches[0].batch_id)
    zeros = {1: np.zeros((2, HIDDEN)), 2: np.zeros((2, HIDDEN))}
    relpath = write_part(db.root, eid, "again", hashes[:2], zeros, "float32")
    with pytest.raises(StoreError, match="already have"):
        db.publish_part(eid, "again", relpath, [1, 2], hashes[:2])
    with pytest.raises(StoreError, match="already published"):
        db.publish_part(eid, batches[0].batch_id, relpath, [2], hashes[:2])
    with pytest.raises(StoreError, match="not in the store"):
        db.publish_part(eid, "stranger", relpath, [2], ["f" * 64])
    with pytest.raises(StoreError, match="not a file"):
        db.publish_part(eid, "ghost", "parts/nope.parquet", [2], hashes[:2])
    with pytest.raises(StoreError, match="within 0..3"):
        db.publish_part(eid, "deep", relpath, [4], hashes[:2])
    with pytest.raises(StoreError, match="unknown extraction"):
        db.publish_part("0" * 16, "x", relpath, [2], hashes[:2])
    assert table(db, "SELECT count(*) FROM parts") == [(1,)]
    db.publish_part(eid, "layer2", relpath, [2], hashes[:2])  # a new layer for the same prompts is fine
    assert db.plan(eid, [0, 1, 2], RULES.rules_id, 100)[0].num_prompts == 5


def test_batches_published_together_are_one_transaction(db, tmp_path):
    """Several batches' files, rejections and notes become visible at once; a refusal of any one of them
    (against the store or within the group) leaves the store as it was."""
    db.ingest([str(write_csv(tmp_path / "in.csv", ["p", "q", "r", "s"]))], "text")
    db.normalise(RULES)
    eid = db.register_extraction(KEY)
    p, q, r, s = (prompt_hash(t) for t in "pqrs")

    def part(part_id, hashes, layers=(0, 1)):
        vecs = {layer: np.zeros((len(hashes), HIDDEN)) for layer in layers}
        return part_id, write_part(db.root, eid, part_id, hashes, vecs, "float32"), hashes

    def recorded():
        return (table(db, "SELECT part_id FROM parts ORDER BY part_id"),
                table(db, "SELECT prompt_hash, reason FROM prompt_rejects"),
                table(db, "SELECT prompt_hash, note FROM prompt_notes"))

    db.publish([Publication(eid, [0, 1], [part("a", [p])], notes={p: "truncated to 8 tokens"}),
                Publication(eid, [1, 0], [part("b", [q])]),
                Publication(eid, [0, 1], [], rejected={r: "longer than max_model_len"})])
    before = recorded()
    assert before == ([("a",), ("b",)], [(r, "longer than max_model_len")], [(p, "truncated to 8 tokens")])
    (batch,) = db.plan(eid, [0, 1], RULES.rules_id, 10)
    assert db.batch_prompts(batch.batch_id)[0] == [s]

    with pytest.raises(StoreError, match=r"part again: 1 prompts already have some of layers \[1\]"):
        db.publish([Publication(eid, [0, 1], [part("c", [s])], rejected={q: "refused"}),
                    Publication(eid, [1], [part("again", [p], layers=(1,))])])
    with pytest.raises(StoreError, match="parts c1 and c2 share prompts and layers"):
        db.publish([Publication(eid, [0, 1], [part("c1", [s])]),
                    Publication(eid, [1, 2], [part("c2", [s], layers=(1, 2))])])
    assert recorded() == before
    db.publish([Publication(eid, [0, 1], [part("c1", [s])]), Publication(eid, [2], [part("c2", [s], layers=(2,))])])
    assert len(recorded()[0]) == 4


def test_engine_rejections_leave_the_plan_and_show_in_the_ledger(db, inputs):
    eid, batches = ingest_and_plan(db, inputs, batch_size=100)
    refused = prompt_hash("hello world")
    assert db.reject_prompts(eid, {refused: "longer than max_model_len"}) == 1
    assert db.reject_prompts(eid, {refused: "longer than max_model_len"}) == 0
    (batch,) = db.plan(eid, [0, 1], RULES.rules_id, 100)
    assert batch.num_prompts == 6 and refused not in db.batch_prompts(batch.batch_id)[0]
    counts = db.ledger_counts(RULES.rules_id, eid, [0, 1])
    assert counts["rejected"] == 4 + 5 and counts["reasons"]["longer than max_model_len"] == 5


def test_threads_opening_the_store_at_once_all_get_a_working_connection(db, inputs):
    """Batches in flight open the store from several threads; each open that creates the process's database
    instance must finish before another thread uses it (or Arrow scans are missing on that connection)."""
    eid, _ = ingest_and_plan(db, inputs, batch_size=100)
    refused = prompt_hash("hello world")
    errors = []

    def record_rejections():
        for _ in range(40):
            try:
                db.reject_prompts(eid, {refused: "longer than max_model_len"})  # registers an Arrow table
            except Exception as exc:  # noqa: BLE001 - every failure is collected and reported below
                errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=record_rejections) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[:3]
    assert table(db, "SELECT count(*) FROM prompt_rejects") == [(1,)]


def test_the_stored_dtype_changes_the_key_only_when_it_is_not_the_engine_dtypes_default(db):
    """float16 storage of a float32 engine is another extraction; asking for the default changes nothing, so
    stores made before the option keep their ids. Readers see the stored dtype in `extractions()`."""
    assert KEY.stored_dtype == "float32"
    assert ExtractionKey(**{**KEY.__dict__, "store_dtype": "float32"}).extraction_id == KEY.extraction_id
    half = ExtractionKey(**{**KEY.__dict__, "store_dtype": "float16"})
    assert half.extraction_id != KEY.extraction_id
    f16 = ExtractionKey(**{**KEY.__dict__, "dtype": "float16"})
    assert f16.stored_dtype == "float16"
    assert ExtractionKey(**{**f16.__dict__, "store_dtype": "float16"}).extraction_id == f16.extraction_id
    db.register_extraction(KEY)
    db.register_extraction(half)
    listed = Store(db.root).extractions().to_pydict()
    assert dict(zip(listed["extraction_id"], listed["stored_dtype"])) == {
        KEY.extraction_id: "float32", half.extraction_id: "float16"}


def test_a_version_2_store_gets_each_extractions_stored_dtype_when_upgraded(db):
    float16_engine = ExtractionKey(**{**KEY.__dict__, "dtype": "float16"})
    for key in (KEY, float16_engine):
        db.register_extraction(key)
    with duckdb.connect(str(db.db_path)) as con:  # what a store made before the stored-dtype option looks like
        con.execute("ALTER TABLE extractions DROP COLUMN stored_dtype")
        con.execute("UPDATE meta SET value = '2' WHERE key = 'schema_version'")
    assert Store(db.root).schema_version == "2"
    StoreDB(db.root).prepare()
    listed = Store(db.root).extractions().to_pydict()
    assert dict(zip(listed["extraction_id"], listed["stored_dtype"])) == {
        KEY.extraction_id: "float32", float16_engine.extraction_id: "float16"}


def test_register_extraction_is_idempotent_and_checks_shape(db):
    eid = db.register_extraction(KEY)
    assert db.register_extraction(KEY) == eid == KEY.extraction_id and len(eid) == 16
    other = ExtractionKey(**{**KEY.__dict__, "hidden_size": 8})
    with pytest.raises(StoreError, match="hidden_size"):
        db.register_extraction(other)
    assert ExtractionKey(**{**KEY.__dict__, "pooling": "mean"}).extraction_id != eid
    assert ExtractionKey(**{**KEY.__dict__, "model_path": "/elsewhere"}).extraction_id == eid


def test_plan_refuses_other_rules(db, inputs):
    eid, _ = ingest_and_plan(db, inputs)
    with pytest.raises(StoreError, match="normalisation rules"):
        db.plan(eid, [0], NormaliseRules(remove_period=True).rules_id, 4)


# ledger


def test_ledger_accounts_for_every_row_before_and_after(db, inputs):
    eid, batches = ingest_and_plan(db, inputs)
    before = db.ledger_counts(RULES.rules_id, eid, [0, 1])
    assert before == {"rows": 15, "embedded": 0, "duplicate": 4, "rejected": 4, "pending": 7, "quarantined": 0,
                      "reasons": {"null text": 3, "empty after normalisation": 1}}
    publish(db, eid, batches)
    after = db.ledger_counts(RULES.rules_id, eid, [0, 1])
    assert (after["embedded"], after["duplicate"], after["rejected"], after["pending"]) == (7, 4, 4, 0)
    assert db.ledger_counts(RULES.rules_id, eid, [0, 1, 2])["pending"] == 7

    ledger = Store(db.root).ledger([0, 1])
    assert ledger.num_rows == 15
    assert len({(r["source"], r["row_number"]) for r in ledger.to_pylist()}) == 15
    hello = [r for r in ledger.to_pylist() if r["prompt_hash"] == prompt_hash("hello world")]
    assert [(Path(r["source"]).name, r["row_number"], r["status"]) for r in hello] == [
        ("a.csv", 0, "embedded"), ("a.csv", 3, "duplicate"), ("b.tsv", 2, "duplicate"),
        ("c.parquet", 2, "duplicate"), ("d.jsonl", 4, "duplicate"),
    ]


def test_ledger_matches_a_python_reference(db, tmp_path):
    """Random rows over a small vocabulary, half the batches published, one prompt refused by the engine."""
    rng = np.random.default_rng(3)
    words = ["alpha", "beta", "gamma", "delta", "epsilon"]
    spellings = ["{}", " {} ", "{}\u00a0", "{}  ", "\t{}"]

    def text():
        if rng.random() < 0.05:
            return rng.choice(["", "  ", "\u3000"])
        word = " ".join(rng.choice(words, size=rng.integers(1, 3)))
        return rng.choice(spellings).format(word)

    files = {tmp_path / "x.csv": [text() for _ in range(300)], tmp_path / "y.csv": [text() for _ in range(200)]}
    for path, texts in files.items():
        write_csv(path, texts)
    nulls = [None if rng.random() < 0.1 else text() for _ in range(100)]
    (tmp_path / "z.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in nulls))
    files[tmp_path / "z.jsonl"] = nulls

    db.ingest([str(tmp_path / "*")], "text")
    db.normalise(RULES)
    eid = db.register_extraction(KEY)
    batches = db.plan(eid, [0, 2], RULES.rules_id, 7)
    publish(db, eid, batches[::2])
    published = {h for b in batches[::2] for h in db.batch_prompts(b.batch_id)[0]}
    refused = db.batch_prompts(batches[1].batch_id)[0][0]
    db.reject_prompts(eid, {refused: "too long"})

    expected, seen = [], set()
    for path in sorted(files):
        for row_number, raw in enumerate(files[path]):
            norm = None if raw is None else RULES.apply(raw)
            h = prompt_hash(norm) if norm else None
            if raw is None or not norm:
                status = ("rejected", "null text" if raw is None else "empty after normalisation")
            elif h == refused:
                status = ("rejected", "too long")
            elif h in seen:
                status = ("duplicate", None)
            else:
                status = ("embedded" if h in published else "pending", None)
            seen.add(h)
            expected.append((str(path), row_number, *status, h))
    ledger = Store(db.root).ledger([0, 2])
    got = [tuple(r.values()) for r in ledger.to_pylist()]
    assert got == expected
    counts = db.ledger_counts(RULES.rules_id, eid, [0, 2])
    assert sum(counts[s] for s in ("embedded", "duplicate", "rejected", "pending")) == counts["rows"] == 600


def test_rows_not_yet_normalised_are_pending(db, tmp_path):
    db.ingest([str(write_csv(tmp_path / "in.csv", ["x", "x"]))], "text")
    assert db.ledger_counts(RULES.rules_id, None, [0])["pending"] == 2


# reading


def test_store_embeddings_returns_vectors_texts_sorted(db, inputs):
    eid, batches = ingest_and_plan(db, inputs, layers=(0, 3), batch_size=3)
    publish(db, eid, batches)
    store = Store(db.root)
    got = store.embeddings(layer=3)
    assert got.column_names == ["prompt_hash", "text", "embedding"]
    assert got.schema.field("embedding").type == pa.list_(pa.float32(), HIDDEN)
    assert got["prompt_hash"].to_pylist() == sorted(got["prompt_hash"].to_pylist()) and got.num_rows == 7
    for row in got.to_pylist():
        assert prompt_hash(row["text"]) == row["prompt_hash"]
        np.testing.assert_array_equal(row["embedding"], vector(row["prompt_hash"], 3))
    assert store.embeddings(layer=-1).equals(got)  # the model has 3 layers: -1 is 3
    assert store.layers() == [0, 3]
    with pytest.raises(StoreError, match="layer 1 has no results"):
        store.embeddings(layer=1)


def test_reading_vectors_never_holds_the_database(db, inputs, monkeypatch):
    """While a reader reads a layer's vectors, another process can open the store for writing (as a run does
    to publish), so a long read never makes a publish wait or fail."""
    import layertap.store.reader as store_module

    eid, batches = ingest_and_plan(db, inputs, layers=(0, 3), batch_size=3)
    publish(db, eid, batches)
    opened = []
    read = store_module.read_layer_sorted
    code = "import duckdb, sys; duckdb.connect(sys.argv[1]).execute('CHECKPOINT').close(); print('written')"

    def reading(*args):
        out = subprocess.run([sys.executable, "-c", code, str(db.db_path)], capture_output=True, text=True,
                             timeout=60)
        opened.append(out.stdout.strip() or out.stderr.strip().splitlines()[-1])
        return read(*args)

    monkeypatch.setattr(store_module, "read_layer_sorted", reading)
    assert Store(db.root).embeddings(layer=3).num_rows == 7
    assert opened == ["written"]


def test_sql_over_published_results_only(db, inputs):
    """One line of DuckDB SQL over the published vectors and their texts; a file written into parts/ but never
    published is not part of it."""
    eid, batches = ingest_and_plan(db, inputs, layers=(0, 3), batch_size=3)
    publish(db, eid, batches[:2])
    stray = db.root / "parts" / eid / "not-published.parquet"
    stray.parent.mkdir(parents=True, exist_ok=True)
    stray.write_bytes(next((db.root / "parts").rglob("*.parquet")).read_bytes())
    store = Store(db.root)
    found = store.sql("SELECT v.prompt_hash, p.text, v.layer_3 FROM vectors v JOIN prompts p USING (prompt_hash) "
                      "ORDER BY prompt_hash")
    assert found.num_rows == 6 and found.column_names == ["prompt_hash", "text", "layer_3"]
    expected = store.embeddings(layer=3)
    assert found.to_pydict() == dict(zip(found.column_names, expected.to_pydict().values()))
    assert store.sql("SELECT count(*) AS n FROM vectors WHERE layer_0 IS NOT NULL")["n"].to_pylist() == [6]


def test_store_picks_one_extraction(db, inputs):
    eid, batches = ingest_and_plan(db, inputs)
    publish(db, eid, batches)
    mean = ExtractionKey(**{**KEY.__dict__, "pooling": "mean", "dtype": "float16"})
    mean_id = db.register_extraction(mean)
    publish(db, mean_id, db.plan(mean_id, [0], RULES.rules_id, 100), dtype="float16")
    store = Store(db.root)
    with pytest.raises(StoreError, match="several extractions match"):
        store.embeddings(layer=0)
    half = store.embeddings(layer=0, pooling="mean")
    assert half.schema.field("embedding").type == pa.list_(pa.float16(), HIDDEN)
    assert store.embeddings(layer=0, model="fp-1", dtype="float32").num_rows == 7
    assert store.layers(pooling="last") == [0, 1] and store.layers(pooling="mean") == [0]
    assert store.extractions()["extraction_id"].to_pylist() == [eid, mean_id]
    with pytest.raises(StoreError, match="no extraction matches"):
        store.embeddings(layer=0, model="/other/model")


def test_embeddings_read_only_the_requested_layer(db, tmp_path):
    """Counts bytes the process reads (Linux rchar) while reading one layer of a part holding four."""
    io = Path("/proc/self/io")
    if not io.exists():
        pytest.skip("needs /proc/self/io")
    texts = [f"prompt {i}" for i in range(2000)]
    db.ingest([str(write_csv(tmp_path / "in.csv", texts))], "text")
    db.normalise(RULES)
    eid = db.register_extraction(ExtractionKey(**{**KEY.__dict__, "hidden_size": 1024}))
    hashes = sorted(prompt_hash(t) for t in texts)
    rng = np.random.default_rng(0)
    vecs = {layer: rng.standard_normal((2000, 1024)).astype(np.float32) for layer in range(4)}
    relpath = write_part(db.root, eid, "big", hashes, vecs, "float32")
    db.publish_part(eid, "big", relpath, [0, 1, 2, 3], hashes)
    meta = pq.ParquetFile(db.root / relpath).metadata.row_group(0)
    columns = (meta.column(i) for i in range(meta.num_columns))
    chunk = {c.path_in_schema.split(".")[0]: c.total_compressed_size for c in columns}

    def rchar() -> int:
        return int(next(line for line in io.read_text().splitlines() if line.startswith("rchar")).split()[1])

    store = Store(db.root)
    store.embeddings(layer=1)  # warm up imports and caches
    start = rchar()
    got = store.embeddings(layer=2)
    read = rchar() - start
    np.testing.assert_array_equal(np.asarray(got["embedding"].combine_chunks().flatten()).reshape(2000, 1024)[0],
                                  vecs[2][0])
    other_layers = chunk["layer_0"] + chunk["layer_1"] + chunk["layer_3"]
    assert chunk["layer_2"] <= read < chunk["layer_2"] + chunk["prompt_hash"] + 2_000_000 < other_layers


# store lifecycle


def test_schema_version_is_checked(tmp_path):
    db = StoreDB(tmp_path / "s").prepare()
    with duckdb.connect(str(db.db_path)) as con:
        con.execute("UPDATE meta SET value = '0' WHERE key = 'schema_version'")
    with pytest.raises(StoreError, match="schema version 0"):
        StoreDB(tmp_path / "s").prepare()
    with pytest.raises(StoreError, match="schema version 0"):
        StoreDB(tmp_path / "s").normalise(RULES)
    with pytest.raises(StoreError, match="schema version 0"):
        Store(tmp_path / "s")
    with pytest.raises(StoreError, match="not a layertap store"):
        Store(tmp_path / "elsewhere")


def test_store_uuid_is_made_once(tmp_path):
    first = StoreDB(tmp_path / "s").store_uuid
    assert StoreDB(tmp_path / "s").store_uuid == first == Store(tmp_path / "s").store_uuid
    assert StoreDB(tmp_path / "t").store_uuid != first


def test_a_writer_in_another_process_is_waited_out(db):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import duckdb, sys, time; c = duckdb.connect(sys.argv[1]); print(flush=True); "
         "time.sleep(1.5)", str(db.db_path)],
        stdout=subprocess.PIPE,
    )
    holder.stdout.readline()  # the other process holds the file now
    start = time.monotonic()
    assert Store(db.root).store_uuid == db.store_uuid
    assert time.monotonic() - start > 0.5
    holder.wait()


def test_a_writer_in_this_process_is_waited_out(db):
    con = duckdb.connect(str(db.db_path))  # a read-write connection blocks read-only ones in this process
    threading.Timer(0.5, con.close).start()
    assert Store(db.root).store_uuid == db.store_uuid


def test_sweep_staging_removes_only_invisible_files(db, inputs):
    eid, batches = ingest_and_plan(db, inputs, batch_size=100)
    publish(db, eid, batches)
    (db.root / "staging" / "crashed.parquet").write_bytes(b"half")
    write_part(db.root, eid, "unpublished", ["a" * 64], {0: np.zeros((1, HIDDEN))}, "float32")
    assert db.sweep_staging(min_age_s=3600) == 0  # too young: may still be in flight
    assert db.sweep_staging(min_age_s=0) == 2
    assert [p.name for p in (db.root / "parts" / eid).iterdir()] == [f"{batches[0].batch_id}.parquet"]
    assert Store(db.root).embeddings(layer=0).num_rows == 7


def test_a_batch_written_as_several_files_is_published_whole_or_not_at_all(db, inputs):
    eid, (batch, *_) = ingest_and_plan(db, inputs, batch_size=100)
    hashes, _ = db.batch_prompts(batch.batch_id)
    vecs = {layer: np.stack([vector(h, layer) for h in hashes]) for layer in batch.layers}
    files = write_batch_files(db.root, eid, "split", hashes, vecs, "float32", max_file_bytes=1, max_files=2)
    assert len(files) == 2
    listed = [(f["part_id"], f["relpath"], f["prompt_hashes"]) for f in files]

    stray = listed[0][2][:1]  # the second file claims a prompt the first one holds: nothing is published
    with pytest.raises(StoreError, match="distinct"):
        db.publish_parts(eid, batch.layers, [listed[0], (listed[1][0], listed[1][1], listed[1][2] + stray)])
    published = write_batch_files(db.root, eid, "other", hashes[:1], {k: v[:1] for k, v in vecs.items()}, "float32",
                                  max_file_bytes=1)
    db.publish_parts(eid, batch.layers, [(f["part_id"], f["relpath"], f["prompt_hashes"]) for f in published])
    with pytest.raises(StoreError, match="part split-0: 1 prompts already have"):
        db.publish_parts(eid, batch.layers, listed)  # the first file clashes: the second is not published either
    assert table(db, "SELECT part_id FROM parts") == [("other",)]

    db.publish_parts(eid, [2], listed)  # another layer for the same prompts is fine
    rows = table(db, "SELECT part_id, count(*) FROM part_prompts GROUP BY ALL ORDER BY part_id")
    assert rows == [("other", 1), ("split-0", len(files[0]["prompt_hashes"])), ("split-1", len(files[1]["prompt_hashes"]))]
    with pytest.raises(StoreError, match="part split-0 is already published"):
        db.publish_parts(eid, [2], listed)


def test_a_store_handle_opens_the_database_once_per_operation(tmp_path, inputs, monkeypatch):
    """Opening the file is a task's main fixed cost: making the handle opens nothing, an operation once."""
    path = tmp_path / "fresh"
    handle = StoreDB(path)
    assert not handle.db_path.exists()
    eid, batches = ingest_and_plan(handle, inputs)
    opened, real_connect = [], duckdb.connect
    monkeypatch.setattr(duckdb, "connect", lambda *args, **kwargs: opened.append(args) or real_connect(*args, **kwargs))
    hashes, _ = StoreDB(path).batch_prompts(batches[0].batch_id)
    assert len(opened) == 1 and len(hashes) == batches[0].num_prompts
    assert StoreDB(path).store_uuid == handle.store_uuid and len(opened) == 2


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_layer_read_from_many_files_comes_back_sorted_by_prompt_with_its_own_vectors(db, inputs, dtype):
    eid, (batch, *_) = ingest_and_plan(db, inputs, layers=(0, 1), batch_size=100)
    hashes, _ = db.batch_prompts(batch.batch_id)
    hashes = hashes[::-1]  # files hold rows in the engine's order, not the store's
    vecs = {layer: np.stack([vector(h, layer) for h in hashes]) for layer in batch.layers}
    files = write_batch_files(db.root, eid, "many", hashes, vecs, dtype, max_file_bytes=1, max_files=3)
    db.publish_parts(eid, batch.layers, [(f["part_id"], f["relpath"], f["prompt_hashes"]) for f in files])
    table = Store(db.root).embeddings(layer=1)
    assert len(files) == 3 and table["prompt_hash"].to_pylist() == sorted(hashes)
    stored = pq.read_schema(db.root / files[0]["relpath"]).field("layer_1").type
    assert table.schema.field("embedding").type == pa.list_(stored.value_type, HIDDEN)
    got = np.asarray(table["embedding"].combine_chunks().flatten()).reshape(len(hashes), HIDDEN)
    np.testing.assert_array_equal(got, np.stack([vector(h, 1) for h in sorted(hashes)]).astype(dtype))
    texts = dict(zip(*db.batch_prompts(batch.batch_id)))
    assert table["text"].to_pylist() == [texts[h] for h in sorted(hashes)]
