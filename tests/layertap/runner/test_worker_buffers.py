"""The worker's mappings of the host buffers: one per buffer, the pool's own in the same process, and on a
GPU page-locked, with every lock undone before its mapping can be freed. The CUDA runtime is replaced at its
boundary here (these run without a GPU); the runner tests on the GPU exercise the real calls."""

from __future__ import annotations

import gc

from layertap.runner.host_buffers import HostBuffers
from layertap.runner.worker_buffers import SharedBuffers


class RecordingCuda:
    """CUDA's host-register calls as a ledger of locked addresses; `refuse` makes a lock fail."""

    def __init__(self, refuse: int = 0):
        self.locked: dict[int, int] = {}
        self.refuse = refuse
        self.cleared = 0

    def register(self, pointer, nbytes):
        if self.refuse or pointer in self.locked:
            return self.refuse or 712  # cudaErrorHostMemoryAlreadyRegistered
        self.locked[pointer] = nbytes
        return 0

    def unregister(self, pointer):
        return 0 if self.locked.pop(pointer, None) is not None else 713  # cudaErrorHostMemoryNotRegistered

    def clear_error(self):
        self.cleared += 1


def test_a_worker_in_the_same_process_uses_the_pool_s_own_mapping():
    """Mapping the same pages twice in one process would count them twice in its resident memory."""
    pool = HostBuffers()
    view, segment = pool.take((2, 4))
    assert SharedBuffers(pin=False).get(segment.path).data_ptr() == view.data_ptr()
    pool.clear()


def test_the_worker_forgets_mappings_of_removed_buffers_and_unlocks_them_first():
    """The worker maps each buffer once; a buffer the caller dropped is unlocked and unmapped when the next
    one comes."""
    pool = HostBuffers(keep=0)
    cuda = RecordingCuda()
    worker = SharedBuffers(pin=True, cuda=cuda)
    _, first = pool.take((8,))
    assert worker.get(first.path) is worker.get(first.path)
    assert list(cuda.locked) == [worker.get(first.path).data_ptr()]
    pool.give_back(first)  # keep=0: dropped and unlinked at once
    _, second = pool.take((16,))
    mapped = worker.get(second.path)
    assert list(worker._maps) == [second.path]
    assert cuda.locked == {mapped.data_ptr(): mapped.numel()}
    pool.clear()


def test_closing_unlocks_every_mapping_so_a_later_buffer_at_the_same_address_locks():
    """A mapping freed while locked would leave CUDA's registration behind, and the next buffer mapped at that
    address could not be locked. Closing (the runner does at its close) and garbage collection unlock all."""
    cuda = RecordingCuda()
    pool = HostBuffers()
    worker = SharedBuffers(pin=True, cuda=cuda)
    _, segment = pool.take((64,))
    worker.get(segment.path)
    assert len(cuda.locked) == 1
    worker.close()
    assert cuda.locked == {} and worker.mapped() == []
    worker.get(segment.path)  # a closed worker that maps again still unlocks when collected
    del worker
    gc.collect()
    assert cuda.locked == {}
    forgotten = SharedBuffers(pin=True, cuda=cuda)
    forgotten.get(segment.path)
    assert len(cuda.locked) == 1
    del forgotten
    gc.collect()
    assert cuda.locked == {} and cuda.cleared == 0
    pool.clear()


def test_a_lock_that_fails_is_logged_and_its_error_cleared_and_the_buffer_still_serves(caplog):
    """Torch would report a failed runtime call left as the last CUDA error as the failure of its next kernel
    launch; the buffer is used unlocked (synchronous copies)."""
    cuda = RecordingCuda(refuse=2)  # cudaErrorMemoryAllocation
    pool = HostBuffers()
    worker = SharedBuffers(pin=True, cuda=cuda)
    view, segment = pool.take((4,))
    with caplog.at_level("WARNING"):
        mapped = worker.get(segment.path)
    assert mapped.data_ptr() == view.data_ptr()
    assert cuda.cleared == 1 and cuda.locked == {}
    assert "could not be page-locked (CUDA error 2)" in caplog.text
    worker.close()  # nothing to unlock: no second clear
    assert cuda.cleared == 1
    pool.clear()
