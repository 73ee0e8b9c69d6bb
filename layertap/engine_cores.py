"""Cores of their own for the processes that feed the GPU; the run's host work goes on the others.

On a GPU the runner's process (vLLM's frontend) and vLLM's engine core each keep a thread busy preparing
steps; how fast they do it sets how busy the GPU is. A run of short prompts hands the host more than a
gigabyte of vectors a second to encode, and its encoders then run on most cores. Where a core has two
hardware threads, a lower priority does not help: an encoder on the engine's core's sibling thread runs at
the same time and slows it. So once its engine is up, a runner in a process of its own moves itself and the
engine core onto `ENGINE_CORES` whole physical cores, and the encoding and checking threads of the process
that started it keep off those cores. Machines with fewer than `MIN_CORES` physical cores are left alone:
there the engine's threads need every core they can get while it starts, and encoders are few.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

# Physical cores kept for the engine's processes (the runner's frontend and vLLM's engine core).
ENGINE_CORES = 2
# Fewest physical cores a process may run on before any are kept for the engine.
MIN_CORES = 8

_SYSFS = Path("/sys/devices/system/cpu")
_reserved = False


@dataclasses.dataclass(frozen=True)
class CoreSplit:
    """Logical CPUs for the engine's processes and for everything else, as whole physical cores."""

    engine: frozenset[int]
    host: frozenset[int]


def physical_cores(allowed: set[int], sysfs: Path = _SYSFS) -> list[tuple[int, ...]]:
    """`allowed` grouped by physical core (hardware threads of one core together), in CPU order. A CPU whose
    topology cannot be read counts as a core of its own."""
    cores: dict[tuple[int, ...], None] = {}
    for cpu in sorted(allowed):
        siblings = _cpu_list(sysfs / f"cpu{cpu}" / "topology" / "thread_siblings_list")
        cores[tuple(sorted((siblings or {cpu}) & allowed))] = None
    return list(cores)


def split(cores: list[tuple[int, ...]], engine_cores: int = ENGINE_CORES,
          min_cores: int = MIN_CORES) -> CoreSplit | None:
    """The last `engine_cores` physical cores for the engine, the rest for the host; None (no split) when
    fewer than `min_cores` cores or `engine_cores` is 0. The last ones: the kernel steers much of its
    interrupt work to the first CPUs."""
    if engine_cores <= 0 or len(cores) < max(min_cores, engine_cores + 1):
        return None
    return CoreSplit(engine=frozenset(cpu for core in cores[-engine_cores:] for cpu in core),
                     host=frozenset(cpu for core in cores[:-engine_cores] for cpu in core))


@functools.cache
def core_split() -> CoreSplit | None:
    """This process's split of the CPUs it may run on (the same in the processes it starts)."""
    allowed = _allowed()
    return split(physical_cores(allowed), ENGINE_CORES, MIN_CORES) if allowed else None


def keep_engine_cores() -> None:
    """Move this process (the runner's, its engine up) and the processes it started (vLLM's engine core)
    onto the engine's cores. Threads and processes started later inherit them. Never raises."""
    cores = core_split()
    if cores is None:
        return
    moved = pin_process_tree(os.getpid(), cores.engine)
    log.info("engine processes moved to CPUs %s (%d threads)", _cpu_text(cores.engine), moved)


def reserve_for_engine() -> None:
    """Called where a runner in a process of its own is started: from now on this process's host threads
    (`confine_this_thread`) keep off the engine's cores."""
    global _reserved
    _reserved = True


def host_cpus() -> frozenset[int] | None:
    """The CPUs this process's encoding and checking threads run on: all it may use (None) unless an engine
    process it started keeps cores of its own."""
    cores = core_split() if _reserved else None
    return cores.host if cores is not None else None


def confine_this_thread() -> None:
    """Keep the calling thread (an encoder's or a checker's, as it starts) off the engine's cores, if an
    engine process keeps any; threads it starts inherit it. Never raises."""
    cpus = host_cpus()
    if cpus is not None:
        _set_affinity(0, cpus)


def pin_process_tree(pid: int, cpus: frozenset[int] | set[int]) -> int:
    """Let every thread of process `pid` and of its descendants run only on `cpus`; returns how many threads
    were moved (a thread or process that ends meanwhile is skipped)."""
    moved = 0
    for process in [pid, *_descendants(pid)]:
        try:
            threads = [int(t) for t in os.listdir(f"/proc/{process}/task")]
        except OSError:
            continue
        moved += sum(_set_affinity(thread, cpus) for thread in threads)
    return moved


def _descendants(pid: int) -> list[int]:
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                children = Path(f"/proc/{parent}/task/{task}/children").read_text().split()
            except OSError:
                continue
            found.extend(int(c) for c in children)
            frontier.extend(int(c) for c in children)
    return found


def _set_affinity(thread: int, cpus: frozenset[int] | set[int]) -> bool:
    try:
        os.sched_setaffinity(thread, cpus)
        return True
    except (OSError, AttributeError):  # gone meanwhile, a sandbox that forbids it, or no affinity API
        return False


def _allowed() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (OSError, AttributeError):
        return set()


def _cpu_list(path: Path) -> set[int]:
    """A sysfs CPU list ("0-3,8,10-11") as a set; empty if it cannot be read."""
    try:
        text = path.read_text().strip()
    except OSError:
        return set()
    cpus: set[int] = set()
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def _cpu_text(cpus: frozenset[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))
