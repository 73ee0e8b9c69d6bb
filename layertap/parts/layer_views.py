"""A batch's layers as one array, when they lie in one host buffer.

Runners hand a batch over as one [layers, rows, hidden] host buffer, one view per layer. Work done layer by
layer makes a numpy call per layer, and each call gives Python's lock up and waits to take it back:
milliseconds each when other threads of the process compute in Python (bench/write_parts.py). Seen as one
array, the layers take one call for all.
"""

from __future__ import annotations

import numpy as np


def stacked_view(arrays: list[np.ndarray]) -> np.ndarray | None:
    """The arrays as one [len(arrays), rows, hidden] view when they are views of one array and lie evenly
    spaced in it with one layout, as the layers of a runner's host buffer do; else None. The view covers
    exactly their elements (layer j's row r starts where arrays[j]'s does) and is read only while they are
    held.

    Arrays allocated apart are never joined, even when their addresses happen to be evenly spaced (any two
    are): the view's span would take in memory that is not theirs, and numpy, seeing a new array inside
    that span, takes it for an overlap and copies again and again until the stack overflows."""
    if not arrays:
        return None
    first = arrays[0]
    owner = _owner(first)
    if any(_owner(a) is not owner for a in arrays[1:]):
        return None
    starts = [a.__array_interface__["data"][0] for a in arrays]
    step = starts[1] - starts[0] if len(arrays) > 1 else first.nbytes
    if step <= 0 or any(a.shape != first.shape or a.strides != first.strides or a.dtype != first.dtype
                        or start != starts[0] + j * step for j, (a, start) in enumerate(zip(arrays, starts))):
        return None
    return np.lib.stride_tricks.as_strided(first, (len(arrays), *first.shape), (step, *first.strides),
                                           writeable=False)


def _owner(array: np.ndarray) -> np.ndarray:
    """The outermost array `array` is a view of (itself when it is none's): the buffer its memory lies in."""
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array
