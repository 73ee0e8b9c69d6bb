"""Cores of their own for the engine's processes: the machine's physical cores read from sysfs, split between
the engine and the host, and real processes and threads moved onto their share."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from layertap import engine_cores
from layertap.parts import writer

needs_two_cpus = pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                                    reason="moving threads between CPUs needs two of them")


def fake_sysfs(root: Path, siblings: dict[int, str]) -> Path:
    for cpu, text in siblings.items():
        (root / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (root / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(text + "\n")
    return root


def test_hardware_threads_of_one_core_are_grouped_and_only_allowed_cpus_count(tmp_path):
    # 4 cores, two threads each, numbered as Linux numbers them on most x86 machines (0 and 4 share a core).
    sysfs = fake_sysfs(tmp_path, {cpu: f"{cpu % 4},{cpu % 4 + 4}" for cpu in range(8)})
    assert engine_cores.physical_cores(set(range(8)), sysfs) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert engine_cores.physical_cores({0, 1, 5, 7}, sysfs) == [(0,), (1, 5), (7,)]


def test_a_cpu_without_readable_topology_is_a_core_of_its_own(tmp_path):
    sysfs = fake_sysfs(tmp_path, {0: "0-1", 1: "0-1"})
    assert engine_cores.physical_cores({0, 1, 2}, sysfs) == [(0, 1), (2,)]


def test_the_last_physical_cores_go_to_the_engine_and_the_rest_to_the_host():
    cores = [(c, c + 8) for c in range(8)]
    split = engine_cores.split(cores, engine_cores=2, min_cores=8)
    assert split.engine == {6, 14, 7, 15}
    assert split.host == set(range(16)) - {6, 14, 7, 15}


@pytest.mark.parametrize("cores, engine, least", [(7, 2, 8), (8, 0, 8), (2, 2, 2)])
def test_too_few_cores_or_none_asked_for_leave_the_machine_alone(cores, engine, least):
    assert engine_cores.split([(c,) for c in range(cores)], engine_cores=engine, min_cores=least) is None


@needs_two_cpus
def test_a_process_tree_is_moved_thread_by_thread_with_its_children():
    """A child with a second thread and a grandchild: every thread of both ends up on the one CPU given."""
    script = ("import subprocess, sys, threading, time; "
              "threading.Thread(target=time.sleep, args=(60,), daemon=True).start(); "
              "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
              "print(g.pid, flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    grandchild = None
    try:
        grandchild = int(child.stdout.readline())
        target = {max(os.sched_getaffinity(0))}
        moved = engine_cores.pin_process_tree(child.pid, target)
        threads = [int(t) for t in os.listdir(f"/proc/{child.pid}/task")] + [grandchild]
        assert moved >= 3
        assert all(os.sched_getaffinity(t) == target for t in threads)
    finally:
        if grandchild is not None:
            os.kill(grandchild, signal.SIGKILL)
        child.kill()
        child.wait()


@needs_two_cpus
def test_the_runner_process_moves_itself_onto_the_engine_cores_and_host_threads_keep_off_them(fresh_python):
    """With one core kept for the engine (a 2-CPU machine counts as big enough here), a process that calls
    `keep_engine_cores` ends on the last CPU with the threads it had, and a checking thread started in a
    process that reserved cores runs on the others."""
    script = """
import os, threading, time
from layertap import engine_cores
from layertap.parts import background
engine_cores.ENGINE_CORES, engine_cores.MIN_CORES = 1, 2
every = sorted(os.sched_getaffinity(0))
sleeper = threading.Thread(target=time.sleep, args=(5,), daemon=True)
sleeper.start()
engine_cores.keep_engine_cores()
print(sorted(os.sched_getaffinity(0)) == every[-1:], sorted(os.sched_getaffinity(sleeper.native_id)) == every[-1:])
os.sched_setaffinity(0, every)  # as a process that started the runner
engine_cores.reserve_for_engine()
seen = []
t = threading.Thread(target=lambda: (background.lower_this_thread(), seen.append(sorted(os.sched_getaffinity(0)))))
t.start(); t.join()
print(seen[0] == every[:-1])
"""
    assert fresh_python(script).split() == ["True", "True", "True"]


@needs_two_cpus
def test_encoders_are_as_many_as_the_host_cpus_and_run_on_them(monkeypatch):
    every = frozenset(os.sched_getaffinity(0))
    kept = engine_cores.CoreSplit(engine=frozenset({max(every)}), host=every - {max(every)})
    monkeypatch.setattr(engine_cores, "core_split", lambda: kept)  # as on a machine big enough to split
    monkeypatch.setattr(engine_cores, "_reserved", True)
    try:
        assert writer.encoder_threads() == len(kept.host)
        ran_on = writer._encoders().submit(lambda: frozenset(os.sched_getaffinity(0))).result()
        assert ran_on == kept.host
    finally:
        monkeypatch.undo()
        writer._encoders()  # made again on every CPU for the tests after this one

