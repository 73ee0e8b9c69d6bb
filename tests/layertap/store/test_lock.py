"""Concurrent runs against one store, with real processes: the second run waits or fails naming the
holder, a killed holder leaves no stale lock, and readers read while a writer writes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from layertap.store.lock import StoreLocked, store_lock

ROOT = Path(__file__).resolve().parents[3]
CHILD = Path(__file__).with_name("store_writer_child.py")


def child(*args: str, code: str | None = None, stdin=None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-c", code, *args] if code else [sys.executable, str(CHILD), *args]
    return subprocess.Popen(cmd, stdin=stdin, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)


def holder(store: Path, seconds: float) -> subprocess.Popen:
    """A process that holds the store's lock for `seconds`, once it has printed "locked"."""
    proc = child(str(store), str(seconds), code=(
        "import sys, time\nfrom layertap.store.lock import store_lock\n"
        "with store_lock(sys.argv[1]):\n    print('locked', flush=True)\n    time.sleep(float(sys.argv[2]))\n"
    ))
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_second_run_fails_at_once_naming_the_holder(tmp_path):
    proc = holder(tmp_path / "store", 60)
    try:
        started = time.monotonic()
        with pytest.raises(StoreLocked) as caught:
            with store_lock(tmp_path / "store", timeout=0):
                pass
        assert time.monotonic() - started < 2
        message = str(caught.value)
        assert f"pid {proc.pid} on {socket.gethostname()}" in message
        assert "store is locked by another run" in message and "LAYERTAP_LOCK_TIMEOUT" in message
    finally:
        proc.kill()
        proc.wait()


def test_second_run_waits_for_the_lock(tmp_path):
    proc = holder(tmp_path / "store", 1.5)
    started = time.monotonic()
    with store_lock(tmp_path / "store", timeout=60):
        waited = time.monotonic() - started
    assert 0.5 < waited < 30
    assert proc.wait() == 0


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    proc = holder(tmp_path / "store", 60)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    with store_lock(tmp_path / "store", timeout=0):  # the kernel released it with the process
        pass


def test_the_flow_refuses_a_store_another_run_holds(tmp_path, prefect_harness, tiny_model):
    """A whole second run: clear error naming the holder, nothing written."""
    from flows.embed import embed_flow

    source = tmp_path / "in.csv"
    source.write_text("text\nhello\n")
    proc = holder(tmp_path / "store", 60)
    try:
        with pytest.raises(StoreLocked, match=f"pid {proc.pid}"):
            embed_flow(input=[str(source)], store=str(tmp_path / "store"), model=tiny_model, env_file=None)
        assert sorted(p.name for p in (tmp_path / "store").iterdir()) == ["layertap.lock"]
    finally:
        proc.kill()
        proc.wait()


def test_readers_read_while_a_writer_writes(tmp_path):
    from layertap.store.reader import Store

    store = tmp_path / "store"
    proc = child(str(store), "12", "paced", stdin=subprocess.PIPE)  # a round after each read: none is missed
    assert proc.stdout.readline().strip() == "locked"
    assert proc.stdout.readline().strip() == "round 0"
    reads, sizes = 0, []
    while proc.poll() is None:
        table = Store(store).embeddings(layer=2)
        hashes = table.column("prompt_hash").to_pylist()
        assert len(hashes) == len(set(hashes))  # never a duplicate result, never a half-published part
        assert table.num_rows % 10 == 0 and table.num_rows >= 50
        sizes.append(table.num_rows)
        reads += 1
        try:
            proc.stdin.write("next\n")
            proc.stdin.flush()
        except BrokenPipeError:  # the last round was written and the writer has exited
            break
    assert proc.wait() == 0
    assert reads >= 3 and sizes == sorted(sizes) and len(set(sizes)) > 1  # reads saw the store grow
    assert Store(store).embeddings(layer=0).num_rows == 12 * 50
    with store_lock(store, timeout=0):  # and the writer's lock is gone with it
        pass
