"""What a Prefect task run and a store open cost on the flow's thread while other threads run Python.

On the H200 a 100,000-prompt run spent 31.8 s validating and 25.4 s publishing 98 batches on the flow's
thread, though a batch's file checks take ~20 ms. The flow's process also runs vLLM's engine loop (Python,
when the engine core is in the process), the writers and the checkers. A thread that gives up Python's lock
for I/O waits up to the switch interval (5 ms by default) to get it back from a thread that computes in
Python, at every such release. This times, on the flow's thread, a no-op Prefect task run and a DuckDB
store open + query + close, idle and beside `--busy` threads that spin in Python, at several switch
intervals, and writes bench/results/task_overhead-<date>.json.

    .venv/bin/python bench/task_overhead.py [--calls 50] [--busy 1] [--no-save]
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import tempfile
import threading
import time
from pathlib import Path

import duckdb

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_stages import machine, save_results  # noqa: E402


class Spinners:
    """`count` threads computing in Python until stopped, as an engine loop in the same process does."""

    def __init__(self, count: int):
        self.count, self._stop = count, threading.Event()

    def _spin(self) -> None:
        x = 0
        while not self._stop.is_set():
            for _ in range(1000):
                x += 1

    def __enter__(self):
        self._threads = [threading.Thread(target=self._spin, daemon=True) for _ in range(self.count)]
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for thread in self._threads:
            thread.join()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--busy", type=int, default=1, help="threads spinning in Python beside the flow")
    parser.add_argument("--no-save", action="store_true", help="print only; do not write bench/results/")
    args = parser.parse_args()

    from prefect import flow, task
    from prefect.cache_policies import NO_CACHE
    from prefect.testing.utilities import prefect_test_harness

    @task(cache_policy=NO_CACHE)
    def noop(value: int) -> int:
        return value

    database = Path(tempfile.mkdtemp(prefix="layertap-task-overhead-")) / "store.duckdb"
    with duckdb.connect(str(database)) as con:
        con.execute("CREATE TABLE parts AS SELECT range AS id FROM range(100000)")

    def store_open() -> None:
        with duckdb.connect(str(database)) as con:
            con.execute("SELECT count(*) FROM parts").fetchone()

    @flow
    def timed(calls: int) -> dict[str, float]:
        started = time.perf_counter()
        for i in range(calls):
            noop(i)
        task_ms = (time.perf_counter() - started) / calls * 1000
        started = time.perf_counter()
        for _ in range(calls):
            store_open()
        return {"prefect_task_ms": round(task_ms, 2),
                "store_open_ms": round((time.perf_counter() - started) / calls * 1000, 2)}

    default_interval = sys.getswitchinterval()
    rows = []
    with prefect_test_harness():
        timed(5)  # Prefect's first task run pays for imports and registration
        rows.append({"busy_threads": 0, "switch_interval_ms": default_interval * 1000, **timed(args.calls)})
        for interval in (default_interval, 0.001, 0.0005):
            sys.setswitchinterval(interval)
            with Spinners(args.busy):
                rows.append({"busy_threads": args.busy, "switch_interval_ms": interval * 1000, **timed(args.calls)})
        sys.setswitchinterval(default_interval)
    for row in rows:
        print(row)
    report = {"date": dt.date.today().isoformat(), "machine": machine(), "command": "python " + " ".join(sys.argv),
              "calls": args.calls, "rows": rows}
    if not args.no_save:
        save_results("task_overhead", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
