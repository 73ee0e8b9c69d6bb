"""The terminal progress of `layertap run`: prompts done, rate and time left on a rich bar, and log lines
(Prefect's console handler, plain stream handlers) printed above it whole, never into it."""

from __future__ import annotations

import io
import logging
import re
import time

from rich.console import Console

from layertap import progress
from layertap.terminal_progress import terminal_progress

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def screen(text: str) -> list[str]:
    """The lines a terminal shows once cursor moves and erases are applied (enough for rich's live area:
    cursor up N lines and erase line)."""
    lines: list[str] = [""]
    row = 0
    for token in re.split(r"(\x1b\[[0-9;?]*[A-Za-z]|\r|\n)", text):
        if not token:
            continue
        if token == "\n":
            row += 1
            if row == len(lines):
                lines.append("")
        elif token == "\r":
            continue
        elif token.startswith("\x1b["):
            code, arg = token[-1], token[2:-1]
            if code == "A":
                row = max(0, row - int(arg or 1))
            elif code == "K":
                lines[row] = ""
        else:
            lines[row] += token
    return [line for line in lines if line.strip()]


def test_the_bar_shows_prompts_rate_and_time_left():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, force_interactive=True, width=140, color_system=None)
    with terminal_progress(console) as drawer:
        progress.report(progress.Progress(0, 4, 0, 4096, 0.0))
        progress.report(progress.Progress(1, 4, 1024, 4096, 2.0))
        assert drawer.bar is not None
        drawer.bar.refresh()
        shown = screen(out.getvalue())[-1]
        assert re.search(r"embedding .* 1024/4096 prompts 1/4 batches 512\.0 prompts/s 0:00:06 left", shown), shown
        progress.report(progress.Progress(4, 4, 4096, 4096, 8.0))
        assert drawer.bar is None  # the last batch ends the bar
    final = screen(out.getvalue())
    assert re.search(r"4096/4096 prompts 4/4 batches 512\.0 prompts/s 0:00:00 left", final[-1]), final


def test_log_lines_are_printed_above_the_bar_whole(monkeypatch):
    """A Prefect console handler and a plain stream handler, both on the terminal's stream, log while the bar
    is live: each record is a line of its own above the bar, and the bar is whole below them."""
    from prefect.logging.handlers import PrefectConsoleHandler

    out = io.StringIO()
    monkeypatch.setattr("sys.stderr", out)
    console = Console(file=out, force_terminal=True, force_interactive=True, width=140, color_system=None)
    prefect_logger, plain_logger = logging.getLogger("lt-test.prefect"), logging.getLogger("lt-test.plain")
    prefect_handler, plain_handler = PrefectConsoleHandler(stream=out), logging.StreamHandler(out)
    prefect_logger.addHandler(prefect_handler)
    plain_logger.addHandler(plain_handler)
    # Only these handlers: the root logger's (Prefect's, set up by earlier tests) may write to a closed capture.
    monkeypatch.setattr(prefect_logger, "propagate", False)
    monkeypatch.setattr(plain_logger, "propagate", False)
    try:
        with terminal_progress(console) as drawer:
            progress.report(progress.Progress(0, 2, 0, 200, 0.0))
            drawer.bar.refresh()
            for i in range(3):
                prefect_logger.warning("Task run 'extract-batch-%d' - Finished in state Completed()", i)
                plain_logger.warning("engine warning number %d", i)
                progress.report(progress.Progress(0, 2, 10 * (i + 1), 200, 1.0 + i))
                drawer.bar.refresh()
                time.sleep(0.01)
            progress.report(progress.Progress(2, 2, 200, 200, 5.0))
        assert prefect_handler.console.file is out and plain_handler.stream is out  # given back
        prefect_logger.warning("after the bar")
    finally:
        prefect_logger.removeHandler(prefect_handler)
        plain_logger.removeHandler(plain_handler)

    lines = screen(out.getvalue())
    logged = [f"Task run 'extract-batch-{i}' - Finished in state Completed()" for i in range(3)]
    logged += [f"engine warning number {i}" for i in range(3)]
    for message in logged:
        [line] = [line for line in lines if message in line]
        assert "prompts" not in line, lines  # no record shares a line with the bar
    assert [line for line in lines if "prompts/s" in line] == [lines[-2]], lines  # one bar, below the records
    assert "200/200 prompts 2/2 batches" in lines[-2] and lines[-1].endswith("after the bar")
