"""A layer read across a store's files comes back in prompt-hash order, each vector with its prompt."""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from layertap.errors import StoreError
from layertap.parts.sorted_layer import read_layer_sorted
from layertap.parts.writer import write_batch_files, write_part


def _hashes(n, salt):
    return [hashlib.sha256(f"{salt}-{i}".encode()).hexdigest() for i in range(n)]


@pytest.mark.parametrize("dtype, numpy_type", [("float32", np.float32), ("float16", np.float16)])
def test_rows_from_several_files_come_back_sorted_with_their_own_vectors(tmp_path, dtype, numpy_type):
    rng = np.random.default_rng(7)
    expected, paths = {}, []
    for batch, rows in enumerate((37, 5, 64)):  # batches of other sizes, each split into several files
        hashes = _hashes(rows, batch)
        vecs = {layer: rng.standard_normal((rows, 8)).astype(np.float32) for layer in (0, 3)}
        files = write_batch_files(tmp_path, "e", f"p{batch}", hashes, vecs, dtype, max_file_bytes=200, max_files=3)
        paths += [str(tmp_path / f["relpath"]) for f in files]
        expected.update({h: vecs[3][i].astype(numpy_type) for i, h in enumerate(hashes)})

    hashes, embedding = read_layer_sorted(paths, "layer_3")

    assert len(paths) >= 7  # several files per batch
    assert hashes.to_pylist() == sorted(expected)
    assert embedding.type == pa.list_(pa.from_numpy_dtype(numpy_type), 8)
    got = np.asarray(embedding.flatten()).reshape(-1, 8)
    np.testing.assert_array_equal(got, np.stack([expected[h] for h in sorted(expected)]))


def test_files_that_declare_their_values_nullable_read_beside_files_that_do_not(tmp_path):
    """Files written before vectors were declared non-null stay readable in the same store."""
    older = tmp_path / "older.parquet"
    pq.write_table(pa.table({"prompt_hash": _hashes(2, "old"),
                             "layer_0": pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(8, np.float32)), 4)}),
                   older)
    newer = tmp_path / write_part(tmp_path, "e", "new", _hashes(3, "new"), {0: np.ones((3, 4), np.float32)}, "float32")
    assert not pq.read_schema(newer).field("layer_0").type.value_field.nullable
    assert pq.read_schema(older).field("layer_0").type.value_field.nullable

    hashes, embedding = read_layer_sorted([str(older), str(newer)], "layer_0")

    expected = {h: 0.0 for h in _hashes(2, "old")} | {h: 1.0 for h in _hashes(3, "new")}
    assert hashes.to_pylist() == sorted(expected)
    assert embedding.type == pa.list_(pa.float32(), 4)
    got = np.asarray(embedding.flatten()).reshape(-1, 4)
    np.testing.assert_array_equal(got[:, 0], [expected[h] for h in sorted(expected)])


def test_a_file_of_another_width_is_named_in_the_error(tmp_path):
    narrow = write_part(tmp_path, "e", "narrow", _hashes(3, "a"), {0: np.ones((3, 4), np.float32)}, "float32")
    wide = write_part(tmp_path, "e", "wide", _hashes(3, "b"), {0: np.ones((3, 6), np.float32)}, "float32")
    held = "fixed_size_list<element: float not null>\\[6\\]"
    with pytest.raises(StoreError, match=f"wide.parquet: column layer_0 holds {held}"):
        read_layer_sorted([str(tmp_path / narrow), str(tmp_path / wide)], "layer_0")


def test_a_column_that_is_not_vectors_is_refused(tmp_path):
    path = tmp_path / write_part(tmp_path, "e", "p", _hashes(2, "c"), {0: np.ones((2, 4), np.float32)}, "float32")
    with pytest.raises(StoreError, match="column prompt_hash is string, not a fixed-size list"):
        read_layer_sorted([str(path)], "prompt_hash")
