"""The parity reference computed inside vLLM's worker, beside the engine it checks.

The worker's process already holds the device's context and has torch and transformers loaded: a reference
computed there adds only its weights, freed after. Computed in the process driving the engine instead, it
would give that process a CUDA context of its own, held for the rest of its life, whose host memory counts in
the run's peak. It runs on a thread of its own, on a CUDA stream of its own, so the engine keeps
stepping meanwhile; the caller asks for the answer between steps (`VllmRunner.reference`).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from concurrent.futures import Future

import numpy as np

from layertap.errors import EngineError

log = logging.getLogger(__name__)

_jobs: dict[int, Future] = {}
_ids = itertools.count(1)
_lock = threading.Lock()


def start(device, model: str, texts: list[str], layers: list[int], pooling: str, trust_remote_code: bool,
          engine_dtype: str) -> int:
    """Start computing `hf_runner.hf_reference` for `texts` on a thread; the job's id for `result`."""
    job = next(_ids)
    future: Future = Future()
    with _lock:
        _jobs[job] = future
    args = (future, device, model, texts, layers, pooling, trust_remote_code, engine_dtype)
    threading.Thread(target=_compute, args=args, name="layertap-reference", daemon=True).start()
    return job


def _compute(future: Future, device, model: str, texts: list[str], layers: list[int], pooling: str,
             trust_remote_code: bool, engine_dtype: str) -> None:
    try:
        import torch

        from layertap.runner.hf_runner import hf_reference

        started = time.monotonic()
        if getattr(device, "type", None) == "cuda":
            torch.cuda.set_device(device)  # the worker's device; a new thread starts on the first one
            with torch.cuda.stream(torch.cuda.Stream(device)):
                vectors = hf_reference(model, texts, layers, pooling, trust_remote_code, engine_dtype)
        else:
            vectors = hf_reference(model, texts, layers, pooling, trust_remote_code, engine_dtype)
        future.set_result(_encode(vectors, time.monotonic() - started))
    except BaseException as exc:  # noqa: BLE001 - handed to the caller with the next `result`
        future.set_exception(exc)


def result(job: int) -> dict | None:
    """None while job `job` computes; then its answer, once: the vectors (`decode` reads them) or the error
    that stopped it, by message (answers cross to the caller's process as plain values)."""
    with _lock:
        future = _jobs.get(job)
        if future is None:
            return {"error": f"no parity reference job {job} in this worker"}
        if not future.done():
            return None
        del _jobs[job]
    exc = future.exception()
    if exc is not None:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return future.result()


def _encode(vectors: dict[int, np.ndarray], seconds: float) -> dict:
    layers = sorted(vectors)
    rows = len(vectors[layers[0]]) if layers else 0
    return {"layers": layers, "rows": rows, "pid": os.getpid(), "seconds": seconds,
            "data": [np.ascontiguousarray(vectors[layer], np.float32).tobytes() for layer in layers]}


def decode(answer: dict) -> dict[int, np.ndarray]:
    """The vectors of a finished job's answer, by layer (float32, one row per text); EngineError for an error."""
    if "error" in answer:
        raise EngineError(f"the parity reference failed in the engine's worker: {answer['error']}")
    log.info("parity reference computed in the engine's worker (process %d) in %.1f s",
             answer["pid"], answer["seconds"])
    return {int(layer): np.frombuffer(data, np.float32).reshape(answer["rows"], -1)
            for layer, data in zip(answer["layers"], answer["data"])}
