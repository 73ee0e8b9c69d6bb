"""The pooler layertap swaps into vLLM's pooling model: per finished request, its captured layers, pooled,
go straight from the device into the host buffer the request names.

Vectors go from the device into host buffers shared with the caller's process (`host_buffers`): each
request names its buffer in its pooling parameters (`sink_reference`), and vLLM's outputs carry only the
row a request's vectors went to. What the pooler reads of vLLM's per-step metadata comes through
`vllm_seam.PoolingStep`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from layertap.errors import EngineError
from layertap.runner import vllm_seam
from layertap.runner.capture import CaptureSpec, LayerTap
from layertap.runner.host_buffers import view_as


@dataclass
class Sink:
    """One caller's batch in a shared host buffer, [layers, prompts, hidden]; rows are filled in the order
    its requests finish."""

    vectors: torch.Tensor | None  # None on ranks that do not copy
    used: int = 0


def sink_reference(path: str, batch: str, prompts: int, dtype: torch.dtype) -> list:
    """What a request carries to the pooler in its pooling parameters (`vllm_seam.pooling_params`): its
    batch's buffer, its size and the precision its vectors are stored in there."""
    return [path, batch, prompts, str(dtype).removeprefix("torch.")]


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
    buffer its pooling parameters name, and returns the row they went to.

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
        return vllm_seam.no_pooling_updates()

    def forward(self, hidden_states: torch.Tensor, pooling_metadata) -> torch.Tensor:
        if self.tap.sites_per_forward != self.tap.num_layers:
            raise EngineError(
                f"the model called layertap's capture op {self.tap.sites_per_forward} times in its last "
                f"forward, not once per decoder block ({self.tap.num_layers}): its vectors would be misplaced")
        step = vllm_seam.PoolingStep(pooling_metadata)
        buffer, slot = self.tap.buffer, self.tap.slot
        final = self.tap.reduce(hidden_states, None) if self.spec.num_layers in self.spec.layers else None
        views = [buffer[slot[layer], :step.num_requests] if layer in slot else final[:step.num_requests]
                 for layer in self.spec.layers]
        pooled = torch.stack(views, dim=0)  # [layers, requests, hidden]
        if self.spec.pooling == "mean":
            pooled = self._mean(pooled, step)
        return self._to_sinks(pooled, step)

    def _to_sinks(self, pooled: torch.Tensor, step: vllm_seam.PoolingStep) -> torch.Tensor:
        """Copy finished requests' vectors into their callers' host buffers; return their rows.

        vLLM then carries one integer per request instead of a [layers, hidden] tensor, and each host
        buffer is already laid out layer by layer for the Parquet writer.
        """
        rows = [-1] * pooled.shape[1]
        by_batch: dict[tuple, list[int]] = {}
        for r, done in enumerate(step.finished()):
            if done:
                reference = step.sink(r)
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

    def _mean(self, sums: torch.Tensor, step: vllm_seam.PoolingStep) -> torch.Tensor:
        """Turn this step's per-request sums into means, carrying partial sums of split prompts."""
        counts = step.scheduled_tokens()
        prompt_lens = step.prompt_lens()
        sums = sums.float()
        for r, done in enumerate(step.finished()):
            if done and counts[r] == prompt_lens[r]:
                sums[:, r] /= counts[r]  # the whole prompt ran in this step: nothing to carry
                continue
            cache = step.carried(r)
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

