"""Security guarantees of the store: the user's umask and never world-writable files, no pickle anywhere
results travel, and SQL that treats user-given column names and paths as data."""

from __future__ import annotations

import ast
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parents[3]
CHILD = Path(__file__).with_name("store_writer_child.py")


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077])
def test_store_files_follow_the_umask_and_are_never_world_writable(tmp_path, umask):
    store = tmp_path / "store"
    out = subprocess.run(
        [sys.executable, str(CHILD), str(store), "1"], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        preexec_fn=lambda: os.umask(umask), capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    paths = [store, *store.rglob("*")]
    assert any(p.suffix == ".parquet" for p in paths) and (store / "layertap.duckdb").is_file()
    for path in paths:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert not mode & stat.S_IWOTH, f"{path} is world-writable ({mode:o})"
        assert not mode & umask, f"{path} ignores the umask {umask:03o} ({mode:o})"
        assert mode & stat.S_IRUSR and mode & stat.S_IWUSR


def _python_files() -> list[Path]:
    return [p for folder in ("layertap", "tasks", "flows") for p in (ROOT / folder).rglob("*.py")]


def test_results_never_travel_as_pickle():
    """Every Prefect task and flow stores its results as JSON, and no module imports a pickler."""
    import flows.embed
    import tasks

    for name in tasks.__all__:
        task = getattr(tasks, name)
        if hasattr(task, "fn"):
            assert getattr(task.result_serializer, "type", task.result_serializer) == "json", name
    flow_serializer = flows.embed.embed_flow.result_serializer
    assert getattr(flow_serializer, "type", flow_serializer) == "json"
    picklers = {"pickle", "cloudpickle", "dill", "joblib"}
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not {n.split(".")[0] for n in names} & picklers, f"{path} imports a pickler"


ODD_COLUMN = 'te"xt\'; DROP TABLE rows; --'


def test_user_given_column_names_and_paths_stay_data(tmp_path):
    """Names that would break or rewrite interpolated SQL are read as they are, in every format."""
    from layertap.store.normalise import NormaliseRules
    from layertap.store.inputs import check_inputs
    from layertap.store.reader import Store
    from layertap.store.store_db import StoreDB

    folder = tmp_path / "it's \"odd\"; DROP TABLE rows; --"
    folder.mkdir()
    csv_path = folder / "a'b.csv"
    csv_path.write_text('"' + ODD_COLUMN.replace('"', '""') + '"\nfrom csv\n')
    jsonl_path = folder / "c'd.jsonl"
    jsonl_path.write_text(json.dumps({ODD_COLUMN: "from jsonl"}) + "\n")
    parquet_path = folder / "e'f.parquet"
    pq.write_table(pa.table({ODD_COLUMN: ["from parquet"]}), parquet_path)
    inputs = [str(csv_path), str(jsonl_path), str(parquet_path)]

    assert len(check_inputs(inputs, ODD_COLUMN)) == 3
    db = StoreDB(folder / "store")
    assert db.ingest(inputs, ODD_COLUMN).rows_new == 3
    assert db.normalise(NormaliseRules()).new_prompts == 3
    with duckdb.connect(str(db.db_path), read_only=True) as con:
        texts = sorted(row[0] for row in con.execute("SELECT raw_text FROM rows").fetchall())
        sources = {row[0] for row in con.execute("SELECT text_column FROM sources").fetchall()}
    assert texts == ["from csv", "from jsonl", "from parquet"]
    assert sources == {ODD_COLUMN}
    assert Store(folder / "store").store_uuid == db.store_uuid


def test_paths_in_the_manifest_never_lead_outside_the_store(tmp_path):
    """A manifest edited to name a file outside the store (here a real Parquet file beside it) is refused by
    readers and reported by `layertap validate`, never read."""
    from layertap.errors import StoreError
    from layertap.store.reader import Store
    from layertap.store.check import check_store

    store = tmp_path / "store"
    out = subprocess.run([sys.executable, str(CHILD), str(store), "1"], cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert Store(store).embeddings(layer=0).num_rows == 50 and check_store(store).ok
    with duckdb.connect(str(store / "layertap.duckdb")) as con:
        part_id, path = con.execute("SELECT part_id, path FROM parts ORDER BY part_id LIMIT 1").fetchone()
        outside = tmp_path / "outside.parquet"
        outside.write_bytes((store / path).read_bytes())
        con.execute("UPDATE parts SET path = ? WHERE part_id = ?", ["../outside.parquet", part_id])
    with pytest.raises(StoreError, match="'../outside.parquet', which is not inside the store's parts/"):
        Store(store).embeddings(layer=0)
    report = check_store(store)
    assert not report.ok and any("not inside the store's parts/" in p for p in report.problems)
