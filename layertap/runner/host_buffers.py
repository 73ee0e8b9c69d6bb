"""Reusable host buffers that captured vectors are copied into, shared with the engine's worker.

vLLM's worker, in the caller's process or in an engine process of its own, copies each finished prompt's
vectors from the device straight into one of these buffers, so hundreds of megabytes per batch never
travel through vLLM's output messages. Each buffer is a file in shared memory (`/dev/shm` when there is
room, else the temporary directory): the caller reads it to write Parquet, and the worker maps it by path
once (or, in the caller's process, takes the pool's own mapping) and locks its pages for asynchronous
device-to-host copies.

A buffer is raw bytes: each batch views it in the engine's own precision (bfloat16 or float16 vectors
take half the memory of float32 ones). Buffers are allocated at their exact size, handed back by the
caller when its vectors are written, and reused by later batches. A buffer dropped from the pool is
unlinked; the worker forgets mappings whose file is gone. A process killed before it could clean up
leaves its directory behind (memory, in `/dev/shm`): the directory is named after the process, and the
next pool made on the machine removes directories whose process is gone.
"""

from __future__ import annotations

import errno
import math
import os
import re
import shutil
import tempfile
import threading
import weakref
from dataclasses import dataclass

import torch

SHARED_MEMORY = "/dev/shm"
PREFIX = "layertap-host-"
_OWNED = re.compile(rf"{PREFIX}(\d+)-")


@dataclass(eq=False)
class Segment:
    """One shared host buffer: its file and this process's mapping of it (flat bytes)."""

    path: str
    tensor: torch.Tensor

    def nbytes(self) -> int:
        return self.tensor.numel()


# Buffers this process made, by path: a worker in this same process uses them as they are, since a second
# mapping of the same pages would count twice in the process's resident memory.
_made_here: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def map_segment(path: str) -> torch.Tensor:
    """The whole file at `path` as a flat uint8 tensor whose writes the other process sees."""
    return torch.from_file(path, shared=True, size=os.path.getsize(path), dtype=torch.uint8)


def view_as(mapping: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The first bytes of a mapping as a `shape` array of `dtype` (no copy)."""
    need = math.prod(shape) * dtype.itemsize
    if mapping.numel() < need:
        raise ValueError(f"host buffer of {mapping.numel()} bytes cannot hold {shape} {dtype}")
    return mapping[:need].view(dtype).view(shape)


def mapping_of(path: str) -> torch.Tensor:
    """This process's view of the buffer at `path`: the pool's own mapping if it made it, else a new one."""
    mine = _made_here.get(path)
    return mine if mine is not None else map_segment(path)


class HostBuffers:
    """A pool of shared host buffers; at most `keep` idle ones are held between batches."""

    def __init__(self, keep: int = 4, directory: str | None = None):
        self.keep = keep
        parent = directory or (SHARED_MEMORY if os.access(SHARED_MEMORY, os.W_OK) else tempfile.gettempdir())
        remove_orphans(parent)
        self.directory = _own_directory(parent)
        self._removal = weakref.finalize(self, shutil.rmtree, self.directory, True)
        self._idle: list[Segment] = []
        self._lock = threading.Lock()
        self._names = 0
        self._live: weakref.WeakSet = weakref.WeakSet()  # every segment still referenced, idle or not
        self.allocated = 0  # buffers created so far, for tests and benchmarks

    def reserve(self, shape: tuple[int, ...], count: int, dtype: torch.dtype = torch.float32) -> list[str]:
        """Make sure `count` buffers that hold `shape` of `dtype` exist, allocating the missing ones now
        rather than while the engine runs; returns the paths of those made now."""
        need = math.prod(shape) * dtype.itemsize
        with self._lock:
            self.keep = max(self.keep, count)
            missing = count - sum(1 for s in self._live if s.nbytes() >= need)
            made = [self._allocate(need) for _ in range(max(0, missing))]
            self._idle.extend(made)
        return [segment.path for segment in made]

    def take(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, Segment]:
        """A [shape] view of `dtype` and the segment behind it (to `give_back` once the view is no longer read)."""
        need = math.prod(shape) * dtype.itemsize
        with self._lock:
            fitting = [s for s in self._idle if s.nbytes() >= need]
            segment = min(fitting, key=Segment.nbytes) if fitting else None
            if segment is not None:
                self._idle.remove(segment)
            else:
                segment = self._allocate(need)
        return view_as(segment.tensor, shape, dtype), segment

    def give_back(self, segment: Segment) -> None:
        with self._lock:
            if segment in self._idle:
                return
            self._idle.append(segment)
            if len(self._idle) > self.keep:  # drop the smallest: big batches are the ones worth reusing
                dropped = min(self._idle, key=Segment.nbytes)
                self._idle.remove(dropped)
                _unlink(dropped.path)

    def clear(self) -> None:
        """Drop every buffer: idle ones now; files of busy ones too (their mappings stay readable)."""
        with self._lock:
            self._idle.clear()
            self._removal()

    def _allocate(self, nbytes: int) -> Segment:
        self._names += 1
        path = os.path.join(self.directory, f"b{self._names}")
        nbytes = max(nbytes, 1)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # Claim the space now: touching an unbacked page of a full tmpfs later would kill the process.
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            os.close(fd)
            _unlink(path)
            if exc.errno != errno.ENOSPC or not self.directory.startswith(SHARED_MEMORY):
                raise
            self._move_to_temporary_directory()
            return self._allocate(nbytes)
        os.close(fd)
        segment = Segment(path, map_segment(path))
        _made_here[path] = segment.tensor
        self.allocated += 1
        self._live.add(segment)
        return segment

    def _move_to_temporary_directory(self) -> None:
        """Shared memory is full: later buffers live in the temporary directory (page cache, same sharing)."""
        self._removal.detach()
        previous = self.directory
        remove_orphans(tempfile.gettempdir())
        self.directory = _own_directory(tempfile.gettempdir())
        self._removal = weakref.finalize(self, _remove_both, previous, self.directory)


def _own_directory(parent: str) -> str:
    return tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=parent)


def remove_orphans(parent: str) -> list[str]:
    """Remove host buffer directories in `parent` whose process no longer runs; returns what was removed."""
    removed = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        match = _OWNED.match(entry.name)
        if match and entry.is_dir(follow_symlinks=False) and not _running(int(match[1])):
            shutil.rmtree(entry.path, True)
            removed.append(entry.path)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _remove_both(first: str, second: str) -> None:
    shutil.rmtree(first, True)
    shutil.rmtree(second, True)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
