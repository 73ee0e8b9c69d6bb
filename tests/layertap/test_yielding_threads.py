"""Host-side pools run below the default priority, so the engine's threads keep their cores."""

from __future__ import annotations

import os
import threading

import pytest

from layertap import yielding_threads
from layertap.yielding_threads import NICENESS, yielding_pool

pytestmark = pytest.mark.skipif(not hasattr(os, "setpriority"), reason="no per-thread priorities here")


def _nice_of_this_thread() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_pool_threads_run_at_a_lower_priority_and_the_caller_keeps_its_own():
    before = _nice_of_this_thread()
    with yielding_pool(2, thread_name_prefix="test-yielding") as pool:
        niceness = set(pool.map(lambda _: _nice_of_this_thread(), range(8)))
    assert niceness == {min(19, before + NICENESS)}
    assert _nice_of_this_thread() == before  # only the pool's own threads were lowered


def test_the_niceness_can_be_turned_off(monkeypatch):
    monkeypatch.setattr(yielding_threads, "NICENESS", 0)
    before = _nice_of_this_thread()
    with yielding_pool(1, thread_name_prefix="test-yielding") as pool:
        assert pool.submit(_nice_of_this_thread).result() == before


def test_a_refused_priority_change_still_runs_the_work(monkeypatch):
    def refuse(*args):
        raise PermissionError("not here")

    monkeypatch.setattr(os, "setpriority", refuse)
    with yielding_pool(1, thread_name_prefix="test-yielding") as pool:
        assert pool.submit(lambda: 6 * 7).result() == 42
