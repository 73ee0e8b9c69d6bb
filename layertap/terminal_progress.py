"""The progress `layertap run` draws on a terminal: prompts done, rate and time left, as a rich progress bar.

While the bar is live, log lines (Prefect's console handler, vLLM's and any other handler writing to the
terminal) are printed above it, whole, instead of into it: each handler that writes to the terminal gets,
for the bar's lifetime, a stream that hands complete lines to the bar's console, and whatever else writes
to `sys.stderr` meanwhile goes through it too (only writes below Python, to the file descriptor, cannot). The bar starts with the
first progress report (extraction starting) and ends with the last batch, or when the run stops.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.text import Text

from layertap import progress as run_progress


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "-:--:--"
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class _AboveTheBar:
    """A stream for a log handler: each complete line is printed by the bar's console, which puts it above the
    bar. (rich's own FileProxy will not do: a rich Console writing to it unwraps it and writes to the terminal
    directly, through the bar.)"""

    def __init__(self, console: Console, original) -> None:
        self.console, self.original = console, original
        self._pending = ""

    def write(self, text: str) -> int:
        *lines, self._pending = (self._pending + text).split("\n")
        if lines:
            self.console.print(Text("\n").join(Text.from_ansi(line) for line in lines), soft_wrap=True)
        return len(text)

    def flush(self) -> None:
        if self._pending:
            pending, self._pending = self._pending, ""
            self.console.print(Text.from_ansi(pending), soft_wrap=True)

    def isatty(self) -> bool:
        return self.original.isatty()

    def fileno(self) -> int:
        return self.original.fileno()

    @property
    def encoding(self) -> str:
        return getattr(self.original, "encoding", "utf-8")


class TerminalProgress:
    """A `layertap.progress` listener drawing one bar on `console` (default: stderr)."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self.bar: Progress | None = None
        self._task = None
        self._swapped: list[tuple[object, str, object]] = []

    def __call__(self, report: run_progress.Progress) -> None:
        rate = report.prompts_done / report.seconds if report.seconds > 0 else 0.0
        left = (report.prompts_total - report.prompts_done) / rate if rate > 0 else None
        fields = {"batches": f"{report.batches_done}/{report.batches_total}", "rate": rate, "left": _clock(left)}
        if self.bar is None:
            self._start(report.prompts_total, fields)
        self.bar.update(self._task, completed=report.prompts_done, total=report.prompts_total, **fields)
        if report.batches_done >= report.batches_total:
            self.stop()

    def _start(self, total: int, fields: dict) -> None:
        self.bar = Progress(
            TextColumn("embedding"), BarColumn(), MofNCompleteColumn(), TextColumn("prompts"),
            TextColumn("{task.fields[batches]} batches"), TextColumn("{task.fields[rate]:.1f} prompts/s"),
            TextColumn("{task.fields[left]} left"),
            # stderr written while the bar is live (Python's warnings, loggers set up meanwhile, as vLLM's
            # are when its engine starts) goes above it too; stdout carries the run's result.
            console=self.console, refresh_per_second=4, redirect_stdout=False, redirect_stderr=True,
        )
        self._task = self.bar.add_task("embedding", total=total, **fields)
        self._route_logs()
        self.bar.start()

    def _route_logs(self) -> None:
        """Every logging handler that writes to this terminal writes through the bar's console instead."""
        terminal = {id(stream) for stream in (sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__,
                                              self.console.file)}
        loggers = [logging.getLogger()] + [
            logger for logger in list(logging.Logger.manager.loggerDict.values()) if isinstance(logger, logging.Logger)]
        seen = set()
        for handler in (h for logger in loggers for h in logger.handlers):
            if id(handler) in seen:
                continue
            seen.add(id(handler))
            console = getattr(handler, "console", None)  # rich's own handlers, Prefect's console handler
            if isinstance(console, Console) and console is not self.console and id(console.file) in terminal:
                self._swapped.append((console, "file", console.file))
                console.file = _AboveTheBar(self.console, console.file)
            elif isinstance(handler, logging.StreamHandler) and id(handler.stream) in terminal:
                original = handler.stream
                try:
                    handler.stream = _AboveTheBar(self.console, original)
                except AttributeError:  # a handler whose stream is not its own to set (logging's last resort)
                    continue
                self._swapped.append((handler, "stream", original))

    def stop(self) -> None:
        """End the bar (left on screen as it last was) and give the log handlers their streams back."""
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
        for owner, name, original in reversed(self._swapped):
            proxy = getattr(owner, name)
            if isinstance(proxy, _AboveTheBar):
                proxy.flush()  # a line not yet ended still reaches the terminal
            setattr(owner, name, original)
        self._swapped.clear()


@contextlib.contextmanager
def terminal_progress(console: Console | None = None) -> Iterator[TerminalProgress]:
    """Draw the run's progress inside this block; the bar stops with it, however it ends."""
    drawer = TerminalProgress(console)
    try:
        with run_progress.listen(drawer):
            yield drawer
    finally:
        drawer.stop()
