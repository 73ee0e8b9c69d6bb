"""The runner in a process of its own, so vLLM's frontend does not share the caller's interpreter lock.

The process that drives vLLM does Python work for every prompt: tokenising, building and adding its
request, taking its output. In the caller's process that work shares one interpreter lock with everything
else there: Prefect's task runs, the store's transactions, the value checks and Parquet writers between
their numpy and Arrow calls. On an H200, 100,000 short prompts ran at 0.92x vLLM's plain generate with the
runner alone, 0.72x with each batch's checks and files beside it, 0.56x inside the flow (bench/README.md).

`RunnerProcess` starts a `VllmRunner` in a spawned child and talks to it over a pipe, with the same calls
as the runner itself. Vectors never travel through the pipe: the engine copies them into shared host
buffers, which the caller maps by path and reads in place, and hands back once written. The child closes
its engine and exits when the caller closes it or goes away (its end of the pipe closes).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import multiprocessing
import os
import signal
import threading
import weakref
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import numpy as np

from layertap.bfloat16 import from_bits, is_bfloat16
from layertap.errors import EngineError, LayertapError, OutOfDeviceMemory
from layertap.runner.base import EngineActivity, Extraction
from layertap.runner.engine_options import EngineOptions

log = logging.getLogger(__name__)

# A health probe is one prompt: an engine that takes longer is wedged, not busy.
HEALTH_TIMEOUT_S = 120.0
# Closing waits this long for the child to shut its engine down before it is stopped by force.
CLOSE_TIMEOUT_S = 60.0
_NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


class RunnerProcess:
    """A `VllmRunner` in a child process, used as if it were one."""

    runner_process = True

    def __init__(self, options: EngineOptions):
        self.options = options
        context = multiprocessing.get_context("spawn")  # never fork a threaded caller (a Prefect worker)
        self._conn, child_end = context.Pipe()
        self._process = context.Process(target=serve, args=(child_end, options), name="layertap-runner")
        self._process.start()
        child_end.close()  # this process keeps only its own end: the child then sees the caller go
        self._send_lock = threading.Lock()
        self._pending: dict[int, Future] = {}
        self._ids = itertools.count(1)
        self._mappings: dict[str, np.memmap] = {}
        self._failure: EngineError | None = None
        self._closed = False
        self._stop = weakref.finalize(self, _stop_child, self._process, self._conn)
        self._mapping_lock = threading.Lock()
        try:
            info = self._wait_until_ready()
        except BaseException:
            self._stop()
            raise
        for name, value in info.items():
            setattr(self, name, value)
        self._reader = threading.Thread(target=self._read_replies, name="layertap-runner-replies", daemon=True)
        self._reader.start()

    # --- calls -----------------------------------------------------------------------------------
    def extract(
        self, texts: list[str], layers: list[int], pooling: str, truncate_to: int | None = None
    ) -> Extraction:
        """As `VllmRunner.extract`; the vectors are read in place from the shared buffer the engine filled."""
        call_id, future = self._call("extract", list(texts), list(layers), pooling, truncate_to)
        reply = future.result()
        self.capture_buffer_bytes = reply["capture_buffer_bytes"]
        self.host_buffers_allocated = reply["host_buffers_allocated"]
        layers = reply["layers"]
        if reply["buffer"] is None:
            vectors = {layer: np.empty((0, self.hidden_size), np.float32) for layer in layers}
            return Extraction(vectors, reply["kept"], reply["rejected"], reply["num_tokens"], reply["truncated"])
        stacked = self._view(reply["buffer"], (len(layers), len(reply["kept"]), self.hidden_size), reply["dtype"])
        return Extraction({layer: stacked[j] for j, layer in enumerate(layers)}, reply["kept"], reply["rejected"],
                          reply["num_tokens"], reply["truncated"], release_fn=lambda: self._release(call_id),
                          buffer=reply["buffer"])

    def reserve_host_buffers(self, prompts: int, layers: int, count: int, pooling: str = "last") -> None:
        self.host_buffers_allocated = self._call("reserve", prompts, layers, count, pooling)[1].result()

    def mapped_host_buffers(self) -> list[str]:
        return self._call("mapped")[1].result()

    def activity(self) -> EngineActivity:
        """The child's engine-thread counters (`VllmRunner.activity`)."""
        return EngineActivity(**self._call("activity")[1].result())

    def healthy(self) -> bool:
        """Whether the child still answers a one-prompt extraction (`VllmRunner.healthy`) in good time."""
        if self._closed or self._failure is not None or not self._process.is_alive():
            return False
        try:
            return bool(self._call("healthy")[1].result(timeout=HEALTH_TIMEOUT_S))
        except (EngineError, FutureTimeout):
            log.warning("the runner process failed its health probe", exc_info=True)
            return False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop()
        self._fail_pending(EngineError("the engine is closed"))
        self._mappings.clear()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    # --- plumbing ---------------------------------------------------------------------------------
    def _call(self, kind: str, *args: Any) -> tuple[int, Future]:
        call_id, future = next(self._ids), Future()
        with self._send_lock:
            self._check_usable()
            self._pending[call_id] = future
            try:
                self._conn.send((kind, call_id, *args))
            except (OSError, ValueError) as exc:
                self._pending.pop(call_id, None)
                raise EngineError(f"the runner process cannot be reached: {exc}") from exc
        return call_id, future

    def _check_usable(self) -> None:
        if self._failure is not None:
            raise EngineError(f"the engine failed earlier: {self._failure}") from self._failure
        if self._closed:
            raise EngineError("the engine is closed")

    def _release(self, call_id: int) -> None:
        """Hand a batch's buffer back to the child's pool (a closed or dead runner has no pool left)."""
        with self._send_lock:
            if self._closed or self._failure is not None:
                return
            try:
                self._conn.send(("release", call_id))
            except (OSError, ValueError):
                log.debug("could not hand a buffer back to the runner process", exc_info=True)

    def _view(self, path: str, shape: tuple[int, int, int], dtype: str) -> np.ndarray:
        """A read-only [layers, rows, hidden] view of the shared buffer at `path` (mapped once, reused)."""
        with self._mapping_lock:
            for known in [p for p in self._mappings if p != path and not os.path.exists(p)]:
                del self._mappings[known]  # the child dropped that buffer: let its pages go
            mapping = self._mappings.get(path)
            if mapping is None:
                mapping = self._mappings[path] = np.memmap(path, dtype=np.uint8, mode="r")
        kind = np.dtype(_NUMPY_DTYPES[dtype])
        view = np.ndarray(shape, kind, buffer=mapping, offset=0) if math.prod(shape) else np.empty(shape, kind)
        return from_bits(view) if dtype == "bfloat16" else view

    def _wait_until_ready(self) -> dict[str, Any]:
        while not self._conn.poll(1.0):
            if not self._process.is_alive():
                raise EngineError(f"the runner process exited while starting (code {self._process.exitcode})")
        try:
            _, ok, payload = self._conn.recv()
        except (EOFError, OSError) as exc:
            self._process.join(5)
            raise EngineError(f"the runner process exited while starting (code {self._process.exitcode})") from exc
        if not ok:
            raise _error_from(payload)
        return payload

    def _read_replies(self) -> None:
        try:
            while True:
                call_id, ok, payload = self._conn.recv()
                future = self._pending.pop(call_id, None)
                if future is None:
                    continue
                if ok:
                    future.set_result(payload)
                else:
                    future.set_exception(_error_from(payload))
        except (EOFError, OSError):
            if self._closed:
                return
            self._process.join(5)
            _stop_group(self._process.pid)  # its engine core, if it had one of its own, goes with it
            self._failure = EngineError(f"the runner process exited (code {self._process.exitcode})")
            log.error("%s", self._failure)
            self._fail_pending(self._failure)

    def _fail_pending(self, error: EngineError) -> None:
        with self._send_lock:
            pending, self._pending = list(self._pending.values()), {}
        for future in pending:
            if not future.done():
                future.set_exception(error)


def _stop_child(process, conn) -> None:
    """Ask the child to close its engine, wait, then stop it by force. Also runs when the caller exits
    without closing the runner, before multiprocessing would wait for the child forever."""
    try:
        conn.send(("close", 0))
    except (OSError, ValueError):
        pass
    process.join(CLOSE_TIMEOUT_S)
    if process.is_alive():
        log.warning("the runner process did not stop in %.0f s: terminating it", CLOSE_TIMEOUT_S)
        process.terminate()
        process.join(10)
    if process.is_alive():
        process.kill()
        process.join()
    _stop_group(process.pid)
    conn.close()


def _stop_group(pid: int | None) -> None:
    """Kill what is left of the child's process group: the engine core vLLM started for it, when the child
    died before it could shut it down (the core would otherwise keep its device memory)."""
    if pid is None:
        return
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # nothing left of the group


def _error_from(payload: tuple[str, str]) -> EngineError:
    kind, message = payload
    return OutOfDeviceMemory(message) if kind == "oom" else EngineError(message)


# --- the child --------------------------------------------------------------------------------------
def serve(conn, options: EngineOptions) -> None:
    """The child's main loop: start the engine, then answer calls (each on a thread of its own, so batches
    share the engine's steps as they do in one process) until told to close or the caller goes away."""
    from concurrent.futures import ThreadPoolExecutor

    from layertap import faults
    from layertap.runner.vllm_runner import VllmRunner

    # A process group of its own, which the engine core vLLM spawns joins: if this process dies, the caller
    # stops the whole group.
    os.setpgrp()
    try:
        runner = VllmRunner(options)
    except BaseException as exc:  # noqa: BLE001 - reported to the caller, which raises it
        reason = str(exc) if isinstance(exc, LayertapError) else f"{type(exc).__name__}: {exc}"
        conn.send((0, False, ("engine", f"the runner could not start: {reason}")))
        return
    send_lock, held = threading.Lock(), {}

    def extract(call_id: int, texts: list[str], layers: list[int], pooling: str, truncate_to: int | None) -> dict:
        faults.hit("runner-process.extract", texts=texts)  # inside the child: how a device error arrives
        result = runner.extract(texts, layers, pooling, truncate_to)
        if result.buffer is not None:
            held[call_id] = result
        first = next(iter(result.vectors.values()), np.empty(0, np.float32))
        return {"buffer": result.buffer, "layers": sorted(result.vectors), "kept": result.kept,
                "dtype": "bfloat16" if is_bfloat16(first) else first.dtype.name,
                "rejected": result.rejected, "num_tokens": result.num_tokens, "truncated": result.truncated,
                "capture_buffer_bytes": runner.capture_buffer_bytes,
                "host_buffers_allocated": runner.host_buffers_allocated}

    def reserve(call_id: int, prompts: int, layers: int, count: int, pooling: str) -> int:
        runner.reserve_host_buffers(prompts, layers, count, pooling)
        return runner.host_buffers_allocated

    calls = {"extract": extract, "reserve": reserve, "healthy": lambda call_id: runner.healthy(),
             "mapped": lambda call_id: runner.mapped_host_buffers(),
             "activity": lambda call_id: dataclasses.asdict(runner.activity())}

    def answer(kind: str, call_id: int, *args: Any) -> None:
        try:
            message = (call_id, True, calls[kind](call_id, *args))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            message = (call_id, False, _error_payload(exc))
        with send_lock:
            conn.send(message)

    conn.send((0, True, {"num_layers": runner.num_layers, "hidden_size": runner.hidden_size,
                         "max_model_len": runner.max_model_len, "vllm_version": runner.vllm_version,
                         "engine_process": runner.engine_process, "step_tokens": runner.step_tokens,
                         "compiled": runner.compiled, "capture_buffer_bytes": runner.capture_buffer_bytes,
                         "host_buffers_allocated": runner.host_buffers_allocated}))
    workers = ThreadPoolExecutor(thread_name_prefix="layertap-call")
    try:
        while True:
            try:
                kind, call_id, *args = conn.recv()
            except (EOFError, OSError):
                break  # the caller is gone
            if kind == "close":
                break
            if kind == "release":
                result = held.pop(call_id, None)
                if result is not None:
                    result.release()
                continue
            workers.submit(answer, kind, call_id, *args)
    finally:
        runner.close()  # fails calls still waiting on the engine, so the workers can finish
        workers.shutdown(wait=True, cancel_futures=True)


def _error_payload(exc: BaseException) -> tuple[str, str]:
    import torch

    if isinstance(exc, torch.OutOfMemoryError):
        return "oom", str(exc)
    if isinstance(exc, EngineError):
        return "engine", str(exc)
    return "engine", f"vLLM failed: {type(exc).__name__}: {exc}"
