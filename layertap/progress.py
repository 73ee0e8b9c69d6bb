"""Batch progress as plain events, so the CLI can draw a bar and a flow can update its UI artifact
without the pipeline knowing who is watching."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TextIO

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


class ProgressBar:
    """A one-line bar on a terminal stream: `[#####-----] 120/240 prompts, 3/6 batches, 41.0 prompts/s`."""

    def __init__(self, stream: TextIO = sys.stderr, width: int = 30) -> None:
        self.stream = stream
        self.width = width
        self.drawn = False

    def __call__(self, progress: Progress) -> None:
        filled = round(self.width * progress.fraction)
        rate = progress.prompts_done / progress.seconds if progress.seconds > 0 else 0.0
        line = (
            f"[{'#' * filled}{'-' * (self.width - filled)}] {progress.prompts_done}/{progress.prompts_total} "
            f"prompts, {progress.batches_done}/{progress.batches_total} batches, {rate:.1f} prompts/s"
        )
        self.stream.write("\r" + line)
        if progress.batches_done == progress.batches_total:
            self.stream.write("\n")
        self.stream.flush()
        self.drawn = True


def stopwatch() -> Callable[[], float]:
    started = time.perf_counter()
    return lambda: time.perf_counter() - started
