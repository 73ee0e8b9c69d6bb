"""Each check rejects what it names, on real Parquet parts."""

from __future__ import annotations

import numpy as np
import pytest

from layertap.errors import ValidationError
from layertap.parts.checks import check_part, check_vectors, compare, parity_sample
from layertap.parts.writer import write_part

HASHES = [f"{i:064x}" for i in range(6)]


def vectors(n=6, hidden=8, layers=(0, 3)):
    rng = np.random.default_rng(0)
    return {layer: rng.standard_normal((n, hidden)).astype(np.float32) for layer in layers}


def test_good_part_in_any_row_order_passes(tmp_path):
    order = HASHES[::-1]
    path = tmp_path / write_part(tmp_path, "e1", "p1", order, vectors(), "float32")
    assert check_part(str(path), HASHES, [0, 3], 8) == order


@pytest.mark.parametrize(
    ("hashes", "layers", "hidden", "check"),
    [(HASHES[:5], [0, 3], 8, "one result per prompt"), (HASHES, [0], 8, "layers present"),
     (HASHES, [0, 3], 16, "shape")],
)
def test_part_that_does_not_match_its_batch_fails(tmp_path, hashes, layers, hidden, check):
    path = tmp_path / write_part(tmp_path, "e1", "p1", HASHES, vectors(), "float32")
    with pytest.raises(ValidationError, match=check):
        check_part(str(path), hashes, layers, hidden)


def test_torn_part_fails(tmp_path):
    path = tmp_path / write_part(tmp_path, "e1", "p1", HASHES, vectors(), "float32")
    path.write_bytes(path.read_bytes()[:-100])  # a write cut short: no whole footer
    with pytest.raises(ValidationError, match="readable"):
        check_part(str(path), HASHES, [0, 3], 8)


def test_unreadable_part_fails(tmp_path):
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    with pytest.raises(ValidationError, match="readable"):
        check_part(str(tmp_path / "broken.parquet"), HASHES, [0], 8)


@pytest.mark.parametrize(("value", "check"), [(np.nan, "finite"), (np.inf, "finite"), (0.0, "non-zero")])
def test_bad_values_fail_naming_the_check(value, check):
    data = vectors()
    data[3][2, :] = value
    with pytest.raises(ValidationError, match=f"check '{check}'"):
        check_vectors(data, [0, 3], 6, 8)


@pytest.mark.parametrize(("value", "check"), [(np.nan, "finite"), (-np.inf, "finite"), (-0.0, "non-zero")])
def test_bad_bfloat16_values_fail_naming_the_check(value, check):
    """A bfloat16 engine's vectors are checked as they arrive, as 16-bit patterns."""
    from layertap.parts.bfloat16 import from_bits

    def truncated(data):  # float32 -> bfloat16 by dropping the low half (exact for these values)
        return {layer: from_bits((a.view(np.uint32) >> 16).astype(np.uint16)) for layer, a in data.items()}

    data = vectors()
    check_vectors(truncated(data), [0, 3], 6, 8)
    data[3][4, :] = 0.0 if check == "finite" else -0.0
    data[3][4, 5] = value  # one bad value is enough
    with pytest.raises(ValidationError, match=f"check '{check}': layer 3 has 1 "):
        check_vectors(truncated(data), [0, 3], 6, 8)


@pytest.mark.parametrize("bad_layer", [0, 2, 4])
@pytest.mark.parametrize("as_bfloat16", [False, True])
def test_layers_of_one_host_buffer_are_checked_a_block_at_a_time_and_still_named(bad_layer, as_bfloat16,
                                                                                  monkeypatch):
    """A runner's batch (every layer a view of one buffer) is checked several layers per numpy call; a bad
    value is still reported under its own layer."""
    from layertap.parts import bfloat16, checks

    layers = [0, 1, 2, 3, 4]
    buffer = np.random.default_rng(1).standard_normal((5, 6, 8)).astype(np.float32)
    buffer[bad_layer, 3, 2] = np.nan
    if as_bfloat16:
        buffer = bfloat16.from_bits((buffer.view(np.uint32) >> 16).astype(np.uint16))
    monkeypatch.setattr(checks, "CHECK_BLOCK_BYTES", 2 * buffer[0].nbytes)  # two layers per block
    blocks = []
    monkeypatch.setattr(checks, "_checked_rows",
                        lambda a, f16, check=checks._checked_rows: blocks.append(a.shape) or check(a, f16))
    with pytest.raises(ValidationError, match=f"check 'finite': layer {bad_layer} has 1 vectors"):
        check_vectors({layer: buffer[j] for j, layer in enumerate(layers)}, layers, 6, 8)
    assert blocks[0] == (2, 6, 8) and len(blocks) == bad_layer // 2 + 1
    blocks.clear()
    uneven = np.zeros((11, 6, 8), buffer.dtype)  # the same layers, unevenly spaced: checked one at a time
    apart = {}
    for j, (layer, offset) in enumerate(zip(layers, (0, 1, 3, 6, 10))):
        uneven[offset] = buffer[j]
        apart[layer] = uneven[offset]
    with pytest.raises(ValidationError, match=f"check 'finite': layer {bad_layer} has 1 vectors"):
        check_vectors(apart, layers, 6, 8)
    assert blocks == [(6, 8)] * (bad_layer + 1)


@pytest.mark.parametrize("as_bfloat16", [False, True])
def test_float16_storage_refuses_a_value_beyond_its_range_naming_the_layer(as_bfloat16):
    """Stored as float16, a value float16 cannot hold would be stored as inf: the batch fails its checks
    instead, naming the layer. The largest bfloat16 float16 holds passes, and float32 storage takes both."""
    from layertap.parts import bfloat16

    def batch(peak: float) -> dict[int, np.ndarray]:
        found = vectors(layers=(0, 5))
        found[5] = found[5].copy()
        found[5][2, 1] = peak
        if as_bfloat16:  # the values chosen are exact bfloat16 values
            return {layer: bfloat16.from_bits((v.view(np.uint32) >> 16).astype(np.uint16)) for layer, v in found.items()}
        return found

    with pytest.raises(ValidationError, match=r"check 'float16 range': layer 5 has 1 vectors .*--store-dtype float32"):
        check_vectors(batch(-65536.0), [0, 5], 6, 8, "float16")
    check_vectors(batch(-65536.0), [0, 5], 6, 8, "float32")
    check_vectors(batch(65280.0), [0, 5], 6, 8, "float16")


def test_missing_layer_fails():
    with pytest.raises(ValidationError, match="layers present"):
        check_vectors(vectors(layers=(0,)), [0, 3], 6, 8)


def test_parity_tolerance_depends_on_dtype():
    ours = vectors()
    noisy = {layer: v + 0.01 * np.random.default_rng(1).standard_normal(v.shape).astype(np.float32)
             for layer, v in ours.items()}
    assert compare(noisy, ours, "bfloat16").min_cosine[0] > 0.99
    with pytest.raises(ValidationError, match="check 'parity': layer 0"):
        compare(noisy, ours, "float32")


def test_parity_sample_is_deterministic_and_bounded():
    assert parity_sample(HASHES[::-1], 2) == [4, 5]
    assert parity_sample(HASHES, 10) == list(range(6))
