"""Host work that yields to the engine: the threads that encode and check parts run at a lower CPU priority.

On a GPU machine the engine's processes (the runner's frontend and vLLM's engine core) each keep a core busy
feeding the GPU, while a run of short prompts hands the host more than a gigabyte of vectors a second to
encode. When encoders take every core, the engine waits for CPU and the GPU idles. Encoding at a higher
nice value lets the scheduler run the engine first and give encoders everything left over; on an idle
machine it changes nothing.
"""

from __future__ import annotations

import os
import threading

# The nice value part writers and checkers run at (0 leaves them at the process's own priority).
BACKGROUND_NICE = 10


def lower_this_thread() -> None:
    """Lower the calling thread's CPU priority to `BACKGROUND_NICE` (Linux sets priority per thread);
    threads it starts inherit it. A thread pool's initializer; never raises."""
    if not BACKGROUND_NICE or not hasattr(os, "setpriority"):
        return
    try:
        thread = threading.get_native_id()
        current = os.getpriority(os.PRIO_PROCESS, thread)
        if current < BACKGROUND_NICE:
            os.setpriority(os.PRIO_PROCESS, thread, BACKGROUND_NICE)
    except OSError:  # a sandbox that forbids it: run at the process's priority
        pass
