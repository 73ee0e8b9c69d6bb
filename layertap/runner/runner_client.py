"""The caller's side of a runner that lives in another process: the same calls as `VllmRunner`, over a
connection.

Vectors never travel through the connection: the engine copies them into shared host buffers, which the
caller maps by path and reads in place, and hands back once written. Two kinds of process serve these
calls (`layertap.runner.runner_service`): a private child started for one caller (`RunnerProcess`), and a
warm engine shared by successive runs (`layertap.runner.warm_engine`). They differ only in how the
connection is made and what closing it means.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import numpy as np

from layertap.parts.bfloat16 import from_bits
from layertap.errors import EngineError, OutOfDeviceMemory
from layertap.runner.base import EngineActivity, Extraction

log = logging.getLogger(__name__)

# A health probe is one prompt: an engine that takes longer is wedged, not busy.
HEALTH_TIMEOUT_S = 120.0
_NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


class RunnerClient:
    """A runner in another process, used as if it were one. Subclasses make the connection, receive the
    engine's facts (`num_layers`, `hidden_size`, ...) and say whether the serving process is alive."""

    runner_process = True

    def __init__(self, conn, info: dict[str, Any]):
        self._conn = conn
        self._send_lock = threading.Lock()
        self._pending: dict[int, Future] = {}
        self._ids = itertools.count(1)
        self._mappings: dict[str, np.memmap] = {}
        self._mapping_lock = threading.Lock()
        self._failure: EngineError | None = None
        self._closed = False
        self.info = info
        for name, value in info.items():
            setattr(self, name, value)
        self._reader = threading.Thread(target=self._read_replies, name="layertap-runner-replies", daemon=True)
        self._reader.start()

    # --- what subclasses decide -------------------------------------------------------------------
    def _peer_alive(self) -> bool:
        raise NotImplementedError

    def _peer_lost(self) -> str:
        """Clean up after the serving process went away; returns how to say so."""
        raise NotImplementedError

    def _disconnect(self) -> None:
        raise NotImplementedError

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

    def reference(self, texts: list[str], layers: list[int], pooling: str, trust_remote_code: bool = False) -> dict:
        """The parity sample's Hugging Face vectors, computed in the engine's process (`VllmRunner.reference`),
        which has torch and transformers loaded already and keeps the reference beside the engine."""
        return self._call("reference", list(texts), list(layers), pooling, trust_remote_code)[1].result()

    def reserve_host_buffers(self, prompts: int, layers: int, count: int, pooling: str = "last") -> None:
        self.host_buffers_allocated = self._call("reserve", prompts, layers, count, pooling)[1].result()

    def mapped_host_buffers(self) -> list[str]:
        return self._call("mapped")[1].result()

    def activity(self) -> EngineActivity:
        """The serving process's engine-thread counters (`VllmRunner.activity`)."""
        return EngineActivity(**self._call("activity")[1].result())

    def healthy(self) -> bool:
        """Whether the engine still answers a one-prompt extraction (`VllmRunner.healthy`) in good time."""
        if self._closed or self._failure is not None or not self._peer_alive():
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
        self._disconnect()
        self._fail_pending(EngineError("the engine is closed"))
        self._mappings.clear()

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
        """Hand a batch's buffer back to the engine's pool (a closed or dead runner has no pool left)."""
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
                del self._mappings[known]  # the engine dropped that buffer: let its pages go
            mapping = self._mappings.get(path)
            if mapping is None:
                mapping = self._mappings[path] = np.memmap(path, dtype=np.uint8, mode="r")
        kind = np.dtype(_NUMPY_DTYPES[dtype])
        view = np.ndarray(shape, kind, buffer=mapping, offset=0) if math.prod(shape) else np.empty(shape, kind)
        return from_bits(view) if dtype == "bfloat16" else view

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
                    future.set_exception(error_from(payload))
        except (EOFError, OSError):
            if self._closed:
                return
            self._failure = EngineError(self._peer_lost())
            log.error("%s", self._failure)
            self._fail_pending(self._failure)

    def _fail_pending(self, error: EngineError) -> None:
        with self._send_lock:
            pending, self._pending = list(self._pending.values()), {}
        for future in pending:
            if not future.done():
                future.set_exception(error)


def receive_info(conn, what: str) -> dict[str, Any]:
    """The first message a serving process sends: its engine's facts, or why it could not start."""
    try:
        _, ok, payload = conn.recv()
    except (EOFError, OSError) as exc:
        raise EngineError(f"{what} went away before it was ready") from exc
    if not ok:
        raise error_from(payload)
    return payload


def error_from(payload: tuple[str, str]) -> EngineError:
    kind, message = payload
    return OutOfDeviceMemory(message) if kind == "oom" else EngineError(message)
