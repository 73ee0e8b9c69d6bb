"""Batch progress as plain events, so the CLI can draw a bar (`layertap.terminal_progress`) and a flow can
update its UI artifact without the pipeline knowing who is watching."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

_listeners: list[Callable[[Progress], None]] = []


@dataclass(frozen=True)
class Progress:
    batches_done: int
    batches_total: int
    prompts_done: int
    prompts_total: int
    seconds: float

    @property
    def fraction(self) -> float:
        return self.prompts_done / self.prompts_total if self.prompts_total else 1.0


@contextlib.contextmanager
def listen(callback: Callable[[Progress], None]) -> Iterator[None]:
    """Call `callback` with every progress report made inside this block."""
    _listeners.append(callback)
    try:
        yield
    finally:
        _listeners.remove(callback)


def report(progress: Progress) -> None:
    for callback in list(_listeners):
        callback(progress)


def stopwatch() -> Callable[[], float]:
    started = time.perf_counter()
    return lambda: time.perf_counter() - started
