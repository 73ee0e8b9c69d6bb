"""The embed flow end to end: real Prefect (test harness), real DuckDB/Parquet, real vLLM on a tiny model.

One engine serves the whole test run: the registry is pinned, so flows do not close it between tests.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import time
from pathlib import Path

import duckdb
import numpy as np
import pyarrow.parquet as pq
import pytest

from layertap.runner import engine_cache
from layertap.errors import ValidationError as CheckFailed
from layertap.parts.writer import encoder_threads

LAYERS = "0,2,-1"  # -> [0, 2, 4] on the 4-layer tiny model

ROWS = [
    "The river carried the old boat downstream.",
    "A small robot repaired the broken clock.",
    "The river carried the old boat downstream.",  # exact duplicate
    "  A small   robot repaired the broken clock. ",  # duplicate after normalisation
    "Why is the sky blue?",
    None,  # null text
    " \t ",  # empty after normalisation
    "東京は日本の首都です。",
    "Emoji 🚀 in a prompt",
    "Une phrase en français, avec des accents : été, où, ça.",
    "short",
    "A much longer prompt that goes on for a while so that the tiny model sees more than a handful of "
    "tokens, which makes mean pooling and last-token pooling clearly different from each other.",
]
DISTINCT = 8
DUPLICATES = 2
REJECTED = 2


pytestmark = pytest.mark.usefixtures("prefect_harness", "shared_engine")


def write_csv(path: Path, texts: list[str], column: str = "text") -> str:
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["id", column])
        writer.writerows(enumerate(texts))
    return str(path)


def write_jsonl(path: Path, texts: list[str | None], column: str = "text") -> str:
    """JSON lines keep a real null apart from an empty string (CSV cannot)."""
    with path.open("w", encoding="utf-8") as handle:
        for i, text in enumerate(texts):
            handle.write(json.dumps({"id": i, column: text}, ensure_ascii=False) + "\n")
    return str(path)


@pytest.fixture
def run(tiny_model, tmp_path):
    """Run the embed flow against a store in tmp_path; returns (summary, flow_run_id)."""
    from flows.embed import embed_flow

    def go(inputs, **params):
        params.setdefault("layers", LAYERS)
        params.setdefault("store", str(tmp_path / "store"))
        params.setdefault("parity_sample", 4)
        state = embed_flow(input=[str(p) for p in inputs], model=tiny_model, env_file=None, return_state=True,
                           **params)
        return state.result(), state.state_details.flow_run_id

    return go


def task_runs(flow_run_id) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return sorted(r.name.rsplit("-", 1)[0] for r in runs)


def flow_logs(flow_run_id) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()  # logs reach the API in the background; wait for them
    with get_client(sync_client=True) as client:
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
    return [log.message for log in logs]


def parts(store: str) -> list[tuple[str, list[int], int]]:
    with duckdb.connect(str(Path(store) / "layertap.duckdb"), read_only=True) as con:
        return con.execute("SELECT part_id, layers, num_prompts FROM parts ORDER BY created_at, part_id").fetchall()


def test_end_to_end(run, tmp_path, tiny_model):
    from layertap import Store
    from layertap.runner.hf_runner import HfRunner

    source = write_jsonl(tmp_path / "in.jsonl", ROWS)
    summary, _ = run([source])

    assert summary["rows"] == len(ROWS)
    assert summary["new_prompts"] == DISTINCT
    assert summary["duplicates"] == DUPLICATES
    assert summary["rejected"] == REJECTED
    assert summary["planned"] == summary["embedded"] == DISTINCT
    assert summary["layers"] == [0, 2, 4]
    assert summary["dimension"] == 128
    assert summary["store"] == str(tmp_path / "store")
    assert len(summary["extraction_id"]) == 16
    # The engine computed during the extraction phase and waited at most for the rest of it.
    assert 0 < summary["engine_busy_seconds"] <= summary["extract_seconds"]
    assert 0 <= summary["engine_idle_seconds"] <= summary["extract_seconds"] - summary["engine_busy_seconds"] + 0.01

    store = Store(summary["store"])
    table = store.embeddings(layer=4)
    assert table.num_rows == DISTINCT
    assert table.schema.field("embedding").type.list_size == 128
    for text, prompt_hash in zip(table.column("text").to_pylist(), table.column("prompt_hash").to_pylist()):
        assert prompt_hash == hashlib.sha256(text.encode("utf-8")).hexdigest()

    # The stored vectors are what transformers computes for the normalised text.
    texts = table.column("text").to_pylist()
    ours = np.asarray(table.column("embedding").combine_chunks().flatten(), np.float32).reshape(len(texts), -1)
    reference = HfRunner(tiny_model, "float32").extract(texts, [4], "last").vectors[4]
    cos = (ours * reference).sum(1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(reference, axis=1))
    assert cos.min() > 0.99999


def test_a_bfloat16_run_stores_the_engine_s_values_exactly_as_float32(run, tmp_path, tiny_model):
    """A bfloat16 engine's vectors travel as 16-bit patterns and are stored as the float32 values they are:
    every stored value has an all-zero low half, and they agree with transformers in bfloat16."""
    from layertap import Store
    from layertap.runner.hf_runner import HfRunner

    source = write_jsonl(tmp_path / "in.jsonl", ROWS)
    summary, _ = run([source], dtype="bfloat16", batch_size=3)  # several batches, parity-checked on the first
    assert summary["embedded"] == DISTINCT and summary["batches"] == 3 and not summary["quarantined"]
    table = Store(summary["store"]).embeddings(layer=4)
    texts = table.column("text").to_pylist()
    ours = np.asarray(table.column("embedding").combine_chunks().flatten(), np.float32).reshape(len(texts), -1)
    assert table.schema.field("embedding").type.value_type == "float"
    assert not (ours.view(np.uint32) & 0xFFFF).any()
    reference = HfRunner(tiny_model, "bfloat16").extract(texts, [4], "last").vectors[4]
    cos = (ours * reference).sum(1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(reference, axis=1))
    assert cos.min() > 0.99


def test_float16_storage_holds_a_bfloat16_engine_s_values_exactly_in_half_the_bytes(run, tmp_path, tiny_model):
    """Stored as float16, the same bfloat16 values come back unchanged (they lie inside float16's range), as an
    extraction of their own beside the float32-stored one; readers get float16 from the store."""
    from layertap import Store

    source = write_jsonl(tmp_path / "in.jsonl", ROWS)
    wide, _ = run([source], dtype="bfloat16")
    half, _ = run([source], dtype="bfloat16", store_dtype="float16")
    assert half["embedded"] == wide["embedded"] == DISTINCT and half["extraction_id"] != wide["extraction_id"]
    store = Store(half["store"])
    listed = store.extractions().to_pydict()
    assert dict(zip(listed["extraction_id"], listed["stored_dtype"])) == {
        wide["extraction_id"]: "float32", half["extraction_id"]: "float16"}
    tables = {name: store.embeddings(layer=4, store_dtype=name) for name in ("float32", "float16")}
    assert tables["float16"].schema.field("embedding").type.value_type == "halffloat"
    assert tables["float16"]["prompt_hash"] == tables["float32"]["prompt_hash"]
    values = {name: np.asarray(t["embedding"].combine_chunks().flatten()) for name, t in tables.items()}
    assert np.array_equal(values["float16"].astype(np.float32), values["float32"])
    def vector_bytes(eid: str) -> int:
        """The layer columns' bytes before compression (split into byte planes, a bfloat16 value's two
        all-zero low bytes compress to almost nothing in float32 too)."""
        chunks = [meta.row_group(g).column(c)
                  for path in (Path(half["store"]) / "parts" / eid).glob("*.parquet")
                  for meta in [pq.ParquetFile(path).metadata]
                  for g in range(meta.num_row_groups) for c in range(meta.num_columns)]
        return sum(chunk.total_uncompressed_size for chunk in chunks if chunk.path_in_schema.startswith("layer_"))

    assert vector_bytes(half["extraction_id"]) < 0.6 * vector_bytes(wide["extraction_id"])


def test_a_batch_over_the_file_limit_is_written_as_several_files_and_read_back_whole(run, tmp_path, tiny_model,
                                                                                  monkeypatch):
    from layertap import Store
    from layertap.runner.hf_runner import HfRunner

    if encoder_threads() < 2:
        pytest.skip("one core: a batch is never split")
    monkeypatch.setenv("LAYERTAP_PART_FILE_MB", "0.001")  # 1 kB; one row of 3 layers x 128 float32 is 1.5 kB
    source = write_jsonl(tmp_path / "in.jsonl", ROWS)
    summary, _ = run([source])  # one batch of 8 prompts, parity-checked on a sample drawn across its files

    written = parts(summary["store"])
    files = min(encoder_threads(), DISTINCT)
    assert len(written) == files and summary["batches"] == 1
    assert sorted(part_id.rsplit("-", 1)[1] for part_id, _, _ in written) == sorted(map(str, range(files)))
    assert sum(n for _, _, n in written) == summary["embedded"] == DISTINCT
    table = Store(summary["store"]).embeddings(layer=4)
    texts = table.column("text").to_pylist()
    assert sorted(texts) == sorted(set(texts)) and len(texts) == DISTINCT
    ours = np.asarray(table.column("embedding").combine_chunks().flatten(), np.float32).reshape(len(texts), -1)
    reference = HfRunner(tiny_model, "float32").extract(texts, [4], "last").vectors[4]
    np.testing.assert_allclose(ours, reference, atol=1e-4)

    again, _ = run([source])
    assert again["planned"] == 0 and again["skipped"] == DISTINCT


def test_ledger_accounts_for_every_input_row(run, tmp_path):
    from layertap import Store

    summary, _ = run([write_jsonl(tmp_path / "in.jsonl", ROWS)])
    ledger = Store(summary["store"]).ledger().to_pylist()
    assert len(ledger) == len(ROWS)
    statuses = [row["status"] for row in ledger]
    assert statuses.count("embedded") == DISTINCT
    assert statuses.count("duplicate") == DUPLICATES
    assert statuses.count("rejected") == REJECTED
    assert "pending" not in statuses
    reasons = sorted(row["reason"] for row in ledger if row["status"] == "rejected")
    assert reasons == ["empty after normalisation", "null text"]
    assert summary["ledger"]["embedded"] + summary["ledger"]["duplicate"] + summary["ledger"]["rejected"] == len(
        ROWS
    )


def test_rerun_does_no_model_work(run, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", ROWS)
    first, _ = run([source])
    assert first["embedded"] == DISTINCT

    requests, started = engine_cache.runner_requests(), engine_cache.engines_started()
    second, flow_run_id = run([source])

    assert second["planned"] == second["embedded"] == 0
    assert not second["engine_busy_seconds"]  # no engine, or one that computed nothing
    assert second["new_prompts"] == 0 and second["extraction_id"] == first["extraction_id"]
    assert engine_cache.runner_requests() == requests  # no batch asked for an engine
    assert engine_cache.engines_started() == started
    ran = task_runs(flow_run_id)
    assert "extract-batch" not in ran and "validate-batch" not in ran and "publish-batch" not in ran
    assert f"nothing to extract: {DISTINCT} prompts already embedded" in flow_logs(flow_run_id)
    assert len(parts(first["store"])) == 1


def test_appended_rows_embed_only_new_prompts(run, tmp_path):
    from layertap import Store

    source = tmp_path / "in.jsonl"
    first, _ = run([write_jsonl(source, ROWS)])
    new = ["A brand new prompt.", "Another new one", "Why is the sky blue?"]  # the last one is known
    second, _ = run([write_jsonl(source, ROWS + new), write_csv(tmp_path / "more.csv", ["A brand new prompt."])])

    assert second["rows"] == len(ROWS) + len(new) + 1
    assert second["new_prompts"] == 2
    assert second["planned"] == second["embedded"] == 2
    assert Store(second["store"]).embeddings(layer=2).num_rows == DISTINCT + 2
    ledger = Store(second["store"]).ledger().to_pylist()
    assert len(ledger) == second["rows"]
    assert sum(row["status"] == "embedded" for row in ledger) == DISTINCT + 2
    assert sum(row["status"] == "duplicate" for row in ledger) == DUPLICATES + 2


def test_more_layers_extract_only_missing_ones(run, tmp_path):
    from layertap import Store

    source = write_jsonl(tmp_path / "in.jsonl", ROWS)
    first, _ = run([source], layers="0,4")
    before = Store(first["store"]).embeddings(layer=4)

    second, _ = run([source], layers="all")
    assert second["layers"] == [0, 1, 2, 3, 4]
    assert second["planned"] == second["embedded"] == DISTINCT
    assert [layers for _, layers, _ in parts(second["store"])] == [[0, 4], [1, 2, 3]]
    after = Store(second["store"]).embeddings(layer=4)
    assert after.sort_by("prompt_hash").equals(before.sort_by("prompt_hash"))  # untouched
    for layer in range(5):
        assert Store(second["store"]).embeddings(layer=layer).num_rows == DISTINCT

    third, _ = run([source], layers="1,3")
    assert third["planned"] == 0


@pytest.mark.parametrize("in_flight", [1, 3])
def test_batches_follow_batch_size(run, tmp_path, in_flight):
    """Several batches extract at once (they share the engine's steps); each still gets its own part."""
    from layertap import Store

    summary, _ = run([write_jsonl(tmp_path / "in.jsonl", ROWS)], batch_size=3, batches_in_flight=in_flight)
    assert summary["embedded"] == DISTINCT
    assert [n for _, _, n in parts(summary["store"])] and sum(n for _, _, n in parts(summary["store"])) == DISTINCT
    assert max(n for _, _, n in parts(summary["store"])) <= 3
    assert Store(summary["store"]).embeddings(layer=0).num_rows == DISTINCT


def test_no_more_batches_than_asked_are_in_flight(run, tmp_path, monkeypatch):
    """`batches_in_flight` bounds how many batches hold vectors in memory at once."""
    import threading
    import time

    import layertap.batch as extract_task

    real, lock, state = extract_task.extract_splitting, threading.Lock(), {"now": 0, "most": 0}

    def counted(*args, **kwargs):
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
        try:
            time.sleep(0.3)  # a slow engine: every batch the flow allows overlaps the others
            return real(*args, **kwargs)
        finally:
            with lock:
                state["now"] -= 1

    monkeypatch.setattr(extract_task, "extract_splitting", counted)
    summary, _ = run([write_jsonl(tmp_path / "in.jsonl", ROWS)], batch_size=2, batches_in_flight=2)
    assert summary["embedded"] == DISTINCT
    assert state["most"] == 2


def record_flow_steps(monkeypatch, events: list, publish_delay: float = 0.0) -> None:
    """Record, in order, each batch's submission to the engine, the submission of its part's checks, and the
    publications (one event per publish task run, naming its batches); optionally make publishing slow."""
    import flows.pipeline as pipeline
    from layertap.store.store_db import StoreDB

    class Recorded:
        def __init__(self, name, task):
            self.name, self.task = name, task

        def submit(self, store, *args, **kwargs):
            if self.name == "publish":
                events.append(("publish", tuple(part.batch_id for part in args[0].unquote())))
            else:
                batch = args[1] if self.name == "submit" else args[0].unquote()  # parts are quoted
                events.append((self.name, batch.batch_id))
            return self.task.submit(store, *args, **kwargs)

        def with_options(self, **options):
            return self.task.with_options(**options)

    real_publish = StoreDB.publish

    def slow_publish(self, publications):
        time.sleep(publish_delay)  # the fault: a store that answers slowly
        return real_publish(self, publications)

    monkeypatch.setattr(pipeline, "extract_batch", Recorded("submit", pipeline.extract_batch))
    monkeypatch.setattr(pipeline, "validate_batch", Recorded("validate", pipeline.validate_batch))
    monkeypatch.setattr(pipeline, "publish_batches", Recorded("publish", pipeline.publish_batches))
    monkeypatch.setattr(StoreDB, "publish", slow_publish)


def test_the_next_batch_is_submitted_before_the_last_one_is_published(run, tmp_path, monkeypatch):
    """The engine is handed the next batch as soon as a slot frees, before the finished batch is checked
    or published; parts are published once each, in batch order, each after its checks."""
    events = []
    record_flow_steps(monkeypatch, events)
    summary, _ = run([write_jsonl(tmp_path / "in.jsonl", ROWS)], batch_size=2, batches_in_flight=1)
    assert summary["embedded"] == DISTINCT and summary["batches"] == 4
    ids = list(dict.fromkeys(batch_id for name, batch_id in events if name == "submit"))
    assert len(ids) == 4
    position = {event: i for i, event in enumerate(events) if event[0] != "publish"}
    published = [(i, batch_id) for i, (name, group) in enumerate(events) if name == "publish" for batch_id in group]
    assert [batch_id for _, batch_id in published] == ids
    for i, batch_id in published:
        assert position[("validate", batch_id)] < i
    for before, after in zip(ids, ids[1:]):
        assert position[("submit", after)] < position[("validate", before)]


def test_parts_waiting_to_be_published_go_in_one_transaction(run, tmp_path, monkeypatch):
    """While a publication is slow, the engine goes on: the parts that finish meanwhile are published
    together, in batch order, each once; the run's counts and the store are as with one part at a time."""
    events = []
    record_flow_steps(monkeypatch, events, publish_delay=1.0)
    summary, _ = run([write_jsonl(tmp_path / "in.jsonl", ROWS)], batch_size=1, batches_in_flight=2)
    assert summary["embedded"] == DISTINCT and summary["batches"] == DISTINCT
    groups = [group for name, group in events if name == "publish"]
    ids = list(dict.fromkeys(batch_id for name, batch_id in events if name == "submit"))
    assert [batch_id for group in groups for batch_id in group] == ids
    assert max(len(group) for group in groups) >= 2 and len(groups) < DISTINCT
    assert len(parts(summary["store"])) == DISTINCT
    assert summary["ledger"]["embedded"] == DISTINCT


def test_a_part_damaged_on_disk_is_quarantined_and_nothing_after_it_is_published(run, tmp_path, monkeypatch):
    """Checks run beside publication, yet publication stays in batch order: the damaged second part stops the
    run with the check that failed, the first stays published, no later part is; a rerun completes."""
    import layertap.batch as extract_task

    real_write, written = extract_task.write_batch_files, []

    def damaging_write(store, *args, **kwargs):
        files = real_write(store, *args, **kwargs)
        written.append(files)
        if len(written) == 2:  # the fault: the second batch's file loses its footer on disk
            with open(Path(store) / files[0]["relpath"], "r+b") as handle:
                handle.seek(-16, os.SEEK_END)
                handle.write(b"\0" * 16)
        return files

    monkeypatch.setattr(extract_task, "write_batch_files", damaging_write)
    source = write_jsonl(tmp_path / "in.jsonl", ROWS)
    with pytest.raises(CheckFailed, match="not published: check 'readable'"):
        run([source], batch_size=2, batches_in_flight=1)
    store = str(tmp_path / "store")
    assert [part_id for part_id, _, _ in parts(store)] == [written[0][0]["part_id"]]
    assert [p.stem for p in (Path(store) / "quarantine").rglob("*.parquet")] == [written[1][0]["part_id"]]

    monkeypatch.setattr(extract_task, "write_batch_files", real_write)
    summary, _ = run([source], batch_size=2, batches_in_flight=1)
    assert summary["embedded"] + summary["skipped"] == DISTINCT and len(parts(store)) == 4


def test_mean_pooling_and_period_rules_are_separate_extractions(run, tmp_path, tiny_model):
    from layertap import Store
    from layertap.runner.hf_runner import HfRunner

    source = write_csv(tmp_path / "in.csv", ["Hello world.", "Hello world", "Good night..."])
    last, _ = run([source])
    mean, _ = run([source], pooling="mean", remove_period=True)
    assert mean["extraction_id"] != last["extraction_id"]
    assert last["embedded"] == 3
    assert mean["embedded"] == 2  # "Hello world." and "Hello world" are one prompt without the period
    table = Store(mean["store"]).embeddings(layer=2, pooling="mean")
    texts = sorted(table.column("text").to_pylist())
    assert texts == ["Good night", "Hello world"]
    table = table.sort_by("text")
    ours = np.asarray(table.column("embedding").combine_chunks().flatten(), np.float32).reshape(2, -1)
    reference = HfRunner(tiny_model, "float32").extract(texts, [2], "mean").vectors[2]
    np.testing.assert_allclose(ours, reference, atol=1e-4)


@pytest.mark.parametrize("file_mb", [None, "0.001"], ids=["one-file", "several-files"])
def test_failed_validation_publishes_nothing(run, tmp_path, tiny_model, monkeypatch, file_mb):
    """A broken engine output (NaN) fails the named check, is quarantined (every file of the batch), and a
    later run recovers."""
    from layertap import Store
    from layertap.settings import load_settings

    if file_mb:
        monkeypatch.setenv("LAYERTAP_PART_FILE_MB", file_mb)

    source = write_jsonl(tmp_path / "in.jsonl", ROWS)
    runner = engine_cache.get_runner(load_settings(env_file=None, model=tiny_model))
    real_extract = runner.extract

    def broken(texts, layers, pooling, **options):
        result = real_extract(texts, layers, pooling, **options)
        result.vectors[layers[-1]][0, :] = np.nan
        return result

    monkeypatch.setattr(runner, "extract", broken)
    with pytest.raises(CheckFailed, match="check 'finite'"):
        run([source])
    store = str(tmp_path / "store")
    assert parts(store) == []
    moved = list((Path(store) / "quarantine").rglob("*.parquet"))
    assert len(moved) == (min(encoder_threads(), DISTINCT) if file_mb else 1)
    assert not list((Path(store) / "parts").rglob("*.parquet"))
    assert {row["status"] for row in Store(store).ledger().to_pylist()} <= {"pending", "duplicate", "rejected"}

    monkeypatch.setattr(runner, "extract", real_extract)
    summary, _ = run([source])  # the cached extraction points at quarantined files: extracted again
    assert summary["embedded"] == DISTINCT
    assert len(parts(store)) == len(moved)


def test_batch_cache_key_is_tied_to_store_and_batch():
    from dataclasses import replace

    from layertap.store.plan import WorkBatch
    from tasks.extract import batch_cache_key

    batch = WorkBatch(batch_id="b", extraction_id="e" * 16, layers=[0, 2], prompt_hashes_digest="d" * 64,
                      num_prompts=1)
    key = batch_cache_key(None, {"store_uuid": "u1", "batch": batch})
    assert key == batch_cache_key(None, {"store_uuid": "u1", "batch": replace(batch, layers=[2, 0])})
    assert key != batch_cache_key(None, {"store_uuid": "u2", "batch": batch})
    assert key != batch_cache_key(None, {"store_uuid": "u1", "batch": replace(batch, layers=[0])})
    assert key != batch_cache_key(None, {"store_uuid": "u1", "batch": replace(batch, prompt_hashes_digest="x")})
    assert key == batch_cache_key(None, {"store_uuid": "u1", "batch": replace(batch, batch_id="b2", num_prompts=2)})


def test_prompts_the_engine_refuses_are_rejected_once(run, tmp_path):
    """Longer than the model allows: recorded with the engine's reason, never planned again."""
    from layertap import Store

    long_text = "word " * 1000  # 5000 bytes -> 5001 tokens with the byte-level tokenizer; the limit is 4096
    source = write_jsonl(tmp_path / "in.jsonl", ["short one", long_text, "short two", long_text])
    first, _ = run([source])
    assert first["planned"] == 3 and first["embedded"] == 2
    assert first["refused"] == 1 and first["rejected"] == 0
    ledger = Store(first["store"]).ledger().to_pylist()
    assert [row["status"] for row in ledger] == ["embedded", "rejected", "embedded", "rejected"]
    assert ledger[1]["reason"].startswith("too long") and ledger[3]["reason"] == ledger[1]["reason"]

    second, _ = run([source])
    assert second["planned"] == 0


def test_extract_batch_is_a_cache_hit_for_the_same_store_only(tiny_model, tmp_path):
    """Re-running a done batch reuses its part; the same batch in a fresh store is extracted anew."""
    from prefect import flow

    from layertap.prepared_run import prepare_run
    from layertap.settings import load_settings
    from tasks import extract_batch, ingest, normalise, plan, register_extraction

    source = write_jsonl(tmp_path / "in.jsonl", ["one prompt", "another prompt"])
    run = prepare_run(load_settings(env_file=None, model=tiny_model, layers=[1], batch_size=16))

    @flow
    def extract_twice(store: str) -> tuple:
        ingest(store, [source], "text")
        normalise(store, False)
        store_uuid = register_extraction(store, run)
        (batch,) = plan(store, run)
        first = extract_batch(store, store_uuid, batch, run, return_state=True)
        requests = engine_cache.runner_requests()
        second = extract_batch(store, store_uuid, batch, run, return_state=True)
        return first.name, second.name, engine_cache.runner_requests() - requests, first.result(), second.result()

    first, second, asked, part, cached = extract_twice(str(tmp_path / "a"))
    assert (first, second, asked) == ("Completed", "Cached", 0)
    (file,) = part.files
    assert cached == part and (tmp_path / "a" / file.relpath).is_file()

    first, _, _, other, _ = extract_twice(str(tmp_path / "b"))  # same batch, another store
    assert first == "Completed" and other.part_id == part.part_id
    assert (tmp_path / "b" / other.files[0].relpath).is_file()


@pytest.mark.parametrize("placement", [{"engine_process": True}, {"engine_process": True, "runner_process": True}],
                         ids=["engine-core-apart", "runner-and-engine-core-apart"])
def test_an_engine_in_processes_of_its_own_stores_the_same_vectors(placement, run, tmp_path):
    """engine_process=True: vLLM's engine core in a child process, vectors through shared buffers;
    runner_process=True too (the default on a GPU): the runner in a child of its own, the core in a
    grandchild, and the flow's process reads the vectors from the buffers the core filled."""
    from layertap import Store

    source = write_jsonl(tmp_path / "in.jsonl", ROWS)
    inline, _ = run([source], store=str(tmp_path / "inline"))
    separate, _ = run([source], store=str(tmp_path / "separate"), **placement)
    assert separate["embedded"] == inline["embedded"] == DISTINCT
    for layer in (0, 2, 4):
        tables = [Store(s["store"]).embeddings(layer=layer).sort_by("prompt_hash") for s in (inline, separate)]
        assert tables[0].column("prompt_hash").equals(tables[1].column("prompt_hash"))
        vectors = [np.asarray(t.column("embedding").combine_chunks().flatten()) for t in tables]
        assert np.abs(vectors[0] - vectors[1]).max() <= 1e-5, layer
