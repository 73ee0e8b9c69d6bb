"""Malformed inputs, as a user meets them: one line naming the file, column or setting, a non-zero exit,
and a store left byte for byte as it was."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import duckdb
import pytest

from test_cli import one_error_line, run_cli, write_csv


def snapshot(store: Path) -> dict[str, str]:
    return {
        str(p.relative_to(store)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(store.rglob("*")) if p.is_file()
    }


@pytest.fixture
def store(tmp_path) -> Path:
    """A store that already holds rows (no engine needed to make one)."""
    from layertap.store.normalise import NormaliseRules
    from layertap.store.store_db import StoreDB

    db = StoreDB(tmp_path / "store")
    db.ingest([write_csv(tmp_path / "earlier.csv", ["earlier row", "another"])], "text")
    db.normalise(NormaliseRules())
    return tmp_path / "store"


def unreadable_file(tmp_path: Path) -> str:
    """A .csv whose bytes cannot be read: mode 000, or for root (who reads anything) a file that fails
    with an I/O error on read."""
    path = tmp_path / "unreadable.csv"
    if os.geteuid() == 0:
        path.symlink_to("/proc/self/mem")
    else:
        write_csv(path, ["x"])
        path.chmod(0)
    return str(path)


def model_without_config(tmp_path: Path) -> str:
    folder = tmp_path / "no-config-model"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{}")
    return str(folder)


CASES = {
    "missing text column": (lambda tmp, model: ["--input", write_csv(tmp / "in.csv", ["a"], column="body")],
                            r"in\.csv: no column 'text' \(columns: body\)"),
    "unreadable file": (lambda tmp, model: ["--input", unreadable_file(tmp)], r"cannot read"),
    "wrong format": (lambda tmp, model: ["--input", str(write_text(tmp / "in.parquet", "text\nnot parquet\n"))],
                     r"in\.parquet: cannot read as parquet"),
    "wrong format json": (lambda tmp, model: ["--input", str(write_text(tmp / "in.jsonl", "text\nplain lines\n"))],
                          r"in\.jsonl: cannot read as JSON lines"),
    "model folder without config": (
        lambda tmp, model: ["--input", write_csv(tmp / "in.csv", ["a"]), "--model", model_without_config(tmp)],
        r"model: .*no-config-model has no config\.json"),
    "layer out of range": (
        lambda tmp, model: ["--input", write_csv(tmp / "in.csv", ["a"]), "--model", model, "--layers", "0,9"],
        r"layers: index 9 is out of range for a model with 4 layers"),
}


def write_text(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_input_is_one_line_and_leaves_the_store_alone(case, tmp_path, store, tiny_model):
    import re

    make_args, pattern = CASES[case]
    before = snapshot(store)
    out = run_cli("run", *make_args(tmp_path, tiny_model), "--store", str(store), cwd=tmp_path)
    assert out.returncode != 0
    assert re.search(pattern, one_error_line(out.stderr)), out.stderr
    assert snapshot(store) == before


def test_store_of_another_version_is_refused_and_left_alone(tmp_path, store):
    with duckdb.connect(str(store / "layertap.duckdb")) as con:
        con.execute("UPDATE meta SET value = '4' WHERE key = 'schema_version'")  # a newer layertap's store
    before = snapshot(store)
    out = run_cli("run", "--input", write_csv(tmp_path / "in.csv", ["a"]), "--store", str(store), cwd=tmp_path)
    assert out.returncode == 1
    reason = one_error_line(out.stderr)
    assert "layertap.duckdb: store has schema version 4; this layertap needs 3" in reason
    assert snapshot(store) == before


def test_a_bad_file_among_good_ones_fails_before_any_is_ingested(tmp_path, store):
    """Inputs are checked together: the good file is not half-ingested before the bad one fails."""
    from layertap.errors import InputError
    from layertap.store.reader import Store
    from layertap.store.store_db import StoreDB

    good = write_csv(tmp_path / "good.csv", ["fine"])
    bad = write_csv(tmp_path / "bad.csv", ["x"], column="body")
    with pytest.raises(InputError, match="bad.csv: no column 'text'"):
        StoreDB(store).ingest([good, bad], "text")
    with duckdb.connect(str(store / "layertap.duckdb"), read_only=True) as con:
        assert con.execute("SELECT count(*) FROM rows WHERE source LIKE '%good.csv'").fetchone() == (0,)
    assert Store(store).store_uuid


def test_model_with_its_own_code_needs_opt_in(tmp_path, tiny_model):
    """A config that maps to code shipped in the folder is refused before anything imports that code."""
    import shutil

    model = tmp_path / "remote-code-model"
    shutil.copytree(tiny_model, model)
    marker = tmp_path / "code-ran"
    (model / "custom_model.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    config = json.loads((model / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "custom_model.CustomModel"}
    (model / "config.json").write_text(json.dumps(config))

    out = run_cli("run", "--input", write_csv(tmp_path / "in.csv", ["a"]), "--model", str(model),
                  "--store", str(tmp_path / "store"), cwd=tmp_path)
    assert out.returncode == 1
    reason = one_error_line(out.stderr)
    assert "ships its own code" in reason and "--trust-remote-code" in reason
    assert not marker.exists()
    assert not (tmp_path / "store").exists()
