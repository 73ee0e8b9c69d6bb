"""Named fault points, so tests can crash, fail or starve a real run at a chosen moment.

The pipeline calls `hit("<point>")` at the moments a crash or a failure matters (inside a transaction,
half-way through a Parquet file, at the engine boundary). Normally `LAYERTAP_FAULTS` is unset and a hit
is one environment lookup. When set, it holds a comma list of `<point>:<action>`:

    kill@N      SIGKILL this process the N-th time the point is reached (crash-safety tests)
    error*N     raise `InjectedFault` the first N times the point is reached (no N: every time)
    oom>K       raise `torch.OutOfMemoryError` whenever the batch holds more than K prompts
    die@N       the N-th time, close the engine under the caller and raise `EngineError` (a dead engine)
    poison=S    raise `InjectedFault` whenever a prompt of the batch contains S
    oserror=E   raise `OSError` with errno E (a name, e.g. ENOSPC) every time (a full or read-only disk)
    wait=PATH   hold this process here until the file PATH exists (a run that keeps the store for a while)
    killonce=F  SIGKILL this process the first time any process reaches the point: the one that creates the
                file F (an absolute path) first is killed, later ones go on (an engine actor dying once)
    killon=S    SIGKILL this process whenever a prompt of the batch contains S (a batch that kills its engine)
    hangonce=F  sleep an hour the first time any process reaches the point (the one that creates F): a hung batch

Counters live in this process, so a child process started with the variable counts from zero; `killonce`
counts across processes through its file. A run's faults reach its engines on a Ray cluster with each batch
(`follow`), so engines started before the variable was set obey it too.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Sequence
from typing import Any

ENV = "LAYERTAP_FAULTS"

_SPEC = re.compile(
    r"^(?P<point>[\w.-]+):(?P<action>kill@|error\*?|oom>|die@|poison=|oserror=|wait=|killonce=|killon=|hangonce=)"
    r"(?P<arg>.*)$")
_lock = threading.Lock()
_counts: dict[tuple[str, str], int] = {}


class InjectedFault(RuntimeError):
    """A failure a test asked for; never raised unless LAYERTAP_FAULTS names the point."""


def _parse(value: str) -> list[tuple[str, str, str]]:
    faults = []
    for item in filter(None, (part.strip() for part in value.split(","))):
        match = _SPEC.match(item)
        if match is None:
            raise ValueError(
                f"{ENV}: cannot read {item!r} (expected <point>:kill@N|error*N|oom>K|die@N|poison=S|oserror=E|"
                "wait=PATH|killonce=F|killon=S|hangonce=F)")
        faults.append((match["point"], match["action"], match["arg"]))
    return faults


def _count(point: str, item: str) -> int:
    with _lock:
        _counts[(point, item)] = n = _counts.get((point, item), 0) + 1
    return n


def hit(point: str, texts: Sequence[str] | None = None, engine: Any = None) -> None:
    """Apply any fault configured for `point`; `texts` is the batch at the engine boundary, `engine` its
    runner (closed by `die`)."""
    value = os.environ.get(ENV)
    if not value:
        return
    for name, action, arg in _parse(value):
        if name != point:
            continue
        if action == "oom>":
            if texts is not None and len(texts) > int(arg):
                import torch

                raise torch.OutOfMemoryError(f"injected out of memory at {point} ({len(texts)} prompts > {arg})")
            continue
        if action == "poison=":
            if texts is not None and any(arg in text for text in texts):
                raise InjectedFault(f"injected failure at {point}: a prompt contains {arg!r}")
            continue
        if action == "wait=":
            while not os.path.exists(arg):
                time.sleep(0.1)
            continue
        if action == "killon=":
            if texts is not None and any(arg in text for text in texts):
                os.kill(os.getpid(), signal.SIGKILL)
            continue
        if action in ("killonce=", "hangonce="):
            try:
                os.close(os.open(arg, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                continue
            if action == "hangonce=":
                time.sleep(3600)
                continue
            os.kill(os.getpid(), signal.SIGKILL)
        n = _count(point, action + arg)
        if action == "oserror=":
            import errno

            code = getattr(errno, arg)
            raise OSError(code, os.strerror(code), f"injected at {point}")
        if action == "kill@" and n == int(arg):
            os.kill(os.getpid(), signal.SIGKILL)
        elif action.startswith("error") and (not arg or n <= int(arg)):
            raise InjectedFault(f"injected failure at {point} (hit {n})")
        elif action == "die@" and n == int(arg):
            from layertap.errors import EngineError

            if engine is not None:
                engine.close()
            raise EngineError(f"injected engine death at {point}")


def active() -> str | None:
    """This process's fault spec (the variable's value), to hand to the processes that run its batches."""
    return os.environ.get(ENV) or None


def follow(spec: str | None) -> None:
    """Take the faults of the run whose batch this process runs (an engine actor): `spec` as `active()` gave
    it in the run's process."""
    if spec == active():
        return
    if spec:
        _parse(spec)
        os.environ[ENV] = spec
    else:
        os.environ.pop(ENV, None)


def reset() -> None:
    """Forget the hit counters (tests that reuse one process)."""
    with _lock:
        _counts.clear()
