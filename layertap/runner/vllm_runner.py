"""The hooked vLLM runner: prefill only, every requested layer captured, one engine per process.

Prompts are tokenised by the caller (one fast batch call) and handed to vLLM as token ids, so each output
can be checked against the ids it was asked for: vLLM returns outputs under its own request ids and this
runner verifies the match instead of trusting positions.

vLLM's engine core runs in a process of its own on a GPU and in this process on a CPU, unless
`EngineOptions.engine_process` says otherwise. In its own process (vLLM's own `LLM` layout: scheduling, the
model and layertap's pooler run there, while this process tokenises, builds requests and writes results)
the engine loop does not compete with the caller's Python for one interpreter lock, which is what bounds a
long run on a GPU host; on a CPU both share the same few cores, and an in-process engine
starts sooner. Either way captured vectors reach this process through
shared host buffers (`host_buffers`), not through vLLM's output messages.

One thread owns the engine and keeps it fed: `extract` calls from any number of threads queue their
prompts, the engine thread adds them to vLLM as soon as they arrive and steps the engine while any
request is unfinished. Batches therefore flow into each other without draining the engine between them,
and a caller writes its finished batch to disk while the engine already computes the next one.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from layertap.parts.bfloat16 import from_bits
from layertap.errors import EngineError
from layertap.model.fingerprint import read_model_info
from layertap.runner.base import POOLINGS, EngineActivity, Extraction
from layertap.runner.engine_core_start import engine_core_start
from layertap.runner.engine_options import EngineOptions
from layertap.runner import vllm_seam
from layertap.runner.hf_runner import ParityReference
from layertap.runner.host_buffers import HostBuffers, Segment
from layertap.runner.pooler import sink_reference

log = logging.getLogger(__name__)

# Last-token vectors reach the host in the engine's own precision: half-precision engines move and hold
# half the bytes. Means are summed in float32 and kept so: a mean carries more precision than its inputs.
HOST_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPES = tuple(HOST_DTYPES)


@dataclass
class _Job:
    """One `extract` call in flight: its prompts, where their vectors go, and who is waiting."""

    key: str
    capture: tuple[tuple[int, ...], str]
    token_ids: list[list[int]]
    segment: Segment  # the shared host buffer its vectors are copied into
    requests: list = field(default_factory=list)  # vLLM's requests, built in the caller's thread
    future: Future = field(default_factory=Future)
    slots: list[int | None] = field(default_factory=list)
    remaining: int = 0


@dataclass
class _Call:
    """Work for the engine thread between steps (calls into the workers must not race with a step)."""

    fn: Callable[[], Any]
    future: Future = field(default_factory=Future)

    def run(self) -> None:
        try:
            self.future.set_result(self.fn())
        except Exception as exc:  # noqa: BLE001 - handed to the caller
            self.future.set_exception(exc)


def _as_numpy(vectors: torch.Tensor) -> np.ndarray:
    """A host buffer's view as numpy, sharing its memory (bfloat16 as `layertap.parts.bfloat16` patterns)."""
    if vectors.dtype == torch.bfloat16:
        return from_bits(vectors.view(torch.int16).numpy())
    return vectors.numpy()


def default_gpu_memory_share(options: EngineOptions) -> float:
    """The engine's share of the GPU when none is asked for: vLLM's 0.9, less the room the parity reference
    needs to run beside it in the engine's dtype (`hf_runner.reference_bytes`, plus `ENGINE_MARGIN_BYTES`
    for the reference's own CUDA context and what vLLM takes beyond its share), as long as the engine keeps
    at least half the device. Extraction is prefill only: the KV cache holds only the prompts in flight, so a
    smaller share costs no speed."""
    from layertap.runner.hf_runner import ENGINE_MARGIN_BYTES, reference_bytes

    needed = reference_bytes(options.model, options.dtype) if options.load_format != "dummy" else None
    if not needed:
        return 0.9
    share = 1.0 - (needed + ENGINE_MARGIN_BYTES) / vllm_seam.device_total_memory()
    return round(min(0.9, share), 3) if share >= 0.5 else 0.9


class VllmRunner:
    """Owns one vLLM engine started as a pooling model with the layer-capture pooler swapped in."""

    def __init__(self, options: EngineOptions):
        self.options = options
        self.vllm_version = vllm_seam.check_vllm()
        info = read_model_info(options.model)
        self.num_layers, self.hidden_size = info.num_layers, info.hidden_size
        if options.dtype not in DTYPES:
            raise EngineError(f"dtype: expected one of {', '.join(DTYPES)}, got {options.dtype!r}")
        on_cpu = vllm_seam.on_cpu()
        self.engine_process = (not on_cpu) if options.engine_process is None else options.engine_process
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(
            options.model, trust_remote_code=options.trust_remote_code
        )
        # The model is tapped while it loads (`vllm_seam.CaptureWorker`), so torch.compile traces the
        # capture into its graph. Tensor-parallel engines run eagerly unless asked otherwise.
        eager = options.tensor_parallel_size > 1 if options.enforce_eager is None else options.enforce_eager
        share = options.gpu_memory_utilization or (0.3 if on_cpu else default_gpu_memory_share(options))
        self.compiled = not eager
        log.info("starting vLLM %s on %s", self.vllm_version, options.model)
        try:
            self.llm = vllm_seam.start_engine(options, self.engine_process, share, eager)
        except Exception as exc:
            raise EngineError(f"vLLM could not start on {options.model}: {exc}") from exc
        self.max_model_len, self.step_tokens = vllm_seam.engine_limits(self.llm)
        # "fork" or "spawn" (`engine_core_start`), None for an engine core in this process.
        self.engine_core_start = engine_core_start() if self.engine_process else None
        self._tasks = vllm_seam.supported_tasks(self.llm)  # asked once, here: it calls into the engine
        self.capture_buffer_bytes = 0
        self._capture: tuple[tuple[int, ...], str] | None = None
        self._host = HostBuffers()
        self._ids = itertools.count()
        self._inbox: queue.Queue[_Job | _Call | None] = queue.Queue()
        # Held while a job is queued and while closing: no job lands in the inbox after the close signal,
        # where no engine thread would ever answer it.
        self._gate = threading.Lock()
        self._closed = False
        self._failure: BaseException | None = None
        self._activity = EngineActivity()
        self._idle_since: float | None = None  # set while the engine thread waits for work
        self._activity_lock = threading.Lock()
        self.parity_reference = ParityReference(options.model, options.dtype)  # loaded when first asked
        self._thread = threading.Thread(target=self._serve, name="layertap-engine", daemon=True)
        self._thread.start()

    # --- the caller's side ----------------------------------------------------------------------
    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return self.tokenizer(texts, add_special_tokens=True)["input_ids"]

    def extract(
        self, texts: list[str], layers: list[int], pooling: str, truncate_to: int | None = None
    ) -> Extraction:
        """Pool `layers` (HF indices, sorted) for `texts`. Over-long prompts are rejected, or, when the caller
        asks for it, cut to their first `truncate_to` tokens.

        Safe to call from several threads at once: their prompts share the engine's steps.
        """
        if pooling not in POOLINGS:
            raise EngineError(f"pooling: expected one of {', '.join(POOLINGS)}, got {pooling!r}")
        layers = tuple(sorted(set(layers)))
        if not texts:
            return Extraction(self._no_vectors(layers), [])
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
        num_tokens = sum(len(token_ids[i]) for i in kept)
        if not kept:
            return Extraction(self._no_vectors(layers), [], rejected, 0, truncated)
        with self._gate:
            self._check_usable()
            llm = self.llm
        vectors, segment = self._host.take((len(layers), len(kept), self.hidden_size), self.host_dtype(pooling))
        job = _Job(key=f"j{next(self._ids)}", capture=(layers, pooling),
                   token_ids=[token_ids[i] for i in kept], segment=segment)
        try:
            job.requests = vllm_seam.prepare_requests(llm, [f"{job.key}:{i}" for i in range(len(kept))],
                                                      job.token_ids, self._params(job), self._tasks)
        except Exception as exc:
            self._host.give_back(segment)  # nothing was queued on the device yet
            raise EngineError(f"vLLM refused the batch's prompts: {exc}") from exc
        # After a failure the buffer is not handed back: copies into it may still be queued on the device.
        self._submit(job)
        job.future.result()
        # Rows are in the order requests finished; `kept` is permuted to match, so no host-side
        # gather of the vectors is needed. vLLM hands a step's outputs on only once the copies into the
        # host buffer have landed.
        if sorted(job.slots) != list(range(len(kept))):
            raise EngineError("capture slots do not cover every prompt exactly once")
        order = [0] * len(kept)
        for position, slot in enumerate(job.slots):
            order[slot] = kept[position]
        return Extraction(self._by_layer(_as_numpy(vectors), layers), order, rejected, num_tokens, truncated,
                          release_fn=functools.partial(self._host.give_back, segment), buffer=segment.path)

    def _in_engine_thread(self, fn: Callable[[], Any]) -> Any:
        call = _Call(fn)
        self._submit(call)
        return call.future.result()

    def _submit(self, job: _Job | _Call) -> None:
        with self._gate:
            self._check_usable()
            self._inbox.put(job)

    def _check_usable(self) -> None:
        if self._failure is not None:
            raise EngineError(f"the engine failed earlier: {self._failure}") from self._failure
        if self._closed or self.llm is None:
            raise EngineError("the engine is closed")

    def _no_vectors(self, layers: tuple[int, ...]) -> dict[int, np.ndarray]:
        return {layer: np.empty((0, self.hidden_size), np.float32) for layer in layers}

    def _by_layer(self, stacked: np.ndarray, layers: tuple[int, ...]) -> dict[int, np.ndarray]:
        if stacked.shape[0] != len(layers) or stacked.shape[2] != self.hidden_size:
            raise EngineError(f"capture returned shape {stacked.shape}, expected "
                              f"({len(layers)}, n, {self.hidden_size})")
        return {layer: stacked[j] for j, layer in enumerate(layers)}

    # --- the engine thread ----------------------------------------------------------------------
    def _serve(self) -> None:
        """Admit queued jobs, step the engine, hand finished requests to their jobs; until closed."""
        waiting: list[_Job] = []
        active: dict[str, _Job] = {}
        try:
            while True:
                block = not active and not waiting
                while True:
                    if block:
                        self._idle_since = time.perf_counter()
                    try:
                        job = self._inbox.get(block=block)
                    except queue.Empty:
                        break
                    finally:
                        self._end_idle()
                    if job is None:
                        raise EngineError("the engine is closed")
                    if isinstance(job, _Call):
                        job.run()  # between steps; then wait or step as before
                        continue
                    waiting.append(job)
                    block = False
                # A job that needs other layers or pooling waits until the engine has drained.
                while waiting and (not active or waiting[0].capture == self._capture):
                    job = waiting.pop(0)
                    try:
                        self._admit(job)
                    except Exception as exc:
                        job.future.set_exception(exc)
                        continue
                    active[job.key] = job
                if active:
                    started = time.perf_counter()
                    for finished in vllm_seam.step(self.llm):
                        self._deliver(finished, active)
                    with self._activity_lock:
                        self._activity.steps += 1
                        self._activity.stepping_s += time.perf_counter() - started
        except BaseException as exc:  # the engine is unusable: every waiting caller gets the error
            self._failure = exc
            for job in [*active.values(), *waiting]:
                if not job.future.done():
                    # Out-of-memory keeps its type, so callers can split the batch and retry the halves.
                    keep = isinstance(exc, (EngineError, torch.OutOfMemoryError))
                    job.future.set_exception(exc if keep else EngineError(f"vLLM failed: {exc}"))
            while True:
                try:
                    job = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if job is not None and not job.future.done():
                    job.future.set_exception(EngineError(f"the engine failed: {exc}"))
            if not isinstance(exc, EngineError) or str(exc) != "the engine is closed":
                log.error("engine thread stopped: %s", exc)

    def _params(self, job: _Job):
        sink = sink_reference(job.segment.path, job.key, len(job.token_ids), self.host_dtype(job.capture[1]))
        return vllm_seam.pooling_params(sink, mean=job.capture[1] == "mean")

    def _admit(self, job: _Job) -> None:
        self._ensure_capture(*job.capture)
        job.remaining = len(job.requests)
        job.slots = [None] * job.remaining
        for request in job.requests:
            vllm_seam.add_prepared(self.llm, request)
        self._activity.in_engine += len(job.requests)  # one writer, the engine thread: no lock needed
        job.requests = []  # vLLM holds them now

    def _deliver(self, output: vllm_seam.Finished, active: dict[str, _Job]) -> None:
        key, _, index = output.request_id.partition(":")
        job = active.get(key)
        if job is None:
            raise EngineError(f"vLLM returned an output for unknown request {output.request_id!r}")
        i = int(index.split("-")[0])
        if output.prompt_token_ids != job.token_ids[i]:
            raise EngineError(f"vLLM output {output.request_id} does not belong to prompt {i} of its batch")
        job.slots[i] = output.row
        job.remaining -= 1
        self._activity.in_engine -= 1
        if job.remaining == 0:
            del active[key]
            job.future.set_result(None)

    def _ensure_capture(self, layers: tuple[int, ...], pooling: str) -> None:
        if self._capture == (layers, pooling):
            return
        sizes = vllm_seam.call_workers(self.llm, "layertap_install",
                                       list(layers), self.num_layers, self.hidden_size, pooling)
        self.capture_buffer_bytes = max(sizes)
        self._capture = (layers, pooling)

    def activity(self) -> EngineActivity:
        """The engine thread's counters (`EngineActivity`) as of now, a wait still going on included."""
        with self._activity_lock:
            now = dataclasses.replace(self._activity)
            if self._idle_since is not None:
                now.idle_s += time.perf_counter() - self._idle_since
        return now

    def _end_idle(self) -> None:
        with self._activity_lock:
            if self._idle_since is not None:
                self._activity.idle_s += time.perf_counter() - self._idle_since
                self._idle_since = None

    def host_dtype(self, pooling: str) -> torch.dtype:
        """The precision a batch's vectors are handed over in."""
        return torch.float32 if pooling == "mean" else HOST_DTYPES[self.options.dtype]

    def reserve_host_buffers(self, prompts: int, layers: int, count: int, pooling: str = "last") -> None:
        """Make host buffers for `count` batches of up to `prompts` prompts x `layers` layers before they run,
        and have the worker map (on a GPU, page-lock) them now rather than inside an engine step."""
        made = self._host.reserve((layers, prompts, self.hidden_size), count, self.host_dtype(pooling))
        if made:
            self._in_engine_thread(lambda: vllm_seam.call_workers(self.llm, "layertap_map_buffers", made))

    def reference(self, texts: list[str], layers: list[int], pooling: str,
                  trust_remote_code: bool = False) -> dict[int, np.ndarray]:
        """The parity sample's Hugging Face vectors, computed in this process by the reference kept beside this
        engine (`hf_runner.ParityReference`)."""
        return self.parity_reference.vectors(texts, layers, pooling, trust_remote_code)

    def mapped_host_buffers(self) -> list[str]:
        """Paths of the host buffers the engine's copying worker has mapped."""
        return self._in_engine_thread(lambda: vllm_seam.call_workers(self.llm, "layertap_mapped_buffers"))[0]

    @property
    def host_buffers_allocated(self) -> int:
        """Host buffers created so far: with batches released after writing, it stops growing."""
        return self._host.allocated

    @property
    def failure(self) -> BaseException | None:
        """What stopped the engine thread, if anything did (the engine is then unusable)."""
        return self._failure

    def healthy(self) -> bool:
        """Whether the engine still answers: a one-prompt extraction with the capture already installed."""
        if getattr(self, "llm", None) is None or self._closed or self._failure is not None:
            return False
        if self._capture is None:
            return True
        try:
            self.extract(["."], list(self._capture[0]), self._capture[1]).release()
        except Exception:  # noqa: BLE001 - any failure means the engine cannot be trusted with a batch
            log.warning("engine failed its health probe", exc_info=True)
            return False
        return True

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        with self._gate:
            if self._closed:
                return
            self._closed = True
            self._inbox.put(None)
        self._thread.join()
        self.llm = None
        try:  # a worker in this process unlocks its mappings before the buffers behind them go
            vllm_seam.call_workers(llm, "layertap_unmap_buffers")
        except Exception:  # noqa: BLE001 - a failed engine's worker may not answer; its process may be gone
            log.debug("unmapping host buffers in the engine raised", exc_info=True)
        self._host.clear()
        self.parity_reference.close()
        try:
            vllm_seam.shutdown(llm)
        except Exception:  # pragma: no cover - best effort on teardown
            log.debug("engine shutdown raised", exc_info=True)
