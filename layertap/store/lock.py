"""One writing run per store at a time, with the holder named when another run has to wait or give up.

DuckDB lets one process at a time open a database for writing, but the pipeline opens and closes its
connections per step, so two runs would interleave their steps and plan the same work twice. A run
therefore holds an exclusive `flock` on `layertap.lock` in the store for its whole duration. The kernel
drops the lock when the process dies, even by SIGKILL, so a crashed run never leaves a stale lock behind.
Readers (`Store`) never take it.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from layertap import faults
from layertap.errors import StoreError
from layertap.file_modes import create_file, make_dirs

LOCK_NAME = "layertap.lock"
_POLL_S = 0.1

_held: dict[str, list] = {}  # store root -> [fd, depth]: this process already holds it (re-entrant)
_held_lock = threading.Lock()


class StoreLocked(StoreError):
    """Another run holds the store's lock."""


def describe_holder(lock_path: str | os.PathLike) -> str:
    """Who holds the lock, as written by the holder: pid, host, start time, command."""
    try:
        info = json.loads(Path(lock_path).read_text() or "{}")
    except (OSError, ValueError):
        info = {}
    if not info:
        return "a run that is just starting"
    return (
        f"pid {info.get('pid')} on {info.get('host')} since {info.get('since')} "
        f"({info.get('command') or 'unknown command'})"
    )


def _acquire(fd: int, path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise StoreLocked(
                    f"{path.parent}: store is locked by another run: {describe_holder(path)}; waited "
                    f"{timeout:g}s (set lock_timeout, e.g. LAYERTAP_LOCK_TIMEOUT=600, to wait longer)"
                ) from None
            time.sleep(_POLL_S)


@contextlib.contextmanager
def store_lock(store_dir: str | os.PathLike, timeout: float = 0.0) -> Iterator[None]:
    """Hold the store's writer lock inside the block; wait up to `timeout` seconds for another holder."""
    root = Path(store_dir).expanduser().resolve()
    key = str(root)
    with _held_lock:
        if key in _held:
            _held[key][1] += 1
            reentered = True
        else:
            reentered = False
    if reentered:
        try:
            yield
        finally:
            with _held_lock:
                _held[key][1] -= 1
        return
    make_dirs(root)
    path = root / LOCK_NAME
    fd = create_file(path, os.O_RDWR | os.O_CREAT)
    try:
        _acquire(fd, path, timeout)
        holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv)[:200],
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        with _held_lock:
            _held[key] = [fd, 1]
        try:
            faults.hit("store-lock.acquired")  # holding the lock, the store not yet touched
            yield
        finally:
            with _held_lock:
                del _held[key]
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # closing the descriptor releases the flock
