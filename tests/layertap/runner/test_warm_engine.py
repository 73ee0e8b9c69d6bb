"""Warm engines: one engine process shared by successive and concurrent callers, never a wrong one,
replaced when it dies, gone after its idle timeout."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from runner_fixtures import DTYPE, ON_GPU, STEP_TOKENS, at_once, varied_prompts
from test_vllm_runner import assert_parity

from layertap.errors import EngineError
from layertap.runner import warm_engine
from layertap.runner.engine_options import EngineOptions


def options(model_dir: str, **more) -> EngineOptions:
    """Small engines: on a GPU two of them share the device (one per set of options)."""
    return EngineOptions(model=model_dir, dtype=DTYPE, max_num_batched_tokens=STEP_TOKENS,
                         kv_cache_memory_bytes=64 * 2**20, gpu_memory_utilization=0.2 if ON_GPU else None, **more)


def starts(directory: str) -> list[dict]:
    path = os.path.join(directory, warm_engine.STARTS_LOG)
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


def wait_until(condition, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return condition()


@pytest.fixture(scope="module")
def engine_dir():
    directory = tempfile.mkdtemp(prefix="lt-engines-", dir="/tmp")  # socket paths must stay short
    yield directory
    warm_engine.stop_engines(directory)


def test_callers_attached_at_once_share_one_engine_and_get_their_own_rows(engine_dir, model_dirs, references):
    """Two callers (two runs) attached at the same time, each with batches from several threads: one engine
    start, and every caller's rows are its own prompts' vectors."""
    first = warm_engine.attach(options(model_dirs["llama"]), 600, engine_dir)
    second = warm_engine.attach(options(model_dirs["llama"]), 600, engine_dir)
    try:
        assert first.pid == second.pid != os.getpid() and len(starts(engine_dir)) == 1
        calls = [(first, 70, "last", [0, 2, 4]), (second, 71, "last", [0, 2, 4]), (first, 72, "mean", [1, 4]),
                 (second, 73, "last", [4])]
        results = {}

        def one(engine, seed, pooling, layers):
            results[seed] = engine.extract(varied_prompts(40, seed=seed), layers, pooling)

        at_once(one, calls)
        for _, seed, pooling, layers in calls:
            assert sorted(results[seed].kept) == list(range(40))
            assert_parity(results[seed], references("llama").extract(varied_prompts(40, seed=seed), layers, pooling),
                          layers)
            results[seed].release()
        listed = warm_engine.list_engines(engine_dir)
        assert [e["pid"] for e in listed] == [first.pid] and listed[0]["model"] == model_dirs["llama"]
        assert listed[0]["host_rss_bytes"] > 0
    finally:
        first.close()
        second.close()
    # Detaching leaves the engine up for the next run, which starts nothing.
    again = warm_engine.attach(options(model_dirs["llama"]), 600, engine_dir)
    try:
        assert again.pid == first.pid and len(starts(engine_dir)) == 1
        ours = again.extract(["one more prompt"], [4], "last")
        assert ours.kept == [0]
        ours.release()
    finally:
        again.close()


def test_other_engine_options_get_an_engine_of_their_own_which_frees_itself_when_idle(engine_dir, model_dirs):
    """The other engine also runs vLLM's engine core in a process of its own, as a warm engine on a GPU
    does: that process is started by spawning from the warm engine's, and its model must still be tapped."""
    shared = warm_engine.attach(options(model_dirs["llama"]), 600, engine_dir)
    before = len(starts(engine_dir))
    other = warm_engine.attach(options(model_dirs["llama"], max_num_seqs=8, engine_process=True), 1.0, engine_dir)
    try:
        assert other.pid != shared.pid and len(starts(engine_dir)) == before + 1
        assert other.info["options"]["max_num_seqs"] == 8 and shared.info["options"]["max_num_seqs"] is None
        assert other.info["engine_process"]
        assert other.info["frozen_heap_objects"] > 100_000  # vLLM freezes only its core's heap; it froze its own
        ours = other.extract(["idle soon"], [1], "last")
        assert ours.vectors[1].shape == (1, 128) and np.isfinite(ours.vectors[1]).all()
        ours.release()
        assert wait_until(lambda: len(warm_engine.list_engines(engine_dir)) == 2, 10)
        time.sleep(2.0)
        assert warm_engine.engine_alive(other.pid), "an engine with a run attached never idles out"
    finally:
        shared.close()
        other.close()  # from here on it is idle: gone after one second
    assert wait_until(lambda: not warm_engine.engine_alive(other.pid), 60)
    assert [e["pid"] for e in warm_engine.list_engines(engine_dir)] == [shared.pid]
    assert not os.path.exists(os.path.join(engine_dir, f"{other.key}.sock"))


def test_an_engine_killed_between_or_during_runs_is_replaced_on_the_next_attach(engine_dir, model_dirs):
    attached = warm_engine.attach(options(model_dirs["llama"]), 600, engine_dir)
    before = len(starts(engine_dir))
    os.kill(attached.pid, signal.SIGKILL)  # the engine dies under an attached run
    with pytest.raises(EngineError):
        attached.extract(varied_prompts(20, seed=5), [4], "last").release()
    assert not attached.healthy()
    attached.close()
    fresh = warm_engine.attach(options(model_dirs["llama"]), 600, engine_dir)
    try:
        assert fresh.pid != attached.pid and len(starts(engine_dir)) == before + 1
        ours = fresh.extract(varied_prompts(20, seed=5), [4], "last")
        assert sorted(ours.kept) == list(range(20)) and np.isfinite(ours.vectors[4]).all()
        ours.release()
    finally:
        fresh.close()


def test_a_run_killed_while_its_engine_starts_leaves_it_starting_for_the_next_run(model_dirs):
    """The engine a run started keeps starting when that run is killed; the next run waits for it instead of
    starting a second engine of the same key beside it (which would be left holding memory, unreachable)."""
    directory = tempfile.mkdtemp(prefix="lt-engines-", dir="/tmp")
    wanted = options(model_dirs["llama"], enforce_eager=True)
    key = warm_engine.WarmSpec.for_options(wanted).key()
    starter = subprocess.Popen(
        [sys.executable, "-c", "import json, sys; from layertap.runner import warm_engine; "
         "from layertap.runner.engine_options import EngineOptions; "
         "warm_engine.attach(EngineOptions(**json.loads(sys.argv[1])), 600, sys.argv[2])",
         json.dumps(dataclasses.asdict(wanted)), directory])
    try:
        assert wait_until(lambda: warm_engine.engine_running(Path(directory), key), 60)
        starter.kill()
        starter.wait()
        assert not os.path.exists(os.path.join(directory, f"{key}.sock")), "the engine was up before the kill"
        attached = warm_engine.attach(wanted, 600, directory)
        try:
            assert [s["pid"] for s in starts(directory)] == [attached.pid]  # the killed run's engine, the only one
            ours = attached.extract(["after the starter died"], [4], "last")
            assert ours.kept == [0]
            ours.release()
        finally:
            attached.close()
    finally:
        warm_engine.stop_engines(directory)
    assert not warm_engine.engine_running(Path(directory), key)


def test_an_engine_that_serves_something_else_is_refused(engine_dir, model_dirs):
    """What an engine says it serves is checked on every attach: a socket that leads to an engine of other
    options (here a link planted where another key's engine would listen) is refused, and nothing starts."""
    served = warm_engine.attach(options(model_dirs["llama"]), 600, engine_dir)
    served.close()
    wanted = options(model_dirs["llama"], max_num_seqs=4)
    planted = os.path.join(engine_dir, f"{warm_engine.WarmSpec.for_options(wanted).key()}.sock")
    os.symlink(os.path.join(engine_dir, f"{served.key}.sock"), planted)
    before = len(starts(engine_dir))
    try:
        with pytest.raises(EngineError, match="refusing to use it"):
            warm_engine.attach(wanted, 600, engine_dir)
    finally:
        os.unlink(planted)
    assert len(starts(engine_dir)) == before


def test_a_process_that_took_a_dead_engines_pid_is_never_signalled():
    """An engine's status file outlives a crash; should its pid now belong to another process, the file is
    forgotten and that process is left alone."""
    directory = tempfile.mkdtemp(prefix="lt-engines-", dir="/tmp")
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        status = os.path.join(directory, "0123456789abcdef.json")
        with open(status, "w") as handle:
            json.dump({"key": "0123456789abcdef", "pid": other.pid, "clients": 0}, handle)
        assert not warm_engine.engine_alive(other.pid) and not warm_engine.engine_alive(os.getpid())
        assert warm_engine.list_engines(directory) == [] and not os.path.exists(status)
        warm_engine.stop(other.pid, timeout=1)
        assert warm_engine.stop_engines(directory) == 0
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()
