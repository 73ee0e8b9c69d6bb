"""Faults injected at the engine boundary of a real run: retried, split, restarted or quarantined, and the
rest of the run still completes."""

from __future__ import annotations

import logging

import pytest
from task_runs import extract_run_counts

from layertap import faults, progress
from layertap.runner import engine_cache

pytestmark = pytest.mark.usefixtures("prefect_harness", "shared_engine")

TEXTS = [f"prompt number {i} about rivers and clocks" for i in range(12)]


@pytest.fixture(autouse=True)
def fresh_fault_counters():
    faults.reset()
    yield
    faults.reset()


@pytest.fixture
def run(tiny_model, tmp_path):
    from flows.embed import embed_flow

    source = tmp_path / "in.csv"
    source.write_text("text\n" + "".join(f"{t}\n" for t in TEXTS))

    def go(**params):
        params.setdefault("batch_size", 4)
        params.setdefault("layers", "0,-1")
        state = embed_flow(input=[str(source)], model=tiny_model, store=str(tmp_path / "store"),
                           parity_sample=2, env_file=None, return_state=True, **params)
        return state.result(), state.state_details.flow_run_id

    return go


def run_logs(flow_run_id) -> list[str]:
    """The flow run's log messages as the Prefect UI shows them (written by Prefect's API log handler)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=30)
    with get_client(sync_client=True) as client:
        return [log.message for log in client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))]


def statuses(store) -> list[tuple[str, str | None]]:
    from layertap import Store

    return [(row["status"], row["reason"]) for row in Store(store).ledger().to_pylist()]


def test_a_failing_batch_is_retried_with_backoff(run, tmp_path, monkeypatch):
    run(layers="1")  # the engine is up before counting
    started = engine_cache.engines_started()
    monkeypatch.setenv(faults.ENV, "extract:error*2")  # the first two attempts fail, the third works
    summary, flow_run_id = run()
    assert summary["embedded"] == len(TEXTS) and not summary["quarantined"]
    counts = extract_run_counts(flow_run_id)  # batches run concurrently: either may take the failures
    assert len(counts) == 3 and sum(count - 1 for count in counts) == 2
    assert engine_cache.engines_started() == started  # the engine still answered: not restarted
    assert statuses(tmp_path / "store") == [("embedded", None)] * len(TEXTS)


def test_out_of_memory_splits_the_batch(run, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(faults.ENV, "extract:oom>1")  # only single prompts fit
    with caplog.at_level(logging.WARNING, logger="layertap.runner.split_on_oom"):
        summary, flow_run_id = run()
    assert summary["embedded"] == len(TEXTS) and not summary["quarantined"]
    assert extract_run_counts(flow_run_id) == [1, 1, 1]  # split inside the attempt, not retried
    assert sum("out of memory on 4 prompts: retrying as 2 + 2" in m for m in caplog.messages) == 3
    assert sum("out of memory on 4 prompts: retrying as 2 + 2" in m for m in run_logs(flow_run_id)) == 3
    from layertap import Store

    assert Store(tmp_path / "store").embeddings(layer=-1).num_rows == len(TEXTS)


def test_a_dead_engine_is_restarted(run, tmp_path, monkeypatch):
    monkeypatch.setenv(faults.ENV, "extract:die@2")  # the engine dies during the second batch
    started = engine_cache.engines_started()
    summary, flow_run_id = run()
    assert summary["embedded"] == len(TEXTS) and not summary["quarantined"]
    assert engine_cache.engines_started() == started + 1 + (started == 0)
    counts = extract_run_counts(flow_run_id)  # batches in flight on the dead engine are retried too
    assert len(counts) == 3 and counts[-1] == 2 and max(counts) == 2


def test_a_batch_that_keeps_failing_is_quarantined_and_the_rest_completes(run, tmp_path, monkeypatch):
    monkeypatch.setenv(faults.ENV, f"extract:poison={TEXTS[5]}")
    summary, flow_run_id = run()
    assert [q["prompts"] for q in summary["quarantined"]] == [4]
    assert "InjectedFault" in summary["quarantined"][0]["error"]
    assert summary["embedded"] == len(TEXTS) - 4
    counts = extract_run_counts(flow_run_id)  # batches run concurrently: either may take the failures
    assert len(counts) == 3 and sum(count - 1 for count in counts) == 2
    ledger = statuses(tmp_path / "store")
    assert [s for s, _ in ledger].count("quarantined") == 4 and [s for s, _ in ledger].count("embedded") == 8
    assert all("InjectedFault" in reason for status, reason in ledger if status == "quarantined")
    assert summary["ledger"]["quarantined"] == 4 and summary["ledger"]["pending"] == 0

    monkeypatch.delenv(faults.ENV)
    again, _ = run()  # the cause is gone: the quarantined batch is tried again and published
    assert again["planned"] == again["embedded"] == 4 and not again["quarantined"]
    assert statuses(tmp_path / "store") == [("embedded", None)] * len(TEXTS)


def test_progress_ends_with_every_batch_done_when_the_last_to_finish_is_quarantined(run, monkeypatch):
    monkeypatch.setenv(faults.ENV, f"extract:poison={TEXTS[5]}")
    seen = []
    with progress.listen(seen.append):
        summary, _ = run(batch_size=len(TEXTS))  # one batch, which fails every attempt
    assert [q["prompts"] for q in summary["quarantined"]] == [len(TEXTS)]
    assert (seen[-1].batches_done, seen[-1].batches_total, seen[-1].prompts_done) == (1, 1, len(TEXTS))


def test_a_run_whose_batches_all_fail_stops(run, monkeypatch):
    from layertap.errors import EngineError

    monkeypatch.setenv(faults.ENV, "extract:error")
    with pytest.raises(EngineError, match="the first 3 batches all failed"):
        run(batch_size=3)


def test_a_full_disk_stops_the_run_at_once_with_one_line(run, tmp_path, monkeypatch):
    """No space left while a part is written: not retried, nothing quarantined, one line naming the cause;
    the next run, with room again, embeds everything."""
    from layertap.errors import StoreUnwritable
    from layertap.store.registry import read_status

    monkeypatch.setenv(faults.ENV, "write.row-group:oserror=ENOSPC")
    with pytest.raises(StoreUnwritable, match=r"store .*store: No space left on device .*free space or make it"):
        run(batch_size=12)
    assert faults._counts == {("write.row-group", "oserror=ENOSPC"): 1}  # the batch was not retried
    assert read_status(tmp_path / "store")["runs"][0]["status"] == "failed"
    assert not [s for s, _ in statuses(tmp_path / "store") if s == "quarantined"]
    monkeypatch.delenv(faults.ENV)
    summary, _ = run(batch_size=12)
    assert summary["embedded"] == len(TEXTS) and not summary["quarantined"]


def test_a_run_that_cannot_fit_is_refused_with_the_numbers(run, tmp_path, monkeypatch):
    """Before extracting, the run's output (prompts x layers x width x bytes) is checked against free space."""
    from collections import namedtuple

    from layertap.store import disk_space
    from layertap.errors import StoreUnwritable

    requests = engine_cache.runner_requests()
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(disk_space.shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 4000, 4000))
    # 12 prompts x 2 layers x 128 values x 4 bytes = 12,288 bytes > 4,000 free
    with pytest.raises(StoreUnwritable, match=r"0\.00 GB free, but this run writes up to 0\.00 GB \(24 vectors "
                                              r"\(prompt x layer\) x 128 values x 4 bytes\)"):
        run()
    assert engine_cache.runner_requests() == requests  # no batch asked for the engine


def model_copy(tiny_model, tmp_path, drop: str | None = None):
    """A copy of the tiny model (an engine of its own), less its weight or tokenizer files."""
    import shutil

    model = tmp_path / "model-copy"
    shutil.copytree(tiny_model, model)
    for path in model.iterdir():
        weights = path.suffix == ".safetensors"
        tokenizer = path.name.startswith("tokenizer") or path.name == "special_tokens_map.json"
        if drop == "weights" and weights or drop == "tokenizer" and tokenizer:
            path.unlink()
    return model


@pytest.mark.parametrize("missing", ["folder", "weights", "tokenizer"])
def test_a_missing_model_fails_once_with_one_line_naming_it(missing, tiny_model, tmp_path):
    """Refused before any batch: no engine start, no retry, no "first batches failed"."""
    from flows.embed import embed_flow
    from layertap.errors import ModelUnusable

    model = tmp_path / "nowhere" if missing == "folder" else model_copy(tiny_model, tmp_path, drop=missing)
    source = tmp_path / "in.csv"
    source.write_text("text\n" + "".join(f"{t}\n" for t in TEXTS))
    requests = engine_cache.runner_requests()
    state = embed_flow(input=[str(source)], model=str(model), store=str(tmp_path / "store"), env_file=None,
                       return_state=True)
    expected = {"folder": r"is not a folder \(it does not exist\)", "weights": r"has no weight files \(\*\.safetensors",
                "tokenizer": r"has no tokenizer \(tokenizer\.json"}[missing]
    with pytest.raises(ModelUnusable, match=rf"^model: {model} {expected}") as raised:
        state.result()
    assert "\n" not in str(raised.value) and "batches" not in str(raised.value)
    assert extract_run_counts(state.state_details.flow_run_id) == []
    assert engine_cache.runner_requests() == requests
    assert not (tmp_path / "store").exists()


def test_a_model_that_vanishes_as_its_engine_starts_is_not_retried(tiny_model, tmp_path, monkeypatch):
    """The folder checked out, then lost its weights as the engine started: the engine's failure is reported
    as the model's, once; the batch is neither retried nor quarantined, and the run is recorded as failed."""
    from layertap.errors import ModelUnusable
    from layertap.store.registry import read_status

    model = model_copy(tiny_model, tmp_path)
    start_early = engine_cache.start_early

    def weights_vanish(settings):
        for path in model.glob("*.safetensors"):
            path.unlink()
        return start_early(settings)

    monkeypatch.setattr(engine_cache, "start_early", weights_vanish)
    source = tmp_path / "in.csv"
    source.write_text("text\n" + "".join(f"{t}\n" for t in TEXTS))
    from flows.embed import embed_flow

    state = embed_flow(input=[str(source)], model=str(model), store=str(tmp_path / "store"), layers="0,-1",
                       batch_size=len(TEXTS), parity_sample=0, env_file=None, return_state=True)
    with pytest.raises(ModelUnusable, match=rf"^model: {model} has no weight files"):
        state.result()
    assert extract_run_counts(state.state_details.flow_run_id) == [1]  # one attempt, no retries
    logs = run_logs(state.state_details.flow_run_id)
    assert not [line for line in logs if "batches all failed" in line or "quarantined batch" in line], logs
    [last] = read_status(tmp_path / "store", last_runs=1)["runs"]
    assert last["status"] == "failed" and "has no weight files" in last["summary"]["error"]
    assert not [s for s, _ in statuses(tmp_path / "store") if s == "quarantined"]
