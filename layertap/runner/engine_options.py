"""What fixes an engine instance, readable without importing torch or vLLM.

The process that runs the flow only needs these to choose and start a runner: with the runner in a process
of its own (`runner_process`), the flow's process never loads vLLM, nor torch unless it runs the parity
sample against transformers.
"""

from __future__ import annotations

from dataclasses import dataclass

from layertap.runner.vllm_seam import vllm_is_cpu_build


# Engine options that are not run options: the run's model and dtype are options of their own, and the rest
# are set by benchmarks only. Every other field is the run option of the same name (`Settings.engine_options`).
NOT_RUN_OPTIONS = ("model", "dtype", "max_num_seqs", "kv_cache_memory_bytes", "seed")


@dataclass(frozen=True)
class EngineOptions:
    """Settings that fix an engine instance: changing any of them needs a new engine."""

    model: str
    dtype: str = "float32"
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    gpu_memory_utilization: float | None = None
    tensor_parallel_size: int = 1
    enforce_eager: bool | None = None
    trust_remote_code: bool = False
    max_num_seqs: int | None = None
    load_format: str | None = None
    kv_cache_memory_bytes: int | None = None
    seed: int = 0
    # vLLM's engine core in a process of its own, forked from a single-threaded process and spawned from a
    # multi-threaded one such as a Prefect worker (`engine_core_start`). None: on a GPU only.
    engine_process: bool | None = None
    # The runner itself (vLLM's frontend: tokenising, adding requests, taking outputs) in a process of its
    # own, apart from the caller's Python (`runner_process`). None: on a GPU only.
    runner_process: bool | None = None

    def runner_in_own_process(self) -> bool:
        """Whether this engine's runner is started in a process of its own."""
        return not vllm_is_cpu_build() if self.runner_process is None else self.runner_process

