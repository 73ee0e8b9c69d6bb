"""Parts are plain Parquet with one fixed-size-list column per layer, renamed into place whole."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from layertap.writer import write_part

HASHES = ["a" * 64, "b" * 64, "c" * 64]


def vectors(layers, n=3, hidden=4, seed=0):
    rng = np.random.default_rng(seed)
    return {layer: rng.standard_normal((n, hidden)).astype(np.float32) for layer in layers}


def test_part_has_one_fixed_size_list_column_per_layer(tmp_path):
    vecs = vectors([5, 0])
    relpath = write_part(tmp_path, "ext1", "part1", HASHES, vecs, "float32")
    assert relpath == "parts/ext1/part1.parquet"
    table = pq.read_table(tmp_path / relpath)
    assert table.column_names == ["prompt_hash", "layer_0", "layer_5"]
    assert table.schema.field("layer_0").type == pa.list_(pa.float32(), 4)
    assert table["prompt_hash"].to_pylist() == HASHES
    for layer, expected in vecs.items():
        got = np.asarray(table[f"layer_{layer}"].combine_chunks().flatten()).reshape(3, 4)
        np.testing.assert_array_equal(got, expected)
    assert table.schema.metadata is None  # no pandas/pickle payload riding along


def test_float16_and_bfloat16_storage(tmp_path):
    vecs = vectors([1])
    half = pq.read_table(tmp_path / write_part(tmp_path, "e", "half", HASHES, vecs, "float16"))
    assert half.schema.field("layer_1").type == pa.list_(pa.float16(), 4)
    got = np.asarray(half["layer_1"].combine_chunks().flatten()).reshape(3, 4)
    np.testing.assert_array_equal(got, vecs[1].astype(np.float16))
    # Arrow has no bfloat16; float32 holds every bfloat16 value exactly.
    bf = pq.read_table(tmp_path / write_part(tmp_path, "e", "bf", HASHES, vecs, "bfloat16"))
    assert bf.schema.field("layer_1").type == pa.list_(pa.float32(), 4)


def test_staging_is_left_empty_and_rewrite_replaces(tmp_path):
    write_part(tmp_path, "e", "p", HASHES, vectors([0], seed=1), "float32")
    relpath = write_part(tmp_path, "e", "p", HASHES, vectors([0], seed=2), "float32")
    assert list((tmp_path / "staging").iterdir()) == []
    assert [p.name for p in (tmp_path / "parts" / "e").iterdir()] == ["p.parquet"]
    got = np.asarray(pq.read_table(tmp_path / relpath)["layer_0"].combine_chunks().flatten()).reshape(3, 4)
    np.testing.assert_array_equal(got, vectors([0], seed=2)[0])


@pytest.mark.parametrize(
    "vecs",
    [
        {0: np.zeros((2, 4))},  # fewer rows than hashes
        {0: np.zeros((3, 4)), 1: np.zeros((3, 5))},  # hidden sizes differ
        {0: np.zeros(3)},  # not 2-D
        {},
    ],
)
def test_bad_shapes_are_refused_before_writing(tmp_path, vecs):
    with pytest.raises(ValueError):
        write_part(tmp_path, "e", "p", HASHES, vecs, "float32")
    assert not (tmp_path / "parts" / "e").exists()


@pytest.mark.parametrize("extraction_id, part_id", [("../x", "p"), ("e", "a/b"), ("e", ""), ("e", ".hidden")])
def test_ids_must_be_plain_file_names(tmp_path, extraction_id, part_id):
    with pytest.raises(ValueError):
        write_part(tmp_path, extraction_id, part_id, HASHES, vectors([0]), "float32")


def test_unknown_dtype(tmp_path):
    with pytest.raises(ValueError, match="dtype"):
        write_part(tmp_path, "e", "p", HASHES, vectors([0]), "int8")
