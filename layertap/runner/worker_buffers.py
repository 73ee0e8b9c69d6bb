"""The engine worker's side of the host buffers: mapped by path, page-locked on a GPU, unlocked before unmapped.

CUDA keeps a page-locked range registered by address. A mapping freed while still registered leaves that
registration behind: the next buffer mapped at the same address then cannot be locked, and the failed call
would be reported by torch as the failure of the next kernel it launches. So every lock is undone before its
mapping can go, when the worker forgets a buffer, when the runner closes the engine, and when the worker's
buffers are garbage-collected; and a lock that fails is logged and its error cleared.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import weakref

import torch

from layertap.runner.host_buffers import mapping_of

log = logging.getLogger(__name__)


class CudaHostMemory:
    """The three CUDA runtime calls page-locking needs (the boundary tests replace)."""

    def register(self, pointer: int, nbytes: int) -> int:
        return int(torch.cuda.cudart().cudaHostRegister(pointer, nbytes, 0))

    def unregister(self, pointer: int) -> int:
        return int(torch.cuda.cudart().cudaHostUnregister(pointer))

    def clear_error(self) -> None:
        """Reset this thread's last CUDA error (torch's bindings return it but leave it set)."""
        runtime = _loaded_cuda_runtime()
        if runtime is not None:
            runtime.cudaGetLastError()


@functools.cache
def _loaded_cuda_runtime() -> ctypes.CDLL | None:
    """The CUDA runtime library torch loaded (opening it again by path returns that same instance)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


class SharedBuffers:
    """The caller's host buffers as this worker maps them: by path, once each, page-locked on a GPU so
    device-to-host copies into them run asynchronously."""

    def __init__(self, pin: bool, cuda: CudaHostMemory | None = None):
        self.pin = pin
        self._cuda = cuda or CudaHostMemory()
        self._maps: dict[str, torch.Tensor] = {}
        self._pinned: dict[str, int] = {}  # path -> locked address
        # The finalizer holds the mappings, so they stay mapped until it has unlocked them.
        weakref.finalize(self, _unlock_all, self._cuda, self._maps, self._pinned)

    def get(self, path: str) -> torch.Tensor:
        mapped = self._maps.get(path)
        if mapped is None:
            self._forget_removed()
            mapped = mapping_of(path)
            if self.pin:
                self._lock(path, mapped)
            self._maps[path] = mapped
        return mapped

    def mapped(self) -> list[str]:
        return list(self._maps)

    def close(self) -> None:
        """Unlock and drop every mapping (the engine is closing: its buffers are being removed)."""
        _unlock_all(self._cuda, self._maps, self._pinned)

    def _lock(self, path: str, mapped: torch.Tensor) -> None:
        status = self._cuda.register(mapped.data_ptr(), mapped.numel())
        if status == 0:
            self._pinned[path] = mapped.data_ptr()
            return
        self._cuda.clear_error()
        # Copies into it still work, each one waiting until it is done.
        log.warning("host buffer %s (%d bytes) could not be page-locked (CUDA error %d): device-to-host copies "
                    "into it are synchronous", path, mapped.numel(), status)

    def _forget_removed(self) -> None:
        """Drop mappings of buffers the caller has removed (it removes only buffers no batch is using)."""
        for path in [p for p in self._maps if not os.path.exists(p)]:
            if path in self._pinned:
                _unlock(self._cuda, path, self._pinned.pop(path))
            del self._maps[path]


def _unlock_all(cuda: CudaHostMemory, maps: dict[str, torch.Tensor], pinned: dict[str, int]) -> None:
    for path, pointer in list(pinned.items()):
        _unlock(cuda, path, pointer)
    pinned.clear()
    maps.clear()


def _unlock(cuda: CudaHostMemory, path: str, pointer: int) -> None:
    try:
        status = cuda.unregister(pointer)
    except Exception:  # noqa: BLE001 - CUDA already torn down at interpreter exit
        log.debug("unlocking host buffer %s raised", path, exc_info=True)
        return
    if status != 0:
        cuda.clear_error()
        log.warning("host buffer %s could not be unlocked (CUDA error %d)", path, status)
