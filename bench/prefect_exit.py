"""What Prefect's start and exit add to a flow call, and how much of it is the flow run's heartbeat thread.

A flow run sends heartbeats (for detecting crashed runs) from a thread that sleeps in one-second steps and is
joined when the run ends, so the call returns only once that thread wakes up: up to a second after the
flow's body has returned. This times calls of a flow whose body sleeps for given seconds, with Prefect's
default heartbeat settings and with heartbeats off, and writes bench/results/prefect_exit-<date>.json.

    .venv/bin/python bench/prefect_exit.py [--calls 5] [--body 0,0.5,1.5,2.3] [--no-save]
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_stages import machine, save_results  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5, help="calls per body length and setting")
    parser.add_argument("--body", default="0,0.5,1.5,2.3", help="seconds the flow's body sleeps, comma-separated")
    parser.add_argument("--no-save", action="store_true", help="print only; do not write bench/results/")
    args = parser.parse_args()

    import prefect
    from prefect import flow
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    @flow(name="sleeper")
    def sleeper(seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    sleeper(0)  # starts Prefect's temporary server: not part of any call below
    bodies = [float(b) for b in args.body.split(",")]
    settings = {"default": {}, "heartbeats off": {PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}}
    results = {}
    for label, updates in settings.items():
        with temporary_settings(updates=updates):
            frequency = PREFECT_FLOWS_HEARTBEAT_FREQUENCY.value()
            for body in bodies:
                overheads = []
                for _ in range(args.calls):
                    start = time.perf_counter()
                    sleeper(body)
                    overheads.append(time.perf_counter() - start - body)
                results.setdefault(label, {"heartbeat_frequency_s": frequency})[f"body_{body}s"] = {
                    "overhead_s_median": round(statistics.median(overheads), 3),
                    "overhead_s_min": round(min(overheads), 3), "overhead_s_max": round(max(overheads), 3)}
                print(f"{label:15s} body {body:4.1f} s: call - body = {statistics.median(overheads):.3f} s median "
                      f"({min(overheads):.3f}-{max(overheads):.3f})")
    report = {
        "date": dt.date.today().isoformat(), "machine": machine(), "prefect": prefect.__version__,
        "python": sys.version.split()[0], "command": "python " + " ".join(sys.argv), "calls": args.calls,
        "results": results,
    }
    if not args.no_save:
        save_results("prefect_exit", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
