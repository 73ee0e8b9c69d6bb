"""SIGKILL at twenty points of a 2,000-row run, each kill followed by a rerun; at the end the store holds
exactly one result per (prompt, layer), no stray files, and a ledger that accounts for every input row.

The killed processes run the library pipeline (`python -m layertap.pipeline`) on the tiny model with the
real vLLM engine. Kill points are ordered along the run, so each rerun gets further than the last before
it is killed in turn; those before extraction and those a rerun reaches by resuming a written part cost
no engine start.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import duckdb

from layertap.normalise import NormaliseRules, prompt_hash

ROOT = Path(__file__).resolve().parents[1]
ROWS = 2000
LAYERS = [0, 2, 4]

# (point, n): SIGKILL the n-th time the point is reached in that process.
KILLS = [
    ("pipeline.locked", 1),        # holding the lock, nothing written
    ("ingest.before-commit", 2),   # second input file inside its transaction (the first is committed)
    ("ingest.committed", 1),
    ("normalise.before-commit", 1),
    ("normalise.committed", 1),
    ("register.committed", 1),
    ("plan.before-commit", 1),
    ("plan.committed", 1),
    ("extract", 1),                # engine started, at the engine boundary of the first batch
    ("extract.returned", 2),       # first batch published, second computed but not written
    ("write.row-group", 1),        # a Parquet file without its footer in staging/
    ("write.before-fsync", 1),
    ("write.before-rename", 1),
    ("write.renamed", 1),          # a whole part in parts/, not in the manifest
    ("resume", 1),                 # that part found and checked, not published
    ("publish.before-commit", 1),  # manifest rows inserted, transaction open
    ("publish.committed", 1),
    ("sweep", 1),                  # every batch published, leftovers not yet removed
    ("ledger", 1),
    ("finish", 1),
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


def run_pipeline(inputs, store, model, kill: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAYERTAP_")}
    env.update(PYTHONPATH=str(ROOT), VLLM_LOGGING_LEVEL="WARNING", LAYERTAP_INPUT=",".join(inputs),
               LAYERTAP_STORE=str(store), LAYERTAP_MODEL=model, LAYERTAP_LAYERS=",".join(map(str, LAYERS)),
               LAYERTAP_BATCH_SIZE="100", LAYERTAP_MAX_MODEL_LEN="256", LAYERTAP_MAX_NUM_BATCHED_TOKENS="2048")
    if kill:
        env["LAYERTAP_FAULTS"] = kill
    return subprocess.run([sys.executable, "-m", "layertap.pipeline"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_sigkill_at_twenty_points_loses_nothing(tmp_path, tiny_model):
    from layertap import Store
    from layertap.validate import check_part

    assert len({point for point, _ in KILLS}) == 20
    inputs = write_inputs(tmp_path)
    store = tmp_path / "store"
    for point, n in KILLS:
        out = run_pipeline(inputs, store, tiny_model, f"{point}:kill@{n}")
        assert out.returncode == -signal.SIGKILL, f"not killed at {point}@{n}: {out.stderr[-2000:]}"
    final = run_pipeline(inputs, store, tiny_model, None)
    assert final.returncode == 0, final.stderr[-3000:]

    # What the store must hold, worked out independently of it.
    rules = NormaliseRules()
    all_texts = [t for rows in texts() for t in rows]
    normalised = [rules.apply(t) for t in all_texts]
    prompts = {prompt_hash(t) for t in normalised if t}
    empty = sum(not t for t in normalised)

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
