"""Reusable host buffers that captured vectors are copied into.

A device-to-host copy only runs asynchronously into page-locked memory, and locking pages is slow: a
fresh pinned buffer per batch costs tens of milliseconds per hundred megabytes, and PyTorch's pinned
allocator rounds every request up to a power of two, so a 553 MB batch holds 1 GiB resident. Buffers here
are allocated at their exact size, locked once (`cudaHostRegister`), handed back by the caller when its
vectors are written, and reused by later batches.
"""

from __future__ import annotations

import math
import threading
import weakref

import torch


def _unregister(pointer: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(pointer)


class HostBuffers:
    """A pool of float32 host buffers; at most `keep` idle ones are held between batches."""

    def __init__(self, pinned: bool, keep: int = 4):
        self.pinned = pinned
        self.keep = keep
        self._idle: list[torch.Tensor] = []
        self._live: weakref.WeakSet = weakref.WeakSet()  # every buffer still referenced, idle or not
        self._lock = threading.Lock()
        self.allocated = 0  # buffers created so far, for tests and benchmarks

    def reserve(self, shape: tuple[int, ...], count: int) -> None:
        """Make sure `count` buffers that hold `shape` exist, allocating the missing ones now: locking pages
        while the engine runs competes with it for the driver, so callers reserve before work starts."""
        need = math.prod(shape)
        with self._lock:
            self.keep = max(self.keep, count)
            missing = count - sum(1 for b in self._live if b.numel() >= need)
            self._idle.extend(self._allocate(need) for _ in range(max(0, missing)))

    def take(self, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """A [shape] float32 view and the buffer behind it (to `give_back` once the view is no longer read)."""
        need = math.prod(shape)
        with self._lock:
            fitting = [b for b in self._idle if b.numel() >= need]
            buffer = min(fitting, key=torch.Tensor.numel) if fitting else None
            if buffer is not None:
                self._forget(buffer)
        if buffer is None:
            buffer = self._allocate(need)
        return buffer[:need].view(shape), buffer

    def give_back(self, buffer: torch.Tensor) -> None:
        with self._lock:
            if any(b is buffer for b in self._idle):
                return
            self._idle.append(buffer)
            if len(self._idle) > self.keep:  # drop the smallest: big batches are the ones worth reusing
                self._forget(min(self._idle, key=torch.Tensor.numel))

    def _forget(self, buffer: torch.Tensor) -> None:
        # By identity: `list.remove` would compare tensors element by element.
        self._idle = [b for b in self._idle if b is not buffer]

    def clear(self) -> None:
        with self._lock:
            self._idle.clear()

    def _allocate(self, numel: int) -> torch.Tensor:
        buffer = torch.empty(max(numel, 1), dtype=torch.float32)
        self.allocated += 1
        self._live.add(buffer)
        if self.pinned:
            pointer, size = buffer.data_ptr(), buffer.numel() * buffer.element_size()
            status = torch.cuda.cudart().cudaHostRegister(pointer, size, 0)
            if int(status) != 0:
                raise RuntimeError(f"cudaHostRegister of {size} bytes failed with CUDA error {int(status)}")
            # Unlocked when the buffer is collected; views handed out keep the memory itself alive.
            weakref.finalize(buffer, _unregister, pointer)
        return buffer
