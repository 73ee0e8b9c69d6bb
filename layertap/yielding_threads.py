"""Thread pools for host-side work that must not slow the engine: Parquet encoding and value checks.

A batch's vectors are encoded and checked on the same cores that run vLLM's engine loop (in its own
process on a GPU, in this one on a CPU). The engine is the one serial path of a run: every core it loses
to an encoder delays every batch after it, while an encoder that waits a moment delays only its own
batch. On one H200 host the engine ran at ~60% of its rate while 16 encoders took every core
(bench/README.md). Threads of these pools therefore run at a lower scheduling priority (a higher nice
value, per thread on Linux): they still fill every idle core, and give way when the engine wants one.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

# Added to a pool thread's nice value. At +10 the kernel's fair scheduler gives a thread about a tenth of
# the share of one at the default priority, so the engine's threads keep their cores.
NICENESS = 10


def lower_this_threads_priority(niceness: int | None = None) -> None:
    """Raise the calling thread's nice value by `niceness` (default `NICENESS`); a no-op where threads
    cannot be given priorities of their own. Lowering a priority needs no privilege."""
    step = NICENESS if niceness is None else niceness
    if step <= 0 or not hasattr(os, "setpriority") or not hasattr(threading, "get_native_id"):
        return
    tid = threading.get_native_id()  # on Linux a thread id is a valid PRIO_PROCESS target: this thread only
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + step))
    except OSError:  # a sandbox may refuse it: the work still runs, at the default priority
        pass


def yielding_pool(max_workers: int | None, thread_name_prefix: str) -> ThreadPoolExecutor:
    """A thread pool whose threads run below the default priority (see the module's docstring)."""
    return ThreadPoolExecutor(max_workers, thread_name_prefix=thread_name_prefix,
                              initializer=lower_this_threads_priority)
