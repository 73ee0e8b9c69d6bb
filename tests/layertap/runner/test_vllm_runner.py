"""The hooked vLLM runner against transformers' output_hidden_states, on three architecture families."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from runner_fixtures import DTYPE, MAX_ABS_ERROR, MIN_COSINE, REFERENCE_DEVICE, STEP_TOKENS, varied_prompts

from layertap.parts.bfloat16 import as_float32
from layertap.errors import EngineError
from layertap.runner import vllm_seam


def assert_parity(ours, reference, layers, min_cosine=MIN_COSINE, max_abs_error=MAX_ABS_ERROR):
    """Every prompt, every layer: cosine and (on CPU) max abs error within tolerance.

    Row i of ours belongs to prompt ours.kept[i] (vLLM finishes prompts in its own order).
    """
    for layer in layers:
        got = as_float32(ours.vectors[layer]).astype(np.float64)
        ref = np.asarray(reference.vectors[layer], np.float64)[ours.kept]
        assert got.shape == ref.shape, (layer, got.shape, ref.shape)
        cos = (got * ref).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(ref, axis=1))
        assert cos.min() >= min_cosine, f"layer {layer}: worst cosine {cos.min()} on prompt {cos.argmin()}"
        if max_abs_error is not None:
            err = np.abs(got - ref).max()
            assert err <= max_abs_error, f"layer {layer}: max abs error {err}"


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma"])
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_every_layer_matches_transformers(arch, pooling, engines, references):
    runner = engines(arch)
    prompts = varied_prompts(60, seed=1)
    assert max(len(p.encode()) for p in prompts) > STEP_TOKENS  # chunked prefill splits some prompts
    layers = list(range(runner.num_layers + 1))
    ours = runner.extract(prompts, layers, pooling)
    assert sorted(ours.kept) == list(range(len(prompts))) and not ours.rejected
    assert_parity(ours, references(arch).extract(prompts, layers, pooling), layers)


def test_five_hundred_mixed_prompts_map_to_their_own_rows(engines, references):
    runner = engines("llama")
    prompts = varied_prompts(500, seed=2, longest=200)
    layers = [0, 2, runner.num_layers]
    ours = runner.extract(prompts, layers, "last")
    assert_parity(ours, references("llama").extract(prompts, layers, "last"), layers)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_identical_prompts_and_shared_prefixes_with_prefix_caching(pooling, engines, references):
    """The engine caches prefixes; last pooling may reuse them, mean pooling must recompute every token."""
    runner = engines("llama")
    prefix = "shared system preamble " * 12  # longer than a KV block and than one engine step
    prompts = [prefix + tail for tail in ("a", "b", "a", "question one?", "question two?")] + [prefix] * 3
    layers = list(range(runner.num_layers + 1))
    for _ in range(2):  # the second call finds every prefix cached
        ours = runner.extract(prompts, layers, pooling)
        assert_parity(ours, references("llama").extract(prompts, layers, pooling), layers)
    same = as_float32(ours.vectors[2])[[ours.kept.index(0), ours.kept.index(2)]]  # one prompt twice: one vector
    assert np.dot(same[0], same[1]) / np.linalg.norm(same[0]) / np.linalg.norm(same[1]) >= MIN_COSINE


def test_second_call_with_other_layers_on_the_same_engine(engines, references):
    runner = engines("qwen3")
    prompts = varied_prompts(20, seed=3)
    for layers in ([1], [0, runner.num_layers], [-1 + runner.num_layers]):
        ours = runner.extract(prompts, layers, "last")
        assert sorted(ours.vectors) == layers
        assert_parity(ours, references("qwen3").extract(prompts, layers, "last"), layers)


def test_prompts_longer_than_the_model_allows_are_rejected_not_truncated(engines):
    runner = engines("llama")
    too_long = "x" * (runner.max_model_len + 10)
    result = runner.extract(["fine", too_long, "also fine"], [1], "last")
    assert sorted(result.kept) == [0, 2]
    assert "too long" in result.rejected[1] and str(runner.max_model_len) in result.rejected[1]
    assert result.vectors[1].shape == (2, runner.hidden_size)


def test_unknown_vllm_shape_is_a_clear_error(monkeypatch):
    """A vLLM release that renames a seam layertap relies on fails early, naming it."""
    from vllm.v1.pool import metadata

    vllm_seam.check_vllm()
    monkeypatch.delattr(metadata.PoolingCursor, "__dataclass_fields__")
    monkeypatch.setattr(metadata, "PoolingCursor", type("PoolingCursor", (), {}))
    with pytest.raises(EngineError, match="PoolingCursor.last_token_indices_gpu"):
        vllm_seam.check_vllm()


def test_concurrent_callers_share_the_engine_and_get_their_own_rows(engines, references):
    """Batches from several threads are in flight together; a call with another pooling waits its turn."""
    runner = engines("llama")
    layers = [0, 2, runner.num_layers]
    calls = [(varied_prompts(40, seed=10 + i), "mean" if i == 2 else "last") for i in range(4)]
    with ThreadPoolExecutor(len(calls)) as pool:
        results = list(pool.map(lambda call: runner.extract(call[0], layers, call[1]), calls))
    for (prompts, pooling), ours in zip(calls, results):
        assert sorted(ours.kept) == list(range(len(prompts)))
        assert_parity(ours, references("llama").extract(prompts, layers, pooling), layers)


def test_by_default_the_engine_core_has_a_process_of_its_own_on_a_gpu_and_shares_this_one_on_a_cpu(engines):
    """Unasked, the engine loop leaves the caller's interpreter lock on a GPU (where it bounds long runs) and
    stays in the caller's process on a CPU (same cores either way; it starts sooner)."""
    from vllm.v1.engine.core_client import InprocClient, MPClient

    from layertap.runner.vllm_seam import on_cpu

    runner = engines("llama")
    assert runner.options.engine_process is None
    client = runner.llm.llm_engine.engine_core
    assert isinstance(client, InprocClient if on_cpu() else MPClient), type(client)
    assert runner.engine_process is not on_cpu()


def test_the_engine_thread_counts_its_steps_and_the_time_it_waited_for_work(engines):
    """A run's summary tells whether the engine or the host bounded it from these counters."""
    runner = engines("llama")
    before = runner.activity()
    time.sleep(0.3)  # nothing queued: the engine waits
    # A small batch: its released buffer is too small for the host-buffer test's later batches.
    runner.extract(varied_prompts(5, seed=4), [4], "last").release()
    after = runner.activity()
    assert after.steps > before.steps and after.stepping_s > before.stepping_s
    assert after.idle_s - before.idle_s >= 0.25


def test_the_engine_thread_tells_how_many_prompts_vllm_holds_unfinished(engines):
    """Read while a batch runs, the count rises to at most the batch's prompts; once it is back, none."""
    import threading

    runner = engines("llama")
    prompts = varied_prompts(64, seed=5)
    seen = []
    batch = threading.Thread(target=lambda: runner.extract(prompts, [4], "last").release())
    batch.start()
    while batch.is_alive():
        seen.append(runner.activity().in_engine)
        time.sleep(0.001)
    batch.join()
    assert 0 < max(seen) <= len(prompts)
    assert runner.activity().in_engine == 0


def test_reserved_host_buffers_are_mapped_by_the_worker_before_any_batch_uses_them(engines):
    """Page-locking a buffer inside an engine step would stall it: reserving maps them up front."""
    import os

    runner = engines("gemma")
    before = set(runner.mapped_host_buffers())
    runner.reserve_host_buffers(700, runner.num_layers + 1, 2)  # larger than any batch so far
    new = set(runner.mapped_host_buffers()) - before
    assert len(new) == 2 and all(os.path.exists(path) for path in new)
    runner.reserve_host_buffers(700, runner.num_layers + 1, 2)  # they exist: nothing more to map
    assert set(runner.mapped_host_buffers()) - before == new


def test_host_buffers_are_reused_once_handed_back(engines):
    """Each batch's vectors land in a host buffer that is reused after the caller releases it."""
    runner = engines("llama")
    layers = [1, runner.num_layers]
    first = runner.extract(varied_prompts(30, seed=30), layers, "last")
    allocated = runner.host_buffers_allocated
    kept_copy = {layer: first.vectors[layer].copy() for layer in layers}
    first.release()
    assert first.vectors == {}
    second = runner.extract(varied_prompts(20, seed=31), layers, "last")  # smaller: fits the released one
    assert runner.host_buffers_allocated == allocated
    third = runner.extract(varied_prompts(10, seed=32), layers, "last")  # second still held: a new buffer
    assert runner.host_buffers_allocated == allocated + 1
    assert not np.shares_memory(second.vectors[layers[0]], third.vectors[layers[0]])
    assert all(np.isfinite(as_float32(kept_copy[layer])).all() for layer in layers)
    second.release()
    third.release()


# Tests below start and close engines of their own; they come last because closing an in-process engine
# shuts down vLLM's process-wide parallel state, which the shared engines above also use.

def test_a_failed_engine_fails_every_waiting_call_with_a_clear_error(model_dirs):
    """An error inside an engine step reaches every caller instead of leaving them waiting."""
    from layertap.runner.vllm_runner import EngineOptions, VllmRunner

    runner = VllmRunner(EngineOptions(model=model_dirs["llama"], kv_cache_memory_bytes=64 * 2**20))
    try:
        runner.extract(["warm"], [1], "last")

        def broken_step():
            raise RuntimeError("device lost")

        runner.llm.llm_engine.step = broken_step  # the fault, injected at the engine boundary
        with pytest.raises(EngineError, match="device lost"):
            runner.extract(varied_prompts(5), [1], "last")
        with pytest.raises(EngineError, match="failed earlier"):
            runner.extract(["again"], [1], "last")
    finally:
        runner.close()


def test_out_of_memory_inside_an_engine_step_splits_the_call_onto_a_fresh_engine(model_dirs, references):
    """The device running out of memory mid-step takes the engine down; the halves run on a new one."""
    import torch

    from layertap.runner.vllm_runner import EngineOptions, VllmRunner
    from layertap.runner.split_on_oom import extract_splitting

    options = EngineOptions(model=model_dirs["llama"], kv_cache_memory_bytes=64 * 2**20)
    started = [VllmRunner(options)]
    try:
        started[0].extract(["warm"], [1], "last")

        def out_of_memory():
            raise torch.OutOfMemoryError("out of memory (injected at the engine boundary)")

        started[0].llm.llm_engine.step = out_of_memory

        def renew():
            if not started[-1].healthy():
                started.append(VllmRunner(options))
            return started[-1]

        prompts = varied_prompts(6, seed=5)
        ours = extract_splitting(started[0], prompts, [1, 2], "last", renew=renew)
        assert len(started) == 2 and sorted(ours.kept) == list(range(len(prompts)))
        assert_parity(ours, references("llama").extract(prompts, [1, 2], "last"), [1, 2])
    finally:
        for runner in started:
            runner.close()


def test_an_eager_engine_is_tapped_after_loading_and_matches_too(model_dirs, references):
    """enforce_eager=True (how tensor-parallel engines run) hooks the loaded model instead of its graph."""
    from layertap.runner.vllm_runner import EngineOptions, VllmRunner

    runner = VllmRunner(EngineOptions(model=model_dirs["qwen3"], dtype=DTYPE, enforce_eager=True,
                                      max_num_batched_tokens=STEP_TOKENS, kv_cache_memory_bytes=64 * 2**20))
    try:
        assert not runner.compiled
        prompts = varied_prompts(40, seed=21)
        layers = list(range(runner.num_layers + 1))
        for pooling in ("last", "mean"):
            assert_parity(runner.extract(prompts, layers, pooling),
                          references("qwen3").extract(prompts, layers, pooling), layers)
    finally:
        runner.close()


def test_a_compiled_model_without_the_tap_is_refused(model_dirs, monkeypatch):
    """Hooks added after torch.compile traced a model never run: such an engine (started outside
    VllmRunner, or given a compiled graph cached without the tap) is refused instead of returning garbage."""
    from functools import partial

    from vllm import LLM

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    llm = LLM(model=model_dirs["llama"], runner="pooling", convert="embed", dtype=DTYPE,
              compilation_config={"cudagraph_mode": "NONE"}, gpu_memory_utilization=0.3,
              kv_cache_memory_bytes=64 * 2**20)
    try:
        from layertap.runner.capture import CaptureSpec

        spec = CaptureSpec(layers=(0, 1), num_layers=4, hidden_size=128, pooling="last")
        with pytest.raises(Exception, match="does not call layertap's capture hooks"):
            llm.collective_rpc(partial(vllm_seam.install_capture, spec=spec))
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_the_parity_reference_stays_beside_its_engine_while_batches_run_and_goes_with_it(model_dirs, references):
    """`reference` computes transformers' vectors in the engine's process while batches run, with one model
    load for every call on that engine; closing the engine frees it."""
    from layertap.runner.vllm_runner import EngineOptions, VllmRunner

    runner = VllmRunner(EngineOptions(model=model_dirs["llama"], dtype=DTYPE, max_num_batched_tokens=STEP_TOKENS,
                                      kv_cache_memory_bytes=64 * 2**20))
    try:
        layers = [0, 2, runner.num_layers]
        with ThreadPoolExecutor(3) as pool:
            batches = [pool.submit(runner.extract, varied_prompts(40, seed=50 + i), layers, "last") for i in (0, 1)]
            for seed in (52, 53):  # two runs' samples
                sample = varied_prompts(4, seed=seed)
                got = runner.reference(sample, layers, "last")
                want = references("llama").extract(sample, layers, "last").vectors
                for layer in layers:
                    np.testing.assert_allclose(got[layer], as_float32(want[layer]), rtol=0, atol=MAX_ABS_ERROR or 1e-2)
            assert all(len(batch.result().kept) == 40 for batch in batches)
        assert runner.parity_reference.loads == 1 and runner.parity_reference.loaded
    finally:
        runner.close()
    assert not runner.parity_reference.loaded


def test_an_engine_core_in_its_own_process_fills_shared_buffers_and_matches(model_dirs, references):
    """engine_process=True: the worker, in another process, copies vectors into buffers it maps by path;
    rows map back to their prompts across calls, poolings and layer sets."""
    import os

    from layertap.runner.vllm_runner import EngineOptions, VllmRunner

    runner = VllmRunner(EngineOptions(model=model_dirs["llama"], dtype=DTYPE, engine_process=True,
                                      max_num_batched_tokens=STEP_TOKENS, kv_cache_memory_bytes=64 * 2**20))
    try:
        assert runner.engine_process and os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
        runner.reserve_host_buffers(50, 3, 2)  # the worker maps them now, not inside a step
        reserved = sorted(s.path for s in runner._host._idle)
        assert len(reserved) == 2 and runner.mapped_host_buffers() == reserved
        for seed, pooling, layers in ((40, "last", [0, 2, 4]), (41, "mean", [1, 4]), (42, "last", [3])):
            prompts = varied_prompts(50, seed=seed)
            ours = runner.extract(prompts, layers, pooling)
            assert sorted(ours.kept) == list(range(len(prompts)))
            assert_parity(ours, references("llama").extract(prompts, layers, pooling), layers)
            ours.release()
        directory = runner._host.directory
    finally:
        runner.close()
    assert not os.path.exists(directory)


def test_a_bfloat16_engine_hands_last_tokens_over_in_half_the_bytes_and_means_in_float32(model_dirs):
    """Last-token vectors reach the host in the engine's precision: a bfloat16 batch fills a buffer half the
    size of a float32 one, holds the values the engine computed (parity with transformers in bfloat16), and
    its buffer serves the next batch. Means are summed in float32 and handed over so."""
    import os

    from layertap.parts.bfloat16 import is_bfloat16
    from layertap.runner.hf_runner import HfRunner
    from layertap.runner.vllm_runner import EngineOptions, VllmRunner

    runner = VllmRunner(EngineOptions(model=model_dirs["llama"], dtype="bfloat16",
                                      max_num_batched_tokens=STEP_TOKENS, kv_cache_memory_bytes=64 * 2**20))
    reference = HfRunner(model_dirs["llama"], "bfloat16", device=REFERENCE_DEVICE)

    def buffer_sizes():
        return sorted(os.path.getsize(entry.path) for entry in os.scandir(runner._host.directory))

    try:
        layers = list(range(runner.num_layers + 1))
        one_batch = len(layers) * 40 * runner.hidden_size
        for seed in (50, 51):
            prompts = varied_prompts(40, seed=seed)
            ours = runner.extract(prompts, layers, "last")
            assert all(is_bfloat16(ours.vectors[layer]) for layer in layers)
            assert buffer_sizes() == [one_batch * 2]  # one buffer, reused by the second batch
            assert_parity(ours, reference.extract(prompts, layers, "last"), layers, 0.99, None)
            ours.release()
        means = runner.extract(prompts, layers, "mean")
        assert all(means.vectors[layer].dtype == np.float32 for layer in layers)
        assert buffer_sizes() == [one_batch * 2, one_batch * 4]
        assert_parity(means, reference.extract(prompts, layers, "mean"), layers, 0.99, None)
        means.release()
    finally:
        reference.close()
        runner.close()
