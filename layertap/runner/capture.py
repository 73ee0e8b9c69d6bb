"""The capture op: reading every decoder layer's residual stream inside vLLM's compiled model.

A `LayerTap` puts a hook on every decoder block that calls the custom op `layertap::capture_site`.
Attached while vLLM loads the model (before torch.compile traces it; `vllm_seam` does that), the op
becomes part of the compiled graph and runs eagerly inside it, every step, so capture keeps vLLM's
compiled kernels. The op reduces each layer's residual stream to one row per request of the step (the
last token's row, or the sum of the request's rows for mean pooling), so the capture buffer holds
[layers, max_num_seqs, hidden] whatever the step's token count.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn as nn

from layertap.errors import EngineError
from layertap.runner.vllm_seam import decoder_layers, split_block_input, split_block_output
from layertap.runner.worker_buffers import SharedBuffers


@dataclass(frozen=True)
class CaptureSpec:
    """What the pooler returns per request: `layers` (HF indices, sorted) pooled by `pooling`."""

    layers: tuple[int, ...]
    num_layers: int
    hidden_size: int
    pooling: str  # "last" | "mean"



# The tap whose model is running in this thread: set by hooks on the (uncompiled) top-level model around
# every forward, read by the capture op. A constant id baked into the compiled graph would not do:
# vLLM caches compiled graphs on disk and reuses them in other processes.
_running = threading.local()


@torch.library.custom_op(
    "layertap::capture_site", mutates_args=("token",),
    schema="(Tensor hidden, Tensor? residual, Tensor(a!) token) -> ()",
)
def _capture_site(hidden, residual, token):
    """Hand the next site's residual stream to the running tap. `token` is declared as written so that
    torch.compile keeps the calls, in order (an op with no outputs and no writes would be removed as dead
    code). The call carries no site number: every decoder block then compiles to the same graph, which
    torch.compile's cache compiles once instead of once per block."""
    tap = getattr(_running, "tap", None)
    if tap is not None:
        tap.capture_next(hidden, residual)


@_capture_site.register_fake
def _capture_site_fake(hidden, residual, token):
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
        self.next_site = 0  # sites are numbered by the order of their calls within one forward
        # Calls counted at the end of the last forward that made any; None until one did.
        self.sites_per_forward: int | None = None
        self.forwards = 0  # forwards of the whole model since the tap was attached
        self.spec: CaptureSpec | None = None
        self.slot: dict[int, int] = {}
        self.buffer: torch.Tensor | None = None
        self.query_start_loc: torch.Tensor | None = None
        self.max_reqs = 0
        # The caller's host buffers as this worker maps them (page-locked on a GPU).
        self.buffers = SharedBuffers(pin=self.token.is_cuda)

        def running(module, args):
            _running.tap = self
            self.next_site = 0
            self.forwards += 1

        def finished(module, args, output):
            _running.tap = None  # another model run later in this thread must not write here
            if self.next_site:
                self.sites_per_forward = self.next_site

        def block_input(module, args, kwargs):
            hidden, residual = split_block_input(args, kwargs)
            torch.ops.layertap.capture_site(hidden, residual, self.token)

        # The hooks stay for the model's lifetime (a compiled graph keeps them anyway): no handles kept.
        model.register_forward_pre_hook(running)
        model.register_forward_hook(finished, always_call=True)
        layers[0].register_forward_pre_hook(block_input, with_kwargs=True)
        def block_output(module, args, output):
            hidden, residual = split_block_output(output)
            torch.ops.layertap.capture_site(hidden, residual, self.token)

        for layer in layers[:-1]:
            layer.register_forward_hook(block_output)

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

    def capture_next(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
        """Site 0 is the first call of a forward, site k the (k+1)-th: the blocks run in order."""
        site = self.next_site
        self.next_site += 1
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
