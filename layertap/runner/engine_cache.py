"""One extraction engine per process, started on first use and shared by every batch.

Starting vLLM costs seconds to a minute while batches are many, so batch tasks ask this registry for a
runner instead of building one. A run that will need its engine can start it early (`start_early`), while
it still ingests and plans. With `warm_engine` the registry attaches to a warm engine that outlives the
run (`layertap.runner.warm_engine`) instead of starting one of its own; closing then only detaches.
The flow closes the registry when it ends. A caller that runs many flows in one process (a test run, a
notebook) can `pin()` the registry so engines survive between flows.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from layertap.errors import EngineError
from layertap.runner.engine_options import EngineOptions
from layertap.runner.vllm_seam import vllm_is_cpu_build

if TYPE_CHECKING:
    from layertap.settings import Settings

log = logging.getLogger(__name__)
START_THREAD = "layertap-engine-start"  # the thread `start_early` starts an engine on
_lock = threading.RLock()
_runners: dict[tuple, Any] = {}
_start_locks: dict[tuple, threading.Lock] = {}
_early_failures: dict[tuple, BaseException] = {}
_closings = 0  # how many times the registry was closed: a start that outlived a close is closed too
_pins = 0
_started = 0
_requests = 0


def runner_key(settings: Settings) -> tuple:
    """Engines are interchangeable only when model, dtype and every engine option agree."""
    if not settings.model:
        raise ValueError("runner_key needs a resolved model directory")
    opts = tuple(sorted(settings.engine_options().items()))
    model = str(Path(settings.model).expanduser().resolve())
    if settings.executor == "ray":  # the engines of a Ray cluster (`layertap.runner.ray_engines`); never warm ones
        from layertap.runner.ray_cluster import cluster_address

        return (model, settings.dtype, opts, "ray", cluster_address(settings), settings.engines)
    idle_timeout = settings.engine_idle_timeout if settings.warm_engine else None
    return (model, settings.dtype, opts, settings.engine_dir, idle_timeout)


def get_runner(settings: Settings):
    """The process's runner for these settings, started (or attached to) now if this is the first use."""
    global _requests
    with _lock:
        _requests += 1
    return _runner(settings)


def _runner(settings: Settings):
    global _started
    key = runner_key(settings)
    with _lock:
        runner = _runners.get(key)
        if runner is not None:
            return runner
        start_lock = _start_locks.setdefault(key, threading.Lock())
    with start_lock:  # one start per key; other keys' lookups go on meanwhile
        with _lock:
            runner = _runners.get(key)
            failure = _early_failures.pop(key, None)
        if runner is not None:
            return runner
        if failure is not None:
            raise failure  # the early start failed: its caller sees why (a retry starts afresh)
        closings = _closings
        try:
            runner = _start(settings)
        except Exception as exc:
            raise _model_problem(settings) or exc
        with _lock:
            _started += 1
            if _closings == closings:
                _runners[key] = runner
                return runner
        runner.close()  # the run ended while its engine started
        raise EngineError("the engine registry was closed while this engine started")


def _model_problem(settings: Settings):
    """Why the model folder cannot start any engine (gone, or without config, weights or tokenizer), as the
    one-line `ModelUnusable` error that is not retried; None when the folder looks whole and the engine
    failed for another reason."""
    from layertap.errors import ModelUnusable
    from layertap.model.fingerprint import check_model_folder

    try:
        check_model_folder(settings.model, settings.load_format)
    except ModelUnusable as problem:
        return problem
    return None


def _start(settings: Settings):
    """A new engine for these settings: the local one `start_runner` gives, or a Ray cluster's engines."""
    if settings.executor == "ray":
        from layertap.runner.ray_engines import RayEngines

        return RayEngines(settings)
    return start_runner(*engine_start_args(settings))


def settle_engine_logging(settings: Settings) -> None:
    """Apply vLLM's logging configuration now, on the run's own thread before its tasks log, when its engine
    will run in this process (`vllm_seam.configure_logging_now` says why). Called only once engine work is
    in sight: importing vLLM takes seconds a run with nothing to extract need not spend."""
    if settings.executor == "ray":
        return
    options, _, idle_timeout = engine_start_args(settings)
    if idle_timeout is not None or options.runner_in_own_process():  # a warm engine's process, or the runner's
        return
    from layertap.runner.vllm_seam import configure_logging_now

    configure_logging_now()


def check_executor(settings: Settings) -> None:
    """Before a run writes anything: with the ray executor, join the cluster and check that the engines asked
    for fit it (a one-line error if not). Nothing to check for the local executor."""
    if settings.executor == "ray":
        from layertap.runner.ray_cluster import check_cluster

        check_cluster(settings)


def engine_start_args(settings: Settings) -> tuple:
    """`start_runner`'s arguments for these settings."""
    model, dtype, options, engine_dir, idle_timeout = runner_key(settings)
    return EngineOptions(model=model, dtype=dtype, **dict(options)), engine_dir, idle_timeout


def start_early(settings: Settings) -> threading.Thread:
    """Start (or attach to) the engine for these settings in the background, so it is up by the time the
    first batch asks for it; a failure is raised to that batch (unless the run has ended meanwhile)."""
    closings = _closings

    def start() -> None:
        try:
            _runner(settings)
        except BaseException as exc:  # noqa: BLE001 - handed to the first batch that asks
            with _lock:
                if _closings == closings:
                    _early_failures[runner_key(settings)] = exc

    settle_engine_logging(settings)  # here, before the run's tasks log while the engine starts beside them
    thread = threading.Thread(target=start, name=START_THREAD, daemon=True)
    thread.start()
    return thread


def start_runner(options: EngineOptions, engine_dir: str | None = None, idle_timeout: float | None = None):
    """A runner in this process, in one of its own (`EngineOptions.runner_process`; on a GPU by default), or,
    given an idle timeout, a warm engine in `engine_dir` shared with later runs."""
    from layertap.runner import warm_engine

    if idle_timeout is not None:
        return warm_engine.attach(options, idle_timeout, engine_dir)
    if not vllm_is_cpu_build():
        warm_engine.stop_engines(engine_dir, idle_only=True)  # an idle warm engine would hold the device's memory
    if options.runner_in_own_process():
        from layertap.runner.runner_process import RunnerProcess

        return RunnerProcess(options)
    from layertap.runner.vllm_runner import VllmRunner

    return VllmRunner(options)


def discard_runner(settings: Settings, only=None) -> bool:
    """Close and forget this settings' engine (after it failed), so a retry starts a fresh one.

    With `only`, the engine is forgotten only if it is still that one: a batch that saw an engine die must
    not discard the fresh engine another batch has started since.
    """
    key = runner_key(settings)
    with _lock:
        if only is not None and _runners.get(key) is not only:
            runner = only  # already replaced: close the dead one (closing twice is harmless), keep the new
        else:
            runner = _runners.pop(key, None)
    if runner is None:
        return False
    with contextlib.suppress(Exception):
        runner.close()
    return True


def discard_if_dead(settings: Settings, runner) -> bool:
    """After a failed batch: keep an engine that still answers, restart (on next use) one that does not.

    A batch can fail for its own reasons (a bad prompt, an injected fault) while the engine is fine, and
    restarting costs up to a minute; a dead or wedged engine fails the probe and is replaced.
    """
    probe = getattr(runner, "healthy", None)
    if probe is not None and probe():
        return False
    log.warning("the engine no longer answers: the next attempt starts a fresh one")
    return discard_runner(settings, only=runner)


def close_runners(force: bool = False) -> int:
    """Close every engine (unless pinned and not forced); returns how many were closed."""
    global _closings
    with _lock:
        if _pins and not force:
            return 0
        _closings += 1
        runners = list(_runners.values())
        _runners.clear()
        _early_failures.clear()
    for runner in runners:
        with contextlib.suppress(Exception):
            runner.close()
    ray_cluster = sys.modules.get("layertap.runner.ray_cluster")
    if ray_cluster is not None:  # a run that only checked its cluster (it had nothing to extract) leaves it too
        with contextlib.suppress(Exception):
            ray_cluster.disconnect()
    return len(runners)


@contextlib.contextmanager
def pin() -> Iterator[None]:
    """Keep engines open across flows inside this block; close them when the outermost pin ends."""
    global _pins
    with _lock:
        _pins += 1
    try:
        yield
    finally:
        with _lock:
            _pins -= 1
            last = _pins == 0
        if last:
            close_runners()


def engines_started() -> int:
    """How many engines this process has started so far (a rerun with nothing to do adds none)."""
    return _started


def runner_requests() -> int:
    """How many times work asked for an engine; unchanged across a run means the run did no model work."""
    return _requests


def engine_activity(settings: Settings):
    """The open engine's `EngineActivity` for these settings, or None when none is open (or it cannot say)."""
    runner = open_runner(settings)
    try:
        return runner.activity() if runner is not None else None
    except Exception:  # noqa: BLE001 - a dead engine has nothing to report; the run reports its own error
        return None


def open_runner(settings: Settings):
    """The engine already open for these settings, or None (never starts one)."""
    with _lock:
        return _runners.get(runner_key(settings))


def activity_when_attached(settings: Settings):
    """A warm engine's `EngineActivity` when this process attached to it (its counters span earlier runs),
    or None."""
    return getattr(open_runner(settings), "activity_when_attached", None)


def open_runners() -> int:
    """How many engines are open right now."""
    return len(_runners)
