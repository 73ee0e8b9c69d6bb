"""SIGKILL at twenty points of a 2,000-row run, each kill followed by a rerun; at the end the store holds
exactly one result per (prompt, layer), no stray files, and a ledger that accounts for every input row.

The killed processes run the Prefect flow as users do, `layertap run` (the embed flow in-process), on the
tiny model with the real vLLM engine. They report to the suite's Prefect test server: a temporary local API
of their own would cost every child a server start, and the store's safety does not depend on which server
records the runs. Each rerun is itself killed at the next point, so the run gets further every time; points
are ordered along the run, so the first eight need no engine. Every child gets the same private Prefect
home. The runs attach to one warm engine, as deployment runs do: the first run with rows to embed starts it
in a process of its own, which outlives each killed run (and hands back what a dead run held), so the runs
do not each start vLLM. It runs eagerly: compiling adds seconds and nothing to what is checked here.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import duckdb

from layertap.runner import warm_engine
from layertap.store.normalise import NormaliseRules, prompt_hash
from layertap.store.registry import read_status

ROOT = Path(__file__).resolve().parents[1]
ROWS = 2000
LAYERS = [0, 2, 4]

# (point, n): SIGKILL the n-th time the point is reached in that process.
KILLS = [
    ("store-lock.acquired", 1),     # holding the store's lock, nothing written
    ("ingest.before-commit", 2),    # second input file inside its transaction (the first is committed)
    ("ingest.committed", 1),
    ("normalise.before-commit", 1),
    ("normalise.committed", 1),
    ("register.committed", 1),
    ("plan.before-commit", 1),
    ("plan.committed", 1),
    ("extract", 1),                 # engine started, at the engine boundary of the first batch
    ("extract.returned", 2),        # a second batch computed, not written
    ("write.row-group", 1),         # a Parquet file without its footer in staging/
    ("write.before-fsync", 1),
    ("write.before-rename", 1),
    ("write.renamed", 1),           # a whole part in parts/, not in the manifest
    ("validate-batch.checked", 1),  # a part checked, not yet published
    ("publish.before-commit", 1),   # manifest rows inserted, transaction open
    ("publish.committed", 1),
    ("sweep", 2),                   # the end-of-run sweep (the plan's is the first): every batch published
    ("validate-store.counted", 1),  # leftovers removed, the ledger counted but not checked
    ("run.finished", 1),            # the run recorded as completed, the summary not yet printed
]


def texts() -> tuple[list[str | None], list[str | None]]:
    """1,000 CSV rows and 1,000 JSON lines, with duplicates across files and a few empty rows."""
    def text(i: int) -> str:
        return "" if i % 97 == 0 else f"crash test prompt {i % 1600} " + "word " * (i % 7)
    return [text(i) for i in range(ROWS // 2)], [text(i) for i in range(ROWS // 2, ROWS)]


def write_inputs(folder: Path) -> list[str]:
    csv_rows, json_rows = texts()
    (folder / "a.csv").write_text("text\n" + "".join(f"{t}\n" if t else '""\n' for t in csv_rows))
    (folder / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in json_rows))
    return [str(folder / "a.csv"), str(folder / "b.jsonl")]


def run_flow(inputs, store, model, folder: Path, engines: str, kill: str | None,
             api: str) -> subprocess.CompletedProcess:
    """`layertap run` in a child process with a session of its own, reporting to the Prefect API at `api`
    and attached to the warm engine in `engines`; what is left of that session when the child ends is killed
    too (the warm engine has a session of its own). Output goes to files: a process the killed run left
    behind would hold pipes open."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LAYERTAP_", "PREFECT_"))}
    env.update(PYTHONPATH=str(ROOT), PREFECT_HOME=str(folder / "prefect"), PREFECT_API_URL=api,
               VLLM_LOGGING_LEVEL="WARNING", PREFECT_SERVER_ANALYTICS_ENABLED="false",
               LAYERTAP_ENGINE_DIR=engines)
    if kill:
        env["LAYERTAP_FAULTS"] = kill
    command = [sys.executable, "-m", "flows.cli", "run", "--input", *inputs, "--store", str(store),
               "--model", model, "--layers", ",".join(map(str, LAYERS)), "--batch-size", "100",
               "--max-model-len", "256", "--max-num-batched-tokens", "2048", "--enforce-eager", "--warm-engine",
               "--env-file", "", "--json"]
    with open(folder / "stdout", "w+") as stdout, open(folder / "stderr", "w+") as stderr:
        child = subprocess.Popen(command, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=stdout,
                                 stderr=stderr, start_new_session=True)
        try:
            child.wait(timeout=300)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()
        stdout.seek(0)
        stderr.seek(0)
        return subprocess.CompletedProcess(command, child.returncode, stdout.read(), stderr.read())


def test_sigkill_at_twenty_points_loses_nothing(tmp_path, tiny_model, prefect_harness):
    from prefect.settings import PREFECT_API_URL

    from layertap import Store
    from layertap.parts.checks import check_part

    api = PREFECT_API_URL.value()

    assert len({point for point, _ in KILLS}) == 20
    inputs = write_inputs(tmp_path)
    store = tmp_path / "store"
    engines = tempfile.mkdtemp(prefix="lt-crash-")  # short: the engine's socket lives there
    took = []
    try:
        for point, n in KILLS:
            started = time.monotonic()
            out = run_flow(inputs, store, tiny_model, tmp_path, engines, f"{point}:kill@{n}", api)
            took.append(f"{point}@{n} {time.monotonic() - started:.0f}s")
            assert out.returncode == -signal.SIGKILL, f"not killed at {point}@{n}: {out.stderr[-3000:]}"
        final = run_flow(inputs, store, tiny_model, tmp_path, engines, None, api)
        assert final.returncode == 0, final.stderr[-3000:]
        print("runs:", ", ".join(took))
        with open(os.path.join(engines, warm_engine.STARTS_LOG)) as starts:
            assert len(starts.readlines()) == 1  # one engine served every run
    finally:
        warm_engine.stop_engines(engines)

    # What the store must hold, worked out independently of it.
    rules = NormaliseRules()
    all_texts = [t for rows in texts() for t in rows]
    normalised = [rules.apply(t) for t in all_texts]
    prompts = {prompt_hash(t) for t in normalised if t}
    empty = sum(not t for t in normalised)

    # Every killed run that had recorded itself is marked crashed; none is left running.
    statuses = [run["status"] for run in read_status(store, last_runs=100)["runs"]]
    assert "running" not in statuses and "crashed" in statuses and statuses[0] == "completed"

    counts = json.loads(final.stdout)["ledger"]
    assert counts["rows"] == ROWS
    assert (counts["embedded"], counts["duplicate"], counts["rejected"]) == (len(prompts), ROWS - len(prompts) - empty,
                                                                            empty)
    assert counts["pending"] == counts["quarantined"] == 0
    ledger = Store(store).ledger().to_pylist()
    assert len({(r["source"], r["row_number"]) for r in ledger}) == ROWS

    for layer in LAYERS:
        hashes = Store(store).embeddings(layer=layer).column("prompt_hash").to_pylist()
        assert len(hashes) == len(set(hashes)) == len(prompts) and set(hashes) == prompts

    with duckdb.connect(str(store / "layertap.duckdb"), read_only=True) as con:
        dupes = con.execute(
            """SELECT count(*) FROM (
                   SELECT prompt_hash, layer, count(*) AS n
                   FROM (SELECT pp.prompt_hash, unnest(p.layers) AS layer
                         FROM part_prompts pp JOIN parts p USING (part_id))
                   GROUP BY ALL HAVING n > 1)"""
        ).fetchone()[0]
        published = con.execute("SELECT part_id, path, layers FROM parts").fetchall()
        members = dict(con.execute("SELECT part_id, list(prompt_hash) FROM part_prompts GROUP BY part_id").fetchall())
    assert dupes == 0
    on_disk = {p.relative_to(store).as_posix() for p in (store / "parts").rglob("*") if p.is_file()}
    assert on_disk == {path for _, path, _ in published}  # no orphan, no partial file
    assert not [p for p in (store / "staging").rglob("*") if p.is_file()]
    for part_id, path, layers in published:  # every published part still passes validation
        check_part(str(store / path), members[part_id], list(layers), 128)
