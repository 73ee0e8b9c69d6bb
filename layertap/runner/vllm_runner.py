"""The hooked vLLM runner: prefill only, every requested layer captured, one engine per process.

Prompts are tokenised here (one fast batch call) and handed to vLLM as token ids, so each output can be
checked against the ids it was asked for: vLLM returns outputs under its own request ids and this runner
verifies the match instead of trusting positions.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from dataclasses import dataclass

import numpy as np
import torch

from layertap.errors import EngineError
from layertap.model_fingerprint import read_model_info
from layertap.runner.base import POOLINGS, Extraction
from layertap.runner.vllm_compat import CaptureSpec, check_vllm, install_capture

log = logging.getLogger(__name__)

DTYPES = ("float32", "float16", "bfloat16")
# Capture buffers hold one engine step of every hooked layer; keep them well under 2 GiB on a GPU.
CAPTURE_BUFFER_BYTES = 1536 * 2**20
CPU_KV_CACHE_BYTES = 2**30


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


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


class VllmRunner:
    """Owns one vLLM engine started as a pooling model with the layer-capture pooler swapped in."""

    def __init__(self, options: EngineOptions):
        self.options = options
        self.vllm_version = check_vllm()
        info = read_model_info(options.model)
        self.num_layers, self.hidden_size = info.num_layers, info.hidden_size
        if options.dtype not in DTYPES:
            raise EngineError(f"dtype: expected one of {', '.join(DTYPES)}, got {options.dtype!r}")
        on_cpu = _on_cpu()
        # Keep the engine core in this process: the capture pooler is installed by calling into the
        # workers, which across a process boundary would need vLLM's pickle-based serialisation.
        # Tensor-parallel workers still get their own processes from vLLM's executor.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from transformers import AutoTokenizer
        from vllm import LLM

        self.tokenizer = AutoTokenizer.from_pretrained(
            options.model, trust_remote_code=options.trust_remote_code
        )
        kwargs = dict(
            model=options.model,
            runner="pooling",
            convert="embed",
            dtype=options.dtype,
            # Hooks run as plain Python in eager mode; prefill-only steps gain little from CUDA graphs.
            enforce_eager=True if options.enforce_eager is None else options.enforce_eager,
            tensor_parallel_size=options.tensor_parallel_size,
            trust_remote_code=options.trust_remote_code,
            gpu_memory_utilization=options.gpu_memory_utilization or (0.3 if on_cpu else 0.9),
            seed=options.seed,
            enable_prefix_caching=True,
        )
        if on_cpu and options.kv_cache_memory_bytes is None and options.gpu_memory_utilization is None:
            # The CPU worker sizes its KV cache from memory the process has not used yet, which leaves
            # nothing for a second engine in the same process; a fixed size does not depend on that.
            kwargs["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
        for name in ("max_num_batched_tokens", "max_model_len", "max_num_seqs", "load_format",
                     "kv_cache_memory_bytes"):
            if getattr(options, name) is not None:
                kwargs[name] = getattr(options, name)
        if options.max_num_batched_tokens is None:
            kwargs["max_num_batched_tokens"] = self._default_step_tokens()
        log.info("starting vLLM %s on %s", self.vllm_version, options.model)
        try:
            self.llm = LLM(**kwargs)
        except Exception as exc:
            raise EngineError(f"vLLM could not start on {options.model}: {exc}") from exc
        config = self.llm.llm_engine.vllm_config
        self.max_model_len = config.model_config.max_model_len
        self.step_tokens = config.scheduler_config.max_num_batched_tokens
        self._capture: tuple[tuple[int, ...], str] | None = None
        self._pooler = None
        self._lock = threading.Lock()
        self.capture_buffer_bytes = 0

    def _default_step_tokens(self) -> int:
        per_token = (self.num_layers + 1) * self.hidden_size * (4 if self.options.dtype == "float32" else 2)
        return int(max(512, min(8192, CAPTURE_BUFFER_BYTES // per_token)) // 256 * 256)

    def _ensure_capture(self, layers: tuple[int, ...], pooling: str) -> None:
        if self._capture == (layers, pooling):
            return
        spec = CaptureSpec(layers=layers, num_layers=self.num_layers, hidden_size=self.hidden_size,
                           pooling=pooling, max_tokens=self.step_tokens + 256)
        sizes = self.llm.apply_model(functools.partial(install_capture, spec=spec))  # pickled for TP workers
        self.capture_buffer_bytes = max(sizes)
        self._capture = (layers, pooling)
        # With one worker in this process the pooler object is ours to hand a host buffer to.
        if self.options.tensor_parallel_size == 1:
            self._pooler = self.llm.apply_model(lambda model: model.pooler)[0]

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return self.tokenizer(texts, add_special_tokens=True)["input_ids"]

    def extract(
        self, texts: list[str], layers: list[int], pooling: str, truncate_to: int | None = None
    ) -> Extraction:
        """Pool `layers` (HF indices, sorted) for `texts`. Over-long prompts are rejected, or, when the caller
        asks for it, cut to their first `truncate_to` tokens."""
        with self._lock:  # one engine, one caller at a time; callers may write results concurrently
            return self._extract(texts, layers, pooling, truncate_to)

    def _extract(self, texts: list[str], layers: list[int], pooling: str, truncate_to: int | None) -> Extraction:
        from vllm import PoolingParams

        if pooling not in POOLINGS:
            raise EngineError(f"pooling: expected one of {', '.join(POOLINGS)}, got {pooling!r}")
        layers = tuple(sorted(set(layers)))
        if not texts:
            return Extraction({layer: np.empty((0, self.hidden_size), np.float32) for layer in layers}, [])
        self._ensure_capture(layers, pooling)
        if truncate_to is not None and not 0 < truncate_to <= self.max_model_len:
            raise EngineError(f"truncate_to {truncate_to} is outside 1..max_model_len {self.max_model_len}")
        token_ids = self.tokenize(texts)
        kept, rejected, truncated = [], {}, {}
        for i, ids in enumerate(token_ids):
            if truncate_to is not None and len(ids) > truncate_to:
                truncated[i] = len(ids)
                token_ids[i] = ids[:truncate_to]
                kept.append(i)
            elif len(ids) > self.max_model_len:
                rejected[i] = f"too long: {len(ids)} tokens > max_model_len {self.max_model_len}"
            else:
                kept.append(i)
        # Mean pooling needs every prompt token's hidden state, so it must not reuse cached prefixes.
        params = PoolingParams(task="embed", skip_reading_prefix_cache=pooling == "mean")
        prompts = [{"prompt_token_ids": token_ids[i]} for i in kept]
        sink = self._open_sink(len(layers), len(kept)) if self._pooler is not None else None
        try:
            outputs = self.llm.encode(prompts, pooling_params=params, pooling_task="embed", use_tqdm=False)
        finally:
            if sink is not None:
                self._pooler.sink = None
        if len(outputs) != len(kept):
            raise EngineError(f"vLLM returned {len(outputs)} outputs for {len(kept)} prompts")
        for i, output in zip(kept, outputs):
            if list(output.prompt_token_ids) != token_ids[i]:
                raise EngineError(f"vLLM output {output.request_id} does not belong to prompt {i}")
        num_tokens = sum(len(token_ids[i]) for i in kept)
        if sink is None:
            stacked = torch.stack([output.outputs.data for output in outputs], dim=1).float().numpy()
            return Extraction(self._by_layer(stacked, layers), kept, rejected, num_tokens, truncated)
        # Each output names the sink slot its vectors were copied to; rows stay in slot order and
        # `kept` is permuted to match, so no host-side gather of the vectors is needed.
        slots = torch.cat([output.outputs.data.flatten() for output in outputs]).tolist()
        if sorted(slots) != list(range(len(kept))):
            raise EngineError("capture slots do not cover every prompt exactly once")
        order = [0] * len(kept)
        for i, slot in zip(kept, slots):
            order[slot] = i
        if torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()  # the asynchronous copies into the sink
        return Extraction(self._by_layer(sink.numpy(), layers), order, rejected, num_tokens, truncated)

    def _by_layer(self, stacked: np.ndarray, layers: tuple[int, ...]) -> dict[int, np.ndarray]:
        if stacked.shape[0] != len(layers) or stacked.shape[2] != self.hidden_size:
            raise EngineError(f"capture returned shape {stacked.shape}, expected "
                              f"({len(layers)}, n, {self.hidden_size})")
        return {layer: stacked[j] for j, layer in enumerate(layers)}

    def _open_sink(self, num_layers: int, num_prompts: int) -> torch.Tensor:
        """A fresh host buffer for this call (pinned on a GPU, from torch's caching host allocator)."""
        sink = torch.empty((num_layers, num_prompts, self.hidden_size), dtype=torch.float32,
                           pin_memory=torch.cuda.is_available())
        self._pooler.sink, self._pooler.sink_used = sink, 0
        return sink

    def healthy(self) -> bool:
        """Whether the engine still answers: a one-prompt extraction with the capture already installed."""
        if getattr(self, "llm", None) is None:
            return False
        if self._capture is None:
            return True
        try:
            self.extract(["."], list(self._capture[0]), self._capture[1])
        except Exception:  # noqa: BLE001 - any failure means the engine cannot be trusted with a batch
            log.warning("engine failed its health probe", exc_info=True)
            return False
        return True

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # pragma: no cover - best effort on teardown
            log.debug("engine shutdown raised", exc_info=True)
