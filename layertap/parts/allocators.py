"""Allocators of a process that encodes parts: memory its encoders free goes back to the system, not kept.

Encoding a 7B model's vectors makes and frees buffers at about a gigabyte a second on every encoder thread.
At their defaults both allocators keep what was freed for reuse: pyarrow's mimalloc pool in each thread's
heap, and glibc, which raises its mmap threshold to the largest block freed so far (up to 32 MiB), after which
such blocks come from heaps it seldom shrinks. With 16 encoders the flow's process held about 0.3 GiB more
at its peak than with Arrow's jemalloc pool and a fixed threshold (bench/host_side_memory.py).
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading

ARROW_POOL = "jemalloc"
# Blocks this large or larger are mapped when made and unmapped when freed (glibc's M_MMAP_THRESHOLD).
MMAP_THRESHOLD_BYTES = 4 << 20
_M_MMAP_THRESHOLD = -3

_lock = threading.Lock()
_threshold_fixed = False


def choose_arrow_pool() -> None:
    """Ask Arrow for its jemalloc pool unless the user chose one (ARROW_DEFAULT_MEMORY_POOL). Arrow reads the
    variable once, when pyarrow is first imported, so the package does this before any of its modules import
    pyarrow; processes started from this one inherit it."""
    if sys.platform.startswith("linux") and not os.environ.get("ARROW_DEFAULT_MEMORY_POOL"):  # pyarrow's Linux
        os.environ["ARROW_DEFAULT_MEMORY_POOL"] = ARROW_POOL  # wheels carry jemalloc


def fix_mmap_threshold() -> bool:
    """Keep glibc's mmap threshold at `MMAP_THRESHOLD_BYTES` in this process from now on (a fixed value also
    stops glibc raising it); once per process, when it starts encoding parts. False where there is no glibc."""
    global _threshold_fixed
    with _lock:
        if _threshold_fixed:
            return True
        try:
            mallopt = ctypes.CDLL(None).mallopt
        except (OSError, AttributeError):  # not glibc (or no C library to ask)
            return False
        mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        _threshold_fixed = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
        return _threshold_fixed
