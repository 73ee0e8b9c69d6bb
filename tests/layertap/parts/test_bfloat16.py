"""bfloat16 patterns in numpy: widened exactly, checked row by row, and never mistaken for integers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from layertap.parts.bfloat16 import (
    BFLOAT16,
    EXPONENT_PATTERN,
    Widener,
    as_float32,
    bits,
    from_bits,
    row_peaks,
    to_float32,
)


def patterns(values: torch.Tensor) -> np.ndarray:
    return from_bits(values.to(torch.bfloat16).view(torch.int16).numpy())


def test_widening_gives_torch_s_own_float32_values_for_whole_arrays_and_slices():
    values = torch.randn(6, 10) * 1000
    values[0, :4] = torch.tensor([float("inf"), float("-inf"), -0.0, 3.0e38])
    got = patterns(values)
    assert got.dtype == BFLOAT16
    expected = values.to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(to_float32(got), expected)
    np.testing.assert_array_equal(to_float32(got[1:4, 3:9]), expected[1:4, 3:9])  # a strided view
    np.testing.assert_array_equal(as_float32(got), expected)
    assert as_float32(expected) is expected  # float32 passes through without a copy
    assert np.isnan(to_float32(patterns(torch.tensor([float("nan")])))).all()


def test_a_widener_reuses_its_buffer_and_every_result_is_exact():
    """Widened in one buffer, call after call: a smaller array after a larger one, then another larger one, each
    exact, though a call only ever writes high halves (the low halves stay the zeros the buffer was made with)."""
    widen = Widener()
    arrays = [torch.randn(3, 5, 8) * 1000, torch.randn(2, 3) * 1e-30, torch.randn(4, 7, 8) * -7]
    arrays[1][0, 0] = float("inf")
    results = []
    for values in arrays:
        got = widen(patterns(values))
        np.testing.assert_array_equal(got, values.to(torch.bfloat16).float().numpy())
        results.append(got)
    assert np.shares_memory(results[0], results[1])  # the smaller array went into the same buffer
    assert not np.shares_memory(results[1], results[2])  # a larger one needed a larger buffer
    strided = patterns(torch.randn(6, 10))[1:4, 3:9]
    np.testing.assert_array_equal(widen(strided), to_float32(strided))
    assert np.shares_memory(widen(strided), results[2])
    assert widen(patterns(torch.zeros(0, 4))).shape == (0, 4)


def test_rows_are_checked_on_the_patterns():
    values = torch.randn(4, 8)
    values[1, 3] = float("nan")
    values[2] = 0.0
    values[2, 5] = -0.0
    values[3, 7] = float("inf")
    got = patterns(values)
    peaks = row_peaks(got)
    assert (peaks < EXPONENT_PATTERN).tolist() == [True, False, True, False]  # finite
    assert (peaks != 0).tolist() == [True, True, False, True]  # not all zeros


def test_arithmetic_on_the_patterns_is_refused():
    with pytest.raises(TypeError):
        patterns(torch.ones(2, 2)) * 2


def test_row_peaks_agree_with_the_values():
    values = torch.randn(300, 4096)
    values[0] = -0.0
    values[129, 4095] = float("inf")
    values[250, 0] = float("-nan")
    values[299] = 0.0
    values[200, 17] = -1e30  # the largest magnitude is negative
    got = patterns(values)
    wide = to_float32(got)
    peaks = row_peaks(got)
    assert (peaks == (bits(got) & 0x7FFF).max(axis=1)).all()
    assert (peaks < EXPONENT_PATTERN).tolist() == np.isfinite(wide).all(axis=1).tolist()
    assert (peaks != 0).tolist() == wide.any(axis=1).tolist()
    assert np.flatnonzero(peaks >= EXPONENT_PATTERN).tolist() == [129, 250]
    assert np.flatnonzero(peaks == 0).tolist() == [0, 299]
