"""The warm engine's own process (`warm_engine` starts it with `python -m`): start the runner, listen on the
engine's socket, answer attached runs, keep the status file current, and exit when idle, stopped or broken.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Listener
from pathlib import Path

from layertap.errors import EngineError
from layertap.runner.engine_core_start import keep_out_of_forked_children
from layertap.runner.warm_engine import STARTS_LOG, STATUS_EVERY_S, WarmSpec, authkey, forget_engine

log = logging.getLogger(__name__)


class _Served:
    """Who is attached and since when the engine has been idle, for the idle timeout and the status file."""

    def __init__(self, idle_timeout: float):
        self.lock = threading.Lock()
        self.clients = 0
        self.last_used = time.time()
        self.idle_timeout = idle_timeout
        self.stopping = threading.Event()

    def touch(self) -> None:
        self.last_used = time.time()

    def idle_for(self) -> float:
        return 0.0 if self.clients else time.time() - self.last_used


def serve(directory: Path, key: str, engine_lock: int) -> int:
    """The engine process: start the runner, listen, answer runs until idle, stopped or broken. It holds
    `engine_lock` (`<key>.engine`, locked by the run that started it) until it has stopped listening."""
    from concurrent.futures import ThreadPoolExecutor

    from layertap.runner.runner_service import answer_calls, engine_info, freeze_startup_heap
    from layertap.runner.vllm_runner import VllmRunner

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    spec_json = json.loads((directory / f"{key}.spec").read_text())
    served = _Served(float(spec_json.pop("idle_timeout")))
    spec = WarmSpec.from_json(spec_json)
    signal.signal(signal.SIGTERM, lambda *_: served.stopping.set())
    signal.signal(signal.SIGINT, lambda *_: served.stopping.set())
    now = WarmSpec.for_options(spec.options).as_json()
    changed = [name for name, value in spec.as_json().items() if now[name] != value]
    if changed:  # the model's files or layertap's code changed since the run asked for this engine
        raise EngineError(f"{', '.join(changed)} changed before the engine for {spec.options.model} started")
    keep_out_of_forked_children(engine_lock)  # released when this process ends, not its engine core
    runner = VllmRunner(spec.options)
    freeze_startup_heap()
    started_at = time.time()
    identity = {**engine_info(runner), **spec.as_json(), "key": key, "pid": os.getpid(), "model": spec.options.model,
                "started_at": started_at}
    workers = ThreadPoolExecutor(thread_name_prefix="layertap-call")
    sock = directory / f"{key}.sock"
    listener = Listener(str(sock.with_suffix(".starting")), "AF_UNIX", authkey=authkey(directory))
    os.chmod(sock.with_suffix(".starting"), 0o600)

    def set_idle_timeout(call_id: int, seconds: float) -> None:
        served.idle_timeout = seconds

    def attached(conn) -> None:
        try:
            conn.send((0, True, identity))
            answer_calls(conn, runner, workers, on_call=served.touch, extra_calls={"idle_timeout": set_idle_timeout})
        finally:
            with served.lock:
                served.clients -= 1
                served.touch()
            conn.close()

    def accept() -> None:
        while not served.stopping.is_set():
            try:
                conn = listener.accept()
            except Exception:  # noqa: BLE001 - a caller without the key, or one that left during the handshake
                if served.stopping.is_set():
                    return
                continue
            with served.lock:
                if served.stopping.is_set():
                    conn.close()
                    return
                served.clients += 1
            threading.Thread(target=attached, args=(conn,), name="layertap-attached", daemon=True).start()

    os.replace(sock.with_suffix(".starting"), sock)  # runs see the socket only once the engine is up
    with (directory / STARTS_LOG).open("a") as starts:
        starts.write(json.dumps({"key": key, "pid": os.getpid(), "started_at": started_at,
                                 "model": spec.options.model}) + "\n")
    threading.Thread(target=accept, name="layertap-accept", daemon=True).start()
    _write_status(directory, key, identity, served)
    log.info("warm engine %s ready on %s", key, sock)
    try:
        while not served.stopping.wait(STATUS_EVERY_S / 4):
            if runner.failure is not None:
                log.error("the engine failed: %s", runner.failure)
                break
            with served.lock:
                if served.idle_for() > served.idle_timeout:
                    served.stopping.set()
                    log.info("idle for %.0f s: stopping", served.idle_for())
                    break
            _write_status(directory, key, identity, served)
    finally:
        served.stopping.set()
        forget_engine(directory, key)
        with contextlib.suppress(OSError):
            listener.close()  # it would remove the socket under the name it was made with
        runner.close()
        workers.shutdown(wait=False, cancel_futures=True)
        os.close(engine_lock)
    return 0


_last_status: dict[str, float] = {}


def _write_status(directory: Path, key: str, identity: dict, served: _Served) -> None:
    now = time.time()
    if now - _last_status.get(key, 0.0) < STATUS_EVERY_S:
        return
    _last_status[key] = now
    from layertap.runner.process_memory import device_bytes, tree_rss_bytes

    status = {**identity, "clients": served.clients, "last_used": served.last_used,
              "idle_timeout": served.idle_timeout, "host_rss_bytes": tree_rss_bytes(os.getpid()),
              "device_bytes": device_bytes(os.getpid()), "updated_at": now}
    path = directory / f"{key}.json"
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(status, default=str))
    os.replace(temporary, path)


def main(argv: list[str] | None = None) -> int:
    directory, key, engine_lock = argv if argv is not None else sys.argv[1:]
    try:
        return serve(Path(directory), key, int(engine_lock))
    except BaseException as exc:  # noqa: BLE001 - the run that started it reads this line
        print(f"layertap-engine: error: {' '.join(str(exc).split()) or type(exc).__name__}", flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
