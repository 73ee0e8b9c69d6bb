"""bfloat16 vectors in numpy, which has no bfloat16 type: the 16-bit patterns under a dtype of their own.

An engine running in bfloat16 hands its vectors over as they are, half the bytes of float32 in host
memory and on the way from the device. The dtype is a one-field record, so numpy refuses arithmetic on
the raw patterns instead of silently treating them as integers; `to_float32` widens them exactly (a
bfloat16 is the top half of a float32).
"""

from __future__ import annotations

import sys

import numpy as np

BFLOAT16 = np.dtype([("bfloat16", np.uint16)])

EXPONENT_PATTERN = 0x7F80  # exponent all ones: inf or NaN
_MAGNITUDE = 0x7FFF  # all zero: +0 or -0


def is_bfloat16(array: np.ndarray) -> bool:
    return array.dtype == BFLOAT16


def bits(array: np.ndarray) -> np.ndarray:
    """The raw 16-bit patterns of a bfloat16 array, as uint16, without a copy."""
    return array.view(np.uint16)


def from_bits(patterns: np.ndarray) -> np.ndarray:
    """uint16 (or int16) patterns as a bfloat16 array, without a copy."""
    return patterns.view(np.uint16).view(BFLOAT16)


def to_float32(array: np.ndarray) -> np.ndarray:
    """Exact float32 values of a bfloat16 array (a new array)."""
    if sys.byteorder != "little":
        return (bits(array).astype(np.uint32) << 16).view(np.float32)
    # The patterns are the high halves: stored straight into them, about 2.5x faster than shifting.
    wide = np.zeros(array.shape, np.uint32)
    wide.view(np.uint16)[..., 1::2] = bits(array)
    return wide.view(np.float32)


class Widener:
    """Widens bfloat16 arrays to float32 in one buffer, reused call after call; each result is a view of it,
    valid until the next call.

    A widened value's low half is zero, so the buffer is zeroed once, when it is made, and each call writes
    high halves only: no allocation, no zeroing and no fresh pages per call. A part encoder widens about a
    gigabyte a second; fresh arrays each time left the allocator holding freed ones in every encoder thread
    (bench/host_side_memory.py)."""

    def __init__(self) -> None:
        self._buffer = np.zeros(0, np.uint32)

    def __call__(self, array: np.ndarray) -> np.ndarray:
        if sys.byteorder != "little":
            return to_float32(array)
        if self._buffer.size < array.size:
            self._buffer = np.zeros(0, np.uint32)  # the smaller one is freed before the larger one is made
            self._buffer = np.zeros(array.size, np.uint32)
        wide = self._buffer[: array.size].reshape(array.shape)
        wide.view(np.uint16)[..., 1::2] = bits(array)
        return wide.view(np.float32)


def as_float32(array: np.ndarray) -> np.ndarray:
    """Any vector array as float32: bfloat16 widened, other dtypes converted (no copy if already float32)."""
    return to_float32(array) if is_bfloat16(array) else np.asarray(array, dtype=np.float32)


def row_peaks(array: np.ndarray) -> np.ndarray:
    """Per row (along the last axis) of a bfloat16 array, the largest magnitude's pattern (sign bit
    cleared), as uint16.

    One pass answers both value checks: a row holds NaN or inf exactly when its peak is at least 0x7F80
    (exponent all ones), and is all zeros exactly when its peak is 0. Two numpy calls for the whole array:
    each gives Python's lock up and must take it back, which costs milliseconds when other threads of the
    process compute in Python (bench/task_overhead.py measures it), more than the pass itself.
    """
    patterns = bits(array)
    if patterns.shape[-1] == 0:
        return np.zeros(patterns.shape[:-1], np.uint16)
    return np.bitwise_and(patterns, _MAGNITUDE).max(axis=-1)
