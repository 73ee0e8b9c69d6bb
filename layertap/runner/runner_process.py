"""The runner in a private child process, so vLLM's frontend does not share the caller's interpreter lock.

The process that drives vLLM does Python work for every prompt: tokenising, building and adding its
request, taking its output. In the caller's process that work shares one interpreter lock with everything
else there: Prefect's task runs, the store's transactions, the value checks and Parquet writers between
their numpy and Arrow calls. `RunnerProcess` starts a `VllmRunner` in a spawned child and talks to it over
a pipe (`layertap.runner.runner_client`), with the same calls as the runner itself. The child closes its
engine and exits when the caller closes it or goes away (its end of the pipe closes).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import weakref

from layertap.errors import EngineError
from layertap.runner.engine_core_start import keep_out_of_forked_children
from layertap.runner.engine_options import EngineOptions
from layertap.runner.runner_client import RunnerClient, receive_info

log = logging.getLogger(__name__)

# Closing waits this long for the child to shut its engine down before it is stopped by force.
CLOSE_TIMEOUT_S = 60.0


class RunnerProcess(RunnerClient):
    """A `VllmRunner` in a child process of this one, used as if it were one."""

    def __init__(self, options: EngineOptions):
        self.options = options
        context = multiprocessing.get_context("spawn")  # never fork a threaded caller (a Prefect worker)
        conn, child_end = context.Pipe()
        self._process = context.Process(target=serve, args=(child_end, options), name="layertap-runner")
        self._process.start()
        child_end.close()  # this process keeps only its own end: the child then sees the caller go
        self._stop = weakref.finalize(self, _stop_child, self._process, conn)
        try:
            info = self._wait_until_ready(conn)
        except BaseException:
            self._stop()
            raise
        super().__init__(conn, info)

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def _peer_alive(self) -> bool:
        return self._process.is_alive()

    def _peer_lost(self) -> str:
        self._process.join(5)
        stop_group(self._process.pid)  # its engine core, if it had one of its own, goes with it
        return f"the runner process exited (code {self._process.exitcode})"

    def _disconnect(self) -> None:
        self._stop()

    def _wait_until_ready(self, conn) -> dict:
        while not conn.poll(1.0):
            if not self._process.is_alive():
                raise EngineError(f"the runner process exited while starting (code {self._process.exitcode})")
        try:
            return receive_info(conn, "the runner process")
        except EngineError as exc:
            if not str(exc).endswith("before it was ready"):
                raise
            self._process.join(5)
            raise EngineError(f"the runner process exited while starting (code {self._process.exitcode})") from exc


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
    stop_group(process.pid)
    conn.close()


def stop_group(pid: int | None) -> None:
    """Kill what is left of a serving process's group: the engine core vLLM started for it, when the serving
    process died before it could shut it down (the core would otherwise keep its device memory)."""
    if pid is None:
        return
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # nothing left of the group



# --- the child --------------------------------------------------------------------------------------
def serve(conn, options: EngineOptions) -> None:
    """The child's main loop: start the engine, then answer calls until told to close or the caller goes."""
    from concurrent.futures import ThreadPoolExecutor

    from layertap.runner.runner_service import answer_calls, engine_info, freeze_startup_heap, start_failure
    from layertap.runner.vllm_runner import VllmRunner

    # A process group of its own, which the engine core vLLM starts joins: if this process dies, the caller
    # stops the whole group. A forked engine core must not keep the caller's pipe open after this process.
    os.setpgrp()
    keep_out_of_forked_children(conn.fileno())
    try:
        runner = VllmRunner(options)
    except BaseException as exc:  # noqa: BLE001 - reported to the caller, which raises it
        conn.send(start_failure(exc))
        return
    freeze_startup_heap()
    conn.send((0, True, engine_info(runner)))
    workers = ThreadPoolExecutor(thread_name_prefix="layertap-call")
    try:
        answer_calls(conn, runner, workers)
    finally:
        runner.close()  # fails calls still waiting on the engine, so the workers can finish
        workers.shutdown(wait=True, cancel_futures=True)
