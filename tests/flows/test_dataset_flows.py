"""embed-dataset and embed-registered: real Prefect (test harness), real DuckDB, the suite's shared engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from layertap import progress
from flows.cli import main

pytestmark = pytest.mark.usefixtures("prefect_harness", "shared_engine")


def write(path: Path, *texts: str) -> str:
    path.write_text("text\n" + "".join(f"{t}\n" for t in texts))
    return str(path)


def add(store: Path, dataset: str, *files: str, **options: str) -> None:
    args = ["add", "--dataset", dataset, "--store", str(store), "--no-event", "--input", *files]
    for name, value in options.items():
        args += [f"--{name.replace('_', '-')}", value]
    assert main(args) == 0


def artifacts(flow_run_id) -> dict:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    return {a.type: a for a in found}


def test_dataset_flow_embeds_only_its_rows_then_only_new_ones(tmp_path, tiny_model):
    from flows.embed_dataset import embed_dataset_flow
    from layertap import Store

    store = tmp_path / "store"
    add(store, "news", write(tmp_path / "news.csv", "rain today", "sun tomorrow", "rain today", '""'),
        model=tiny_model, layers="0,-1")
    add(store, "mail", write(tmp_path / "mail.csv", "hello bob", "sun tomorrow"), model=tiny_model, layers="1")

    seen: list[progress.Progress] = []
    with progress.listen(seen.append):
        state = embed_dataset_flow("news", str(store), None, {"parity_sample": 2, "batch_size": 1}, return_state=True)
    first = state.result()
    assert (first["rows"], first["new_rows"], first["embedded"], first["skipped"]) == (4, 4, 2, 0)
    assert first["layers"] == [0, 4] and first["dataset"] == "news"
    # Reported as parts are published (parts checked together are published together), never backwards.
    reported = [(p.batches_done, p.prompts_done) for p in seen]
    assert reported == sorted(set(reported)) and reported[-1] == (2, 2) and seen[-1].fraction == 1.0
    with pytest.raises(Exception, match="layer 1 has no results"):
        Store(store).embeddings(layer=1)  # mail's settings: not run yet

    shown = artifacts(state.state_details.flow_run_id)
    table = {row["count"]: row["value"] for row in json.loads(shown["table"].data)}
    assert (table["input rows"], table["embedded"], table["duplicates"], table["rejected"]) == (4, 2, 1, 1)
    assert "2 prompts embedded for dataset `news`" in shown["markdown"].data
    assert shown["progress"].data == 100.0 and shown["progress"].key == "layertap-progress-news"

    add(store, "news", write(tmp_path / "more.csv", "snow soon", "rain today"))
    second = embed_dataset_flow("news", str(store), None, {"parity_sample": 0})
    assert (second["rows"], second["new_rows"], second["embedded"], second["skipped"]) == (6, 2, 1, 2)
    assert Store(store).embeddings(layer=-1).num_rows == 3


def test_dataset_flow_refuses_run_options_that_belong_to_the_dataset(tmp_path, tiny_model):
    from flows.embed_dataset import embed_dataset_flow
    from layertap.errors import InputError

    store = tmp_path / "store"
    add(store, "news", write(tmp_path / "news.csv", "rain today"), model=tiny_model)
    with pytest.raises(InputError, match="layers: fixed by dataset news"):
        embed_dataset_flow("news", str(store), None, {"layers": "0"})
    with pytest.raises(Exception, match="no dataset 'other'"):
        embed_dataset_flow("other", str(store), None)


def test_registered_flow_runs_every_dataset_and_reports_failures(tmp_path, tiny_model):
    from flows.embed_registered import embed_registered_flow
    from layertap.store.registry import read_status

    store = tmp_path / "store"
    add(store, "news", write(tmp_path / "news.csv", "rain today", "sun tomorrow"), model=tiny_model, layers="0")
    mail = write(tmp_path / "mail.csv", "hello bob")
    add(store, "mail", mail, model=tiny_model, layers="2")

    results = embed_registered_flow(str(store), None)
    assert {name: r["embedded"] for name, r in results.items()} == {"mail": 1, "news": 2}
    assert {name: r["embedded"] for name, r in embed_registered_flow(str(store), None).items()} == {"mail": 0, "news": 0}

    Path(mail).unlink()
    with pytest.raises(RuntimeError, match="1 of 2 datasets failed: mail"):
        embed_registered_flow(str(store), None)
    runs = read_status(store, last_runs=10)["runs"]
    # A dataset whose files fail the checks is refused before it starts: nothing of it enters the store.
    assert len(runs) == 5 and {r["status"] for r in runs} == {"completed"}
    assert runs[0]["dataset"] == "news"
