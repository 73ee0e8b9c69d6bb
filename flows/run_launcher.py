"""Start each served flow run in a process forked from one that has already imported Prefect and the flows.

Prefect's runner starts a run of a served deployment in a freshly spawned interpreter
(`prefect.flow_engine.run_flow_in_subprocess`), which imports Prefect, the flow's module and layertap all
over again: about 2 s of a triggered run whose work, on a warm engine, takes about as long. The standard
library's forkserver does those imports once, when `layertap serve` starts, and forks a ready process per
run. The run gets the same pickled call, environment and start-up preparation (working directory, sys.path)
as a spawned one, so it runs, reports, is watched and cancelled exactly as before: only the kind of process
differs. Prefect's direct-subprocess starter calls `run_flow_in_subprocess` through its module, the place
Prefect names for overriding it. With a Prefect whose function no longer spawns, runs are left as they are.
"""

from __future__ import annotations

import inspect
import multiprocessing
import sys
import types
from collections.abc import Iterable

from prefect.logging import get_logger

logger = get_logger("layertap.serve")

# Packages whose loaded modules the fork server imports: the flows, their tasks and the library.
PRELOADED_PACKAGES = ("flows", "tasks", "layertap")
# Imported by a run but not by loading the flows: the engine that runs it, and the warm engine's client.
RUN_MODULES = ("prefect.flow_engine", "layertap.runner.runner_client")
_SPAWN_CALL = 'multiprocessing.get_context("spawn")'


class _Forking:
    """Stands in for the `multiprocessing` module inside a copy of `run_flow_in_subprocess`: the copy asks it
    for the spawn context and gets the fork server's."""

    def __init__(self, context):
        self._context = context

    def get_context(self, method=None):
        return self._context

    def __getattr__(self, name):
        return getattr(multiprocessing, name)


def preload_modules(loaded: Iterable[str] | None = None) -> list[str]:
    """What the fork server imports: the loaded modules of PRELOADED_PACKAGES (the served flows and all they
    import; torch and vLLM stay out, since the flows import them only in engine processes) and RUN_MODULES."""
    names = sys.modules if loaded is None else loaded
    found = {name for name in names if name.split(".")[0] in PRELOADED_PACKAGES}
    return sorted(found | set(RUN_MODULES))


def start_runs_forked(preload: list[str]) -> bool:
    """Have Prefect's runner start flow runs from a fork server that has imported `preload`; start that
    server now, so the first run does not wait for it. Returns False (runs spawn as before) where this
    Prefect's starter cannot be pointed at it."""
    try:
        import prefect.flow_engine as engine
        import prefect.runner._starter_direct as starter
    except ImportError:
        return _unchanged("this Prefect has no direct-subprocess starter")
    original = getattr(starter, "run_flow_in_subprocess", None)
    known = original is not None and original is getattr(engine, "run_flow_in_subprocess", None)
    if not known or _SPAWN_CALL not in inspect.getsource(original):
        return _unchanged("this Prefect's run_flow_in_subprocess is not the spawning one layertap knows")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(preload)
    forked = types.FunctionType(original.__code__, {**original.__globals__, "multiprocessing": _Forking(context)},
                                original.__name__, original.__defaults__, original.__closure__)
    forked.__kwdefaults__ = original.__kwdefaults__
    forked.__doc__ = original.__doc__
    starter.run_flow_in_subprocess = forked
    from multiprocessing import forkserver

    forkserver.ensure_running()
    return True


def _unchanged(why: str) -> bool:
    logger.warning("%s: served runs start in spawned processes", why)
    return False
