"""The runner in a process of its own: same answers as in the caller's, errors carried across, no child left."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
from runner_fixtures import DTYPE, STEP_TOKENS, at_once, varied_prompts
from test_vllm_runner import assert_parity

from layertap.errors import EngineError, OutOfDeviceMemory
from layertap.runner.engine_options import EngineOptions
from layertap.runner.vllm_seam import vllm_is_cpu_build
from layertap.runner.runner_process import RunnerProcess
from layertap.runner.split_on_oom import extract_splitting

# The child's engine fails any call of more prompts than this as a device out of memory would.
OOM_ABOVE = 100


def start(model_dir: str, faults: str | None = None, **options) -> RunnerProcess:
    """A runner process on the tiny model; `faults` is LAYERTAP_FAULTS for the child only."""
    options = EngineOptions(model=model_dir, dtype=DTYPE, max_num_batched_tokens=STEP_TOKENS,
                            kv_cache_memory_bytes=64 * 2**20, runner_process=True, **options)
    with pytest.MonkeyPatch.context() as env:
        if faults:
            env.setenv("LAYERTAP_FAULTS", faults)
        return RunnerProcess(options)  # the child takes the environment as it is now


@pytest.fixture(scope="module")
def remote(model_dirs):
    runner = start(model_dirs["llama"], faults=f"runner-process.extract:oom>{OOM_ABOVE}")
    yield runner
    runner.close()


def test_rows_map_to_their_prompts_across_concurrent_calls_poolings_and_layer_sets(remote, references):
    """Vectors are read in place from the child's shared buffer and match transformers, for calls made at
    once from several threads (as a flow's batches in flight are) and for later ones."""
    assert (remote.num_layers, remote.hidden_size) == (4, 128) and remote.pid != os.getpid()
    calls = [(60, "last", [0, 2, 4]), (61, "last", [0, 2, 4]), (62, "last", [0, 2, 4]), (63, "mean", [1, 4])]
    results: dict[int, object] = {}

    def one(seed, pooling, layers):
        results[seed] = remote.extract(varied_prompts(50, seed=seed), layers, pooling)

    at_once(one, calls)
    for seed, pooling, layers in calls:
        ours = results[seed]
        assert sorted(ours.kept) == list(range(50)) and ours.buffer.startswith(("/dev/shm", "/tmp"))
        assert not ours.vectors[layers[0]].flags.writeable  # the caller only reads the engine's buffer
        assert_parity(ours, references("llama").extract(varied_prompts(50, seed=seed), layers, pooling), layers)
        ours.release()
    assert remote.host_buffers_allocated <= len(calls)


def test_truncated_and_rejected_prompts_keep_their_positions(remote, references):
    longest = remote.max_model_len
    prompts = ["short one", "x" * longest, "another short prompt", "y" * 40]  # + BOS: one token too many
    ours = remote.extract(prompts, [4], "last")
    assert ours.rejected.keys() == {1} and "too long" in ours.rejected[1] and sorted(ours.kept) == [0, 2, 3]
    ours.release()
    cut = remote.extract(prompts, [4], "last", truncate_to=30)
    assert cut.truncated == {1: longest + 1, 3: 41} and sorted(cut.kept) == [0, 1, 2, 3]
    cut.release()
    assert remote.extract([], [4], "last").vectors[4].shape == (0, remote.hidden_size)
    with pytest.raises(EngineError, match="pooling: expected one of last, mean, got 'max'"):
        remote.extract(prompts, [4], "max")


def test_out_of_memory_in_the_child_reaches_the_caller_as_such_and_the_batch_is_split(remote, references):
    """The child's torch.OutOfMemoryError arrives as `OutOfDeviceMemory`, which splitting recognises."""
    prompts = varied_prompts(OOM_ABOVE + 20, seed=64)
    with pytest.raises(OutOfDeviceMemory, match="out of memory"):
        remote.extract(prompts, [2], "last")
    ours = extract_splitting(remote, prompts, [2], "last")
    assert sorted(ours.kept) == list(range(len(prompts)))
    assert_parity(ours, references("llama").extract(prompts, [2], "last"), [2])
    assert remote.healthy()  # the engine itself never failed


def test_closing_stops_the_child_and_removes_its_buffers(model_dirs):
    runner = start(model_dirs["llama"], enforce_eager=True)  # a lifecycle: compiling adds only seconds
    held = runner.extract(varied_prompts(10, seed=65), [0], "last")
    directory = os.path.dirname(held.buffer)
    assert os.path.isdir(directory)
    held.release()
    runner.close()
    assert not runner._process.is_alive() and not os.path.exists(directory)
    assert not runner.healthy()
    with pytest.raises(EngineError, match="closed"):
        runner.extract(["a"], [0], "last")


def test_a_child_that_dies_fails_its_waiting_callers_takes_its_engine_core_along_and_is_unhealthy(model_dirs):
    """The child's engine core in a process of its own (as on a GPU): killing the child leaves no core behind,
    and a forked core holds nothing that keeps the caller from seeing the child go.
    Eager, like every lifecycle test: compiling adds seconds to the start and nothing to what is checked."""
    import psutil

    runner = start(model_dirs["llama"], engine_process=True, enforce_eager=True)
    try:
        started = psutil.Process(runner.pid).children(recursive=True)  # the engine core and vLLM's helpers
        assert any("EngineCore" in process.name() for process in started), [p.name() for p in started]
        # The child runs one thread while its engine starts: the core is forked, except where vLLM spawns it.
        assert runner.engine_core_start == ("spawn" if vllm_is_cpu_build() else "fork")
        failure: list[BaseException] = []

        def call():
            try:
                runner.extract(varied_prompts(400, seed=66), [0, 4], "mean")
            except BaseException as exc:  # noqa: BLE001 - examined below
                failure.append(exc)

        thread = threading.Thread(target=call)
        thread.start()
        while not runner._pending:
            time.sleep(0.01)
        os.kill(runner.pid, signal.SIGKILL)
        thread.join(60)
        assert len(failure) == 1 and isinstance(failure[0], EngineError), failure
        assert "exited" in str(failure[0]) and "-9" in str(failure[0])
        _, left = psutil.wait_procs(started, timeout=30)
        assert not left
        assert not runner.healthy()
        with pytest.raises(EngineError, match="failed earlier"):
            runner.extract(["a"], [0], "last")
    finally:
        runner.close()


def test_the_child_leaves_its_startup_heap_out_of_garbage_collection(model_dirs):
    """With the engine core apart (as on a GPU), vLLM freezes only the core's heap: the child freezes its own
    once the engine is up, so a collector pass never walks torch's and vLLM's objects with the engine waiting."""
    runner = start(model_dirs["llama"], engine_process=True, enforce_eager=True)
    try:
        assert runner.frozen_heap_objects > 100_000, runner.frozen_heap_objects
        ours = runner.extract(varied_prompts(8, seed=67), [4], "last")
        assert sorted(ours.kept) == list(range(8))
        ours.release()
    finally:
        runner.close()


def test_the_default_follows_the_installed_vllm_build():
    """In its own process on a GPU build of vLLM, in the caller's on its CPU build; either when asked."""
    options = EngineOptions(model="m")
    assert options.runner_in_own_process() is not vllm_is_cpu_build()
    assert EngineOptions(model="m", runner_process=True).runner_in_own_process()
    assert not EngineOptions(model="m", runner_process=False).runner_in_own_process()
    if vllm_is_cpu_build():
        from vllm.platforms import current_platform

        assert current_platform.is_cpu()


def test_vectors_are_those_the_engine_copied(remote):
    """The caller's view is the child's buffer itself: no copy of the vectors crosses the pipe."""
    ours = remote.extract(varied_prompts(5, seed=67), [3], "last")
    on_disk = np.fromfile(ours.buffer, dtype=ours.vectors[3].dtype, count=ours.vectors[3].size)
    assert np.array_equal(on_disk.reshape(ours.vectors[3].shape), ours.vectors[3])
    ours.release()


def test_the_child_reports_its_engine_thread_s_counters(remote):
    before = remote.activity()
    time.sleep(0.3)  # nothing queued: the child's engine waits
    remote.extract(varied_prompts(5, seed=68), [3], "last").release()
    after = remote.activity()
    assert after.steps > before.steps and after.stepping_s > before.stepping_s
    assert after.idle_s - before.idle_s >= 0.25


def test_a_child_that_cannot_start_its_engine_says_why(tmp_path):
    with pytest.raises(EngineError, match="the runner could not start: model: .* has no config.json"):
        start(str(tmp_path / "no-such-model"))
