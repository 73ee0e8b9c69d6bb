"""Each check rejects what it names, on real Parquet parts."""

from __future__ import annotations

import numpy as np
import pytest

from layertap.errors import ValidationError
from layertap.validate import check_part, check_vectors, compare, parity_sample
from layertap.writer import write_part

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
    from layertap.bfloat16 import from_bits

    def truncated(data):  # float32 -> bfloat16 by dropping the low half (exact for these values)
        return {layer: from_bits((a.view(np.uint32) >> 16).astype(np.uint16)) for layer, a in data.items()}

    data = vectors()
    check_vectors(truncated(data), [0, 3], 6, 8)
    data[3][4, :] = 0.0 if check == "finite" else -0.0
    data[3][4, 5] = value  # one bad value is enough
    with pytest.raises(ValidationError, match=f"check '{check}': layer 3 has 1 "):
        check_vectors(truncated(data), [0, 3], 6, 8)


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
