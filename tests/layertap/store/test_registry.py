"""The dataset registry and run history: real DuckDB, no engine."""

from __future__ import annotations

import signal
import subprocess
import sys

import duckdb
import pytest

from layertap.errors import InputError, StoreError
from layertap.store.registry import Registry, check_name, read_status
from layertap.store.reader import Store
from layertap.store.schema import DB_NAME, SCHEMA_VERSION
from layertap.store.store_db import StoreDB
from layertap.store.lock import store_lock

OPTIONS = {"model": "/models/m", "layers": "0,-1", "pooling": "last", "dtype": "float32", "store_dtype": None,
           "remove_period": False}


def write(path, *texts):
    path.write_text("text\n" + "".join(f"{t}\n" for t in texts))
    return str(path)


def test_add_files_creates_then_appends(tmp_path):
    reg = Registry(tmp_path / "store")
    a = write(tmp_path / "a.csv", "one", "two")
    first = reg.add_files("reviews", [a], "text", OPTIONS, given=set())
    assert first.created and first.new_files == [a] and first.dataset.options == OPTIONS
    b = write(tmp_path / "b.csv", "three")
    again = reg.add_files("reviews", [a, b], "text", {**OPTIONS, "layers": "all"}, given=set())
    assert not again.created and again.new_files == [b]  # a is known; layers not given explicitly: kept
    assert reg.get("reviews").sources == [a, b] and reg.get("reviews").options["layers"] == "0,-1"
    assert reg.names() == ["reviews"]


def test_add_files_refuses_changed_extraction_settings_and_bad_input(tmp_path):
    reg = Registry(tmp_path / "store")
    a = write(tmp_path / "a.csv", "one")
    reg.add_files("reviews", [a], "text", OPTIONS, given=set())
    with pytest.raises(InputError, match="created with pooling='last'"):
        reg.add_files("reviews", [a], "text", {**OPTIONS, "pooling": "mean"}, given={"pooling"})
    with pytest.raises(InputError, match="no column 'body'"):
        reg.add_files("other", [a], "body", OPTIONS, given=set())
    with pytest.raises(InputError, match="no such file"):
        reg.add_files("other", [str(tmp_path / "missing.csv")], "text", OPTIONS, given=set())
    assert reg.names() == ["reviews"]  # nothing registered by the failed adds


def test_names_are_checked_and_unknown_datasets_named(tmp_path):
    for bad in ("", "Upper", "-dash", "a b", "x" * 65):
        with pytest.raises(InputError):
            check_name(bad)
    reg = Registry(tmp_path / "store")
    with pytest.raises(StoreError, match="none are registered"):
        reg.get("nope")


def test_runs_are_recorded_and_reported(tmp_path):
    reg = Registry(tmp_path / "store")
    a = write(tmp_path / "a.csv", "one", "two")
    reg.add_files("reviews", [a], "text", OPTIONS, given=set())
    run = reg.start_run("reviews", None)
    assert read_status(tmp_path / "store")["runs"][0]["status"] == "running"
    reg.finish_run(run, "completed", 1.5, {"embedded": 2})
    status = read_status(tmp_path / "store")
    assert status["runs"][0]["status"] == "completed" and status["runs"][0]["summary"] == {"embedded": 2}
    assert status["datasets"] == [
        {"name": "reviews", "text_column": "text", "options": OPTIONS, "files": 1, "files_read": 0, "rows": 0}
    ]
    StoreDB(tmp_path / "store").ingest([a], "text")
    assert read_status(tmp_path / "store")["datasets"][0]["rows"] == 2


def test_a_run_whose_process_died_is_marked_crashed_by_the_next_run(tmp_path):
    """The dead run held the store's lock and recorded itself as running; the kernel dropped its lock when it
    was killed, and the next run to take the lock marks it crashed."""
    store = tmp_path / "store"
    Registry(store)
    code = ("import os, signal, sys\n"
            "from layertap.store.registry import Registry\nfrom layertap.store.lock import store_lock\n"
            "with store_lock(sys.argv[1]):\n    Registry(sys.argv[1]).start_run('reviews', None)\n"
            "    os.kill(os.getpid(), signal.SIGKILL)")
    out = subprocess.run([sys.executable, "-c", code, str(store)], capture_output=True, text=True, timeout=120)
    assert out.returncode == -signal.SIGKILL, out.stderr
    assert [r["status"] for r in read_status(store)["runs"]] == ["running"]
    with store_lock(store):
        Registry(store).start_run("reviews", None)
    runs = read_status(store)["runs"]
    assert sorted(r["status"] for r in runs) == ["crashed", "running"]
    assert "process died" in next(r for r in runs if r["status"] == "crashed")["summary"]["error"]


def test_a_version_1_store_is_readable_and_upgraded_by_a_writer(tmp_path):
    store = tmp_path / "store"
    StoreDB(store).prepare()
    with duckdb.connect(str(store / DB_NAME)) as con:  # what a store made before the registry looks like
        con.execute("DROP TABLE datasets; DROP TABLE dataset_sources; DROP TABLE runs")
        con.execute("UPDATE meta SET value = '1' WHERE key = 'schema_version'")
    assert Store(store).schema_version == "1"
    assert read_status(store)["datasets"] == [] and read_status(store)["runs"] == []
    Registry(store).add_files("d", [write(tmp_path / "a.csv", "x")], "text", OPTIONS, given=set())
    assert Store(store).schema_version == SCHEMA_VERSION


def test_an_unknown_store_version_is_a_clear_error(tmp_path):
    store = tmp_path / "store"
    StoreDB(store).prepare()
    with duckdb.connect(str(store / DB_NAME)) as con:
        con.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    with pytest.raises(StoreError, match="schema version 99; this layertap needs 3"):
        Registry(store)
    with pytest.raises(StoreError, match="schema version 99"):
        Store(store)
