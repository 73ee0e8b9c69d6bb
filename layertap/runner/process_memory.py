"""Memory a process holds with the processes it started (vLLM's engine core among them), read from /proc
and, for device memory, NVIDIA's management library when it is installed."""

from __future__ import annotations

from pathlib import Path


def process_tree(pid: int) -> list[int]:
    """`pid` and every process descended from it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(children.get(current, []))
    return tree


def tree_rss_bytes(pid: int) -> int:
    """Resident host memory of `pid` and its descendants (shared pages counted in each)."""
    total = 0
    for member in process_tree(pid):
        try:
            for line in Path(f"/proc/{member}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except (OSError, ValueError):
            continue
    return total


def device_bytes(pid: int) -> int | None:
    """GPU memory used by `pid` and its descendants, or None where NVIDIA's library is not available."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver: no device memory to report
        return None
    try:
        members = set(process_tree(pid))
        used = 0
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if process.pid in members and process.usedGpuMemory:
                    used += process.usedGpuMemory
        return used
    except Exception:  # noqa: BLE001 - a reading is optional
        return None
    finally:
        pynvml.nvmlShutdown()


