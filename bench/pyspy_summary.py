"""Where a profiled run's CPU went, from py-spy's raw output (`gpu_extract.py` with `BENCH_PYSPY`).

py-spy samples running threads only (idle ones are left out), so a process's samples divided by the rate
are its busy CPU seconds as Python threads saw them. Per process (the benchmark's own, the runner, vLLM's
engine core, Prefect's server) this counts samples by thread, by the innermost Python function (time in
its native callees included), by the innermost frame of all (native code named by library), and by every
Python function on the stack (inclusive).

    python bench/pyspy_summary.py pyspy-layertap-100000.txt [--rate 50] [--top 30]
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter, defaultdict
from pathlib import Path

_PROCESS = re.compile(r'process (\d+):"([^"]*)";')  # one per process from the profiled one down
_THREAD = re.compile(r"^thread \((?:0x)?[0-9a-fA-F]+\): ?(.*)$")
_PYTHON = re.compile(r"^(.*) \((.+\.py):\d+\)$")
_NATIVE = re.compile(r"^(.*) \(([^()]*)\)$")
_NUMBERS = re.compile(r"\d+")


def _process_name(pid: str, command: str) -> str:
    if "VLLM::" in command or command.startswith("VLLM"):
        return f"engine core {pid}"
    if "--worker" in command:
        return f"benchmark {pid}"
    if "multiprocessing" in command or "spawn_main" in command:
        return f"runner {pid}"
    if "uvicorn" in command or "prefect" in command:
        return f"prefect server {pid}"
    return f"{command[:40]} {pid}"


def _frame(frame: str) -> tuple[str, bool]:
    """(a short name, whether it is a Python frame): Python frames lose their line numbers, native
    frames at a bare address are named by their library."""
    python = _PYTHON.match(frame)
    if python:
        return f"{python[1]} ({Path(python[2]).name})", True
    native = _NATIVE.match(frame)
    if native:
        function, library = native[1], Path(native[2]).name
        return (f"? ({library})" if function.startswith("0x") else f"{function} ({library})"), False
    return frame, False


def summarise(path: str | Path, rate: float = 50.0, top: int = 30) -> dict:
    """Per process: busy seconds, and the top threads, innermost Python functions, innermost frames and
    inclusive Python functions by seconds."""
    counters: dict[str, dict[str, Counter]] = defaultdict(lambda: defaultdict(Counter))
    by_thread: dict[str, dict[str, Counter]] = defaultdict(lambda: defaultdict(Counter))  # innermost Python
    for line in Path(path).read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        samples = int(count)
        process, at = "this process", 0
        while found := _PROCESS.match(stack, at):  # a command line may hold ";"
            process, at = _process_name(found[1], found[2]), found.end()
        frames = stack[at:].split(";")
        thread = "?"
        if frames and (found := _THREAD.match(frames[0])):
            thread = _NUMBERS.sub("N", found[1] or "unnamed")
            frames = frames[1:]
        named = [_frame(f) for f in frames]
        python = [name for name, is_python in named if is_python]
        innermost = python[-1] if python else "(no Python frame)"
        of = counters[process]
        of["threads"][thread] += samples
        of["innermost_python"][innermost] += samples
        of["innermost_frame"][named[-1][0] if named else "(empty)"] += samples
        for name in set(python):
            of["inclusive_python"][name] += samples
        by_thread[process][thread][innermost] += samples

    def seconds(counter: Counter, n: int = top) -> list[list]:
        return [[name, round(samples / rate, 2)] for name, samples in counter.most_common(n)]

    report = {}
    for process, of in sorted(counters.items(), key=lambda item: -item[1]["threads"].total()):
        report[process] = {
            "busy_s": round(of["threads"].total() / rate, 2),
            "threads": seconds(of["threads"]),
            "innermost_python": seconds(of["innermost_python"]),
            "innermost_frame": seconds(of["innermost_frame"]),
            "inclusive_python": seconds(of["inclusive_python"]),
            "innermost_python_by_thread": {thread: seconds(by_thread[process][thread], 12)
                                           for thread, _ in of["threads"].most_common(6)},
        }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("raw")
    parser.add_argument("--rate", type=float, default=50.0, help="the rate py-spy sampled at (per second)")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    print(json.dumps(summarise(args.raw, args.rate, args.top), indent=1))


if __name__ == "__main__":
    main()
