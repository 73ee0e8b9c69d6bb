"""The shared host buffer pool: exact sizes, reuse of the smallest fitting buffer, a bounded idle set,
views in any precision, files another process maps by path, and removal of what is dropped."""

from __future__ import annotations

import os

import pytest
import torch

from layertap.runner.host_buffers import HostBuffers, map_segment, view_as


def test_a_released_buffer_serves_any_batch_it_can_hold():
    pool = HostBuffers()
    view, segment = pool.take((2, 3, 4))
    assert view.shape == (2, 3, 4) and segment.nbytes() == 24 * 4 and view.data_ptr() == segment.tensor.data_ptr()
    pool.give_back(segment)
    smaller, again = pool.take((2, 2, 4))
    assert again is segment and smaller.shape == (2, 2, 4) and pool.allocated == 1
    bigger, other = pool.take((2, 5, 4))  # the held buffer is busy and too small anyway
    assert other is not segment and pool.allocated == 2 and bigger.is_contiguous()
    pool.clear()


def test_the_smallest_fitting_buffer_is_taken_and_idle_ones_are_bounded():
    pool = HostBuffers(keep=2)
    segments = [pool.take((n,))[1] for n in (10, 40, 20)]
    for segment in segments:
        pool.give_back(segment)
    pool.give_back(segments[0])  # handing one back twice does not hold it twice
    # Only two stay idle: the smallest was dropped, and its file removed.
    assert sorted(s.nbytes() for s in pool._idle) == [80, 160]
    assert not os.path.exists(segments[0].path) and os.path.exists(segments[1].path)
    _, picked = pool.take((15,))
    assert picked.nbytes() == 80
    _, fresh = pool.take((50,))
    assert fresh.nbytes() == 200 and pool.allocated == 4
    pool.clear()


def test_another_mapping_of_the_file_sees_the_writes_both_ways():
    """The engine's worker maps a buffer by its path: what it writes is what the caller reads."""
    pool = HostBuffers()
    view, segment = pool.take((3, 4))
    assert os.path.exists(segment.path)
    other = view_as(map_segment(segment.path), (12,), torch.float32)
    assert other.data_ptr() != view.data_ptr()
    other.copy_(torch.arange(12, dtype=torch.float32))
    assert view.numpy().sum() == 66
    view[0, 0] = -1
    assert other[0].item() == -1
    pool.give_back(segment)
    directory = pool.directory
    pool.clear()
    assert pool._idle == [] and not os.path.exists(directory)
    assert other.sum().item() == 65  # a mapping outlives the file


def test_half_precision_batches_take_half_the_bytes_and_share_buffers_with_float32_ones():
    """A buffer is bytes: a bfloat16 batch needs half of what a float32 one of the same shape does, and a
    buffer released by either serves the other when it is large enough."""
    pool = HostBuffers()
    half, segment = pool.take((2, 3, 4), torch.bfloat16)
    assert half.dtype == torch.bfloat16 and segment.nbytes() == 24 * 2
    half.copy_(torch.full((2, 3, 4), 1.5))
    assert view_as(map_segment(segment.path), (24,), torch.bfloat16).float().sum().item() == 36
    pool.give_back(segment)
    assert pool.take((2, 3, 2))[1] is segment  # float32, 48 bytes: fits
    with pytest.raises(ValueError, match="cannot hold"):
        view_as(segment.tensor, (2, 3, 4), torch.float32)
    pool.reserve((2, 8, 4), count=1, dtype=torch.float16)
    assert max(s.nbytes() for s in pool._idle) == 2 * 8 * 4 * 2
    pool.clear()


def test_reserved_buffers_serve_the_batches_that_follow():
    """Buffers are made before the engine starts working; reserving again allocates nothing more."""
    pool = HostBuffers(keep=1)
    pool.reserve((2, 8, 4), count=3)
    assert pool.allocated == 3 and pool.keep == 3
    taken = [pool.take((2, n, 4))[1] for n in (8, 8, 5)]
    pool.reserve((2, 8, 4), count=3)  # all three busy, but they exist
    assert pool.allocated == 3
    for segment in taken:
        pool.give_back(segment)
    assert len(pool._idle) == 3  # none dropped: keep grew to the reservation
    pool.clear()


def test_directories_left_by_a_killed_process_are_removed(tmp_path):
    """A process killed mid-run cannot unlink its buffers; the next pool on the machine removes them."""
    import subprocess
    import sys

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)
    orphan = tmp_path / f"layertap-host-{dead_pid}-x1"
    orphan.mkdir()
    (orphan / "b1").write_bytes(b"\0" * 64)
    alive = tmp_path / f"layertap-host-{os.getpid()}-x2"  # this process still runs: kept
    alive.mkdir()
    pool = HostBuffers(directory=str(tmp_path))
    assert not orphan.exists() and alive.exists() and os.path.isdir(pool.directory)
    assert os.path.basename(pool.directory).startswith(f"layertap-host-{os.getpid()}-")
    pool.clear()


def test_a_full_shared_memory_moves_later_buffers_to_the_temporary_directory(monkeypatch, tmp_path):
    """A full tmpfs is refused when the space is claimed (the fault injected at the OS call), not by a
    crash when a page is touched later; the buffer is then made in the temporary directory."""
    import errno
    import tempfile

    from layertap.runner import host_buffers

    if not os.access(host_buffers.SHARED_MEMORY, os.W_OK):
        pytest.skip("no writable /dev/shm here")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    real = os.posix_fallocate

    def full_shared_memory(fd, offset, length):
        if os.readlink(f"/proc/self/fd/{fd}").startswith(host_buffers.SHARED_MEMORY):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, offset, length)

    monkeypatch.setattr(host_buffers.os, "posix_fallocate", full_shared_memory)
    pool = HostBuffers()
    first = pool.directory
    assert first.startswith(host_buffers.SHARED_MEMORY)
    view, segment = pool.take((4, 8))
    assert segment.path.startswith(str(tmp_path)) and pool.directory != first and os.listdir(first) == []
    view.fill_(2.0)
    assert view_as(map_segment(segment.path), (32,), torch.float32).sum().item() == 64
    pool.clear()
    assert not os.path.exists(first) and not os.path.exists(pool.directory)
