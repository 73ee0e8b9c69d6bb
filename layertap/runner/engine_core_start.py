"""How vLLM starts a runner's engine core: forked from the process that starts the engine where that is safe,
spawned where it is not.

A spawned engine core starts a fresh interpreter and imports torch and vLLM again before it can begin (26 s of
a cold start on an H100 host); a forked one starts from the modules this process has already imported, as
vLLM's own default does. Forking copies only the calling thread, so a process running other threads (a Prefect
worker, a notebook) could hand the child a lock another thread held: such a process spawns. The processes
layertap starts for an engine (`runner_process`, the warm engine's) run one thread until it is up. vLLM
still spawns by itself where CUDA is already initialised, inside a Ray actor, and on a CPU.
"""

from __future__ import annotations

import os
import threading

START_METHOD = "VLLM_WORKER_MULTIPROC_METHOD"  # vLLM's own switch, read when it starts the engine core
_chosen: list[str] = []  # what this process has written there (any other value is the user's, and kept)


def choose_engine_core_start() -> str:
    """Set how vLLM will start the engine core about to be started from this process, and return it: the
    user's own `VLLM_WORKER_MULTIPROC_METHOD` if set, else fork while this process runs a single thread."""
    current = os.environ.get(START_METHOD)
    if current is not None and current not in _chosen:
        return current
    method = "fork" if threading.active_count() == 1 else "spawn"
    os.environ[START_METHOD] = method
    _chosen.append(method)
    return method


def engine_core_start() -> str:
    """How vLLM started the engine core after all (it overrides the choice where forking is unsafe)."""
    return os.environ.get(START_METHOD, "fork")


def keep_out_of_forked_children(fd: int) -> None:
    """Point `fd` at /dev/null in every child forked from this process from now on.

    A forked engine core would otherwise hold the file open for its whole life: the end of a pipe whose
    closing tells the caller this process is gone, or a lock meant to be released when this process ends.
    The child keeps the number (whatever holds it there can still close it), not what it referred to; a
    number since reused for another file is left alone."""
    identity = _identity(fd)

    def forget() -> None:
        if identity is not None and _identity(fd) == identity:
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, fd)
            os.close(null)

    os.register_at_fork(after_in_child=forget)


def _identity(fd: int) -> tuple[int, int] | None:
    try:
        status = os.fstat(fd)
    except OSError:
        return None
    return status.st_dev, status.st_ino
