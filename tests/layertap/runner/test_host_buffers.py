"""The host buffer pool: exact sizes, reuse of the smallest fitting buffer, a bounded idle set."""

from __future__ import annotations

import torch

from layertap.runner.host_buffers import HostBuffers


def test_a_released_buffer_serves_any_batch_it_can_hold():
    pool = HostBuffers(pinned=False)
    view, buffer = pool.take((2, 3, 4))
    assert view.shape == (2, 3, 4) and buffer.numel() == 24 and view.data_ptr() == buffer.data_ptr()
    pool.give_back(buffer)
    smaller, again = pool.take((2, 2, 4))
    assert again is buffer and smaller.shape == (2, 2, 4) and pool.allocated == 1
    bigger, other = pool.take((2, 5, 4))  # the held buffer is busy and too small anyway
    assert other is not buffer and pool.allocated == 2 and bigger.is_contiguous()


def test_the_smallest_fitting_buffer_is_taken_and_idle_ones_are_bounded():
    pool = HostBuffers(pinned=False, keep=2)
    buffers = [pool.take((n,))[1] for n in (10, 40, 20)]
    for buffer in buffers:
        pool.give_back(buffer)
    pool.give_back(buffers[0])  # handing one back twice does not hold it twice
    # Only two stay idle: the smallest was dropped.
    assert sorted(b.numel() for b in pool._idle) == [20, 40]
    _, picked = pool.take((15,))
    assert picked.numel() == 20
    _, fresh = pool.take((50,))
    assert fresh.numel() == 50 and pool.allocated == 4


def test_views_keep_their_values_until_handed_back():
    pool = HostBuffers(pinned=False)
    view, buffer = pool.take((3, 4))
    view.copy_(torch.arange(12, dtype=torch.float32).view(3, 4))
    assert view.numpy().sum() == 66
    pool.give_back(buffer)
    pool.clear()
    assert pool._idle == []


def test_reserved_buffers_serve_the_batches_that_follow():
    """Buffers are locked before the engine starts working; reserving again allocates nothing more."""
    pool = HostBuffers(pinned=False, keep=1)
    pool.reserve((2, 8, 4), count=3)
    assert pool.allocated == 3 and pool.keep == 3
    taken = [pool.take((2, n, 4))[1] for n in (8, 8, 5)]
    pool.reserve((2, 8, 4), count=3)  # all three busy, but they exist
    assert pool.allocated == 3
    for buffer in taken:
        pool.give_back(buffer)
    assert len(pool._idle) == 3  # none dropped: keep grew to the reservation
