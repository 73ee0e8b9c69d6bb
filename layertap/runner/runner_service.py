"""The serving side of the runner protocol (`layertap.runner.runner_client`): one `VllmRunner` answering
the calls that arrive on a connection.

Each call runs on a thread of its own, so batches from one caller, or from several callers connected at
once, share the engine's steps as they do in one process. A batch's buffer stays held for the caller until
it hands it back; whatever a caller still holds when its connection closes is handed back for it.
"""

from __future__ import annotations

import dataclasses
import gc
import threading
from concurrent.futures import Executor
from typing import Any

import numpy as np

from layertap.parts.bfloat16 import is_bfloat16
from layertap.errors import EngineError, LayertapError


def freeze_startup_heap() -> None:
    """Leave what the engine's start made (torch, vLLM, transformers, the tokenizer: objects that live as long
    as the serving process) out of the garbage collector's passes, as vLLM does in its engine core.

    A pass over the oldest generation otherwise walks all of them, with the engine's loop stopped for it: in
    the flow on a 2-core CPU, 0.4 to 0.7 s about every ten batches of 1,024 prompts, collecting nothing."""
    gc.collect()
    gc.freeze()


def engine_info(runner) -> dict[str, Any]:
    """What a caller learns about the engine when it connects."""
    return {"num_layers": runner.num_layers, "hidden_size": runner.hidden_size,
            "max_model_len": runner.max_model_len, "vllm_version": runner.vllm_version,
            "engine_process": runner.engine_process, "engine_core_start": runner.engine_core_start,
            "step_tokens": runner.step_tokens,
            "compiled": runner.compiled, "capture_buffer_bytes": runner.capture_buffer_bytes,
            "host_buffers_allocated": runner.host_buffers_allocated,
            "frozen_heap_objects": gc.get_freeze_count()}


def start_failure(exc: BaseException) -> tuple[int, bool, tuple[str, str]]:
    """The message that tells a caller why the engine could not start."""
    reason = str(exc) if isinstance(exc, LayertapError) else f"{type(exc).__name__}: {exc}"
    return 0, False, ("engine", f"the runner could not start: {reason}")


def answer_calls(conn, runner, workers: Executor, on_call=None, extra_calls: dict | None = None) -> None:
    """Answer `conn`'s calls with `runner` until the caller closes or goes away; then hand back whatever
    buffers it still holds (also those of calls that finish later). `on_call` is told of every call;
    `extra_calls` adds calls of the serving process's own (name -> fn(call_id, *args))."""
    from layertap import faults

    send_lock, state_lock = threading.Lock(), threading.Lock()
    held: dict[int, Any] = {}
    gone = False

    def extract(call_id: int, texts: list[str], layers: list[int], pooling: str, truncate_to: int | None) -> dict:
        faults.hit("runner-process.extract", texts=texts)  # in the serving process: how a device error arrives
        result = runner.extract(texts, layers, pooling, truncate_to)
        if result.buffer is not None:
            with state_lock:
                if gone:
                    result.release()  # nobody is left to read it
                else:
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

    def reference(call_id: int, texts: list[str], layers: list[int], pooling: str, trust_remote_code: bool) -> dict:
        return runner.reference(texts, layers, pooling, trust_remote_code)

    calls = {"extract": extract, "reserve": reserve, "reference": reference,
             "healthy": lambda call_id: runner.healthy(),
             "mapped": lambda call_id: runner.mapped_host_buffers(),
             "activity": lambda call_id: dataclasses.asdict(runner.activity()), **(extra_calls or {})}

    def answer(kind: str, call_id: int, *args: Any) -> None:
        try:
            message = (call_id, True, calls[kind](call_id, *args))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            message = (call_id, False, _error_payload(exc))
        if on_call is not None:
            on_call()
        with send_lock:
            try:
                conn.send(message)
            except (OSError, ValueError):
                pass  # the caller is gone; its buffers are handed back below

    try:
        while True:
            try:
                kind, call_id, *args = conn.recv()
            except (EOFError, OSError):
                break  # the caller is gone
            if on_call is not None:
                on_call()
            if kind == "close":
                break
            if kind == "release":
                with state_lock:
                    result = held.pop(call_id, None)
                if result is not None:
                    result.release()
                continue
            workers.submit(answer, kind, call_id, *args)
    finally:
        with state_lock:
            gone = True
            left, held = list(held.values()), {}
        for result in left:
            result.release()


def _error_payload(exc: BaseException) -> tuple[str, str]:
    import torch

    if isinstance(exc, torch.OutOfMemoryError):
        return "oom", str(exc)
    if isinstance(exc, EngineError):
        return "engine", str(exc)
    return "engine", f"vLLM failed: {type(exc).__name__}: {exc}"
