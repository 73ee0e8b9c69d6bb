"""Records every garbage-collector pass of 10 ms or more in each Python process started with this folder
on PYTHONPATH and BENCH_GC_TRACE naming a folder: one line per pass, "<epoch s> <generation> <ms>
<collected>", in <folder>/gc-<pid>-<name>.log (`bench/gpu_extract.py` puts it there for a mode's processes,
the flow's, the runner's and vLLM's engine core, so a pause in any of them can be lined up with the
engine's timeline)."""

import os

if os.environ.get("BENCH_GC_TRACE"):
    import gc
    import sys
    import time

    _folder, _started = os.environ["BENCH_GC_TRACE"], [0.0]

    def _note(phase, info):
        if phase == "start":
            _started[0] = time.perf_counter()
            return
        ms = (time.perf_counter() - _started[0]) * 1000
        if ms >= 10:
            name = os.path.basename(sys.argv[0] or "python") if sys.argv else "python"
            with open(os.path.join(_folder, f"gc-{os.getpid()}-{name}.log"), "a") as log:
                log.write(f"{time.time():.3f} {info['generation']} {ms:.1f} {info['collected']}\n")

    gc.callbacks.append(_note)
