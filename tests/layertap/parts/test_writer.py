"""Parts are plain Parquet with one fixed-size-list column per layer, renamed into place whole."""

from __future__ import annotations

import os
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from layertap.parts import background
from layertap.parts import writer as writer_module
from layertap.parts.writer import MIN_FILE_BYTES, file_row_ranges, write_batch_files, write_part

HASHES = ["a" * 64, "b" * 64, "c" * 64]


def vector_type(value_type, width):
    """What a part's layer column holds: every vector and every value present (declared non-null)."""
    return pa.list_(pa.field("element", value_type, nullable=False), width)


def vectors(layers, n=3, hidden=4, seed=0):
    rng = np.random.default_rng(seed)
    return {layer: rng.standard_normal((n, hidden)).astype(np.float32) for layer in layers}


def test_part_has_one_fixed_size_list_column_per_layer(tmp_path):
    vecs = vectors([5, 0])
    relpath = write_part(tmp_path, "ext1", "part1", HASHES, vecs, "float32")
    assert relpath == "parts/ext1/part1.parquet"
    table = pq.read_table(tmp_path / relpath)
    assert table.column_names == ["prompt_hash", "layer_0", "layer_5"]
    assert table.schema.field("layer_0").type == vector_type(pa.float32(), 4)
    assert not any(field.nullable for field in table.schema)
    assert table["prompt_hash"].to_pylist() == HASHES
    for layer, expected in vecs.items():
        got = np.asarray(table[f"layer_{layer}"].combine_chunks().flatten()).reshape(3, 4)
        np.testing.assert_array_equal(got, expected)
    assert table.schema.metadata is None  # no pandas/pickle payload riding along


def test_float16_and_bfloat16_storage(tmp_path):
    vecs = vectors([1])
    half = pq.read_table(tmp_path / write_part(tmp_path, "e", "half", HASHES, vecs, "float16"))
    assert half.schema.field("layer_1").type == vector_type(pa.float16(), 4)
    got = np.asarray(half["layer_1"].combine_chunks().flatten()).reshape(3, 4)
    np.testing.assert_array_equal(got, vecs[1].astype(np.float16))
    # Arrow has no bfloat16; float32 holds every bfloat16 value exactly.
    bf = pq.read_table(tmp_path / write_part(tmp_path, "e", "bf", HASHES, vecs, "bfloat16"))
    assert bf.schema.field("layer_1").type == vector_type(pa.float32(), 4)


def test_bfloat16_vectors_are_widened_exactly_one_row_group_at_a_time(tmp_path, monkeypatch):
    """A bfloat16 engine's vectors (16-bit patterns) are stored as the float32 values they are, converted
    a row group at a time so a file being written never holds all of its converted vectors at once."""
    from layertap.parts import writer
    from layertap.parts.bfloat16 import from_bits

    hashes = [f"{i:064x}" for i in range(10)]
    wide = vectors([0, 7], n=10, hidden=6, seed=3)
    patterns = {layer: from_bits((a.view(np.uint32) >> 16).astype(np.uint16)) for layer, a in wide.items()}
    exact = {layer: (a.view(np.uint32) & 0xFFFF0000).view(np.float32) for layer, a in wide.items()}
    monkeypatch.setattr(writer, "CONVERTED_ROW_GROUP_BYTES", 3 * 2 * 6 * 4)  # three rows of two layers
    path = tmp_path / write_part(tmp_path, "e", "bf", hashes, patterns, "bfloat16")
    file = pq.ParquetFile(path)
    assert [file.metadata.row_group(k).num_rows for k in range(file.num_row_groups)] == [2, 3, 3, 2]
    table = file.read()
    assert table.schema.field("layer_7").type == vector_type(pa.float32(), 6)
    assert table["prompt_hash"].to_pylist() == hashes
    for layer, expected in exact.items():
        got = np.asarray(table[f"layer_{layer}"].combine_chunks().flatten()).reshape(10, 6)
        np.testing.assert_array_equal(got, expected)
    # float32 vectors stored as float32 are read in place: one row group, whatever the limit.
    plain = pq.ParquetFile(tmp_path / write_part(tmp_path, "e", "f32", hashes, wide, "float32"))
    assert plain.num_row_groups == 1
    with pytest.raises(ValueError, match="one \\[10, hidden\\] array per layer"):
        write_part(tmp_path, "e", "short", hashes, {0: patterns[0][:9], 7: patterns[7]}, "bfloat16")


def test_layers_of_one_host_buffer_are_widened_together_and_stored_as_if_apart(tmp_path, monkeypatch):
    """A runner hands a batch's layers over as views of one [layers, rows, hidden] buffer: they are
    converted in one numpy call (row group by row group, into the encoding thread's reused buffer), and the
    file holds what separate arrays give."""
    from layertap.parts import writer
    from layertap.parts.bfloat16 import from_bits, to_float32
    from layertap.parts.layer_views import stacked_view

    hashes = [f"{i:064x}" for i in range(10)]
    layers = [0, 3, 7]
    wide = vectors(layers, n=10, hidden=6, seed=4)
    buffer = from_bits(np.stack([(wide[layer].view(np.uint32) >> 16).astype(np.uint16) for layer in layers]))
    together = {layer: buffer[j] for j, layer in enumerate(layers)}
    uneven = np.zeros((4, 10, 6), buffer.dtype)  # the same layers, unevenly spaced in memory
    apart = {}
    for j, (layer, offset) in enumerate(zip(layers, (0, 1, 3))):
        uneven[offset] = buffer[j]
        apart[layer] = uneven[offset]
    calls, widened = [], []
    monkeypatch.setattr(writer, "to_float32", lambda a: calls.append(a.shape) or to_float32(a))
    widen = writer._thread_widener()
    monkeypatch.setattr(writer, "_thread_widener", lambda: lambda a: widened.append(widen(a)) or widened[-1])
    monkeypatch.setattr(writer, "CONVERTED_ROW_GROUP_BYTES", 5 * 3 * 6 * 4)  # five rows of three layers
    one = pq.read_table(tmp_path / write_part(tmp_path, "e", "together", hashes, together, "bfloat16"))
    assert [a.shape for a in widened] == [(3, 5, 6), (3, 5, 6)] and not calls  # every layer at once, per group
    assert np.shares_memory(widened[0], widened[1])  # the second group reused the first one's buffer
    other = pq.read_table(tmp_path / write_part(tmp_path, "e", "apart", hashes, apart, "bfloat16"))
    assert calls == [(5, 6)] * 6  # unevenly spaced: one call per layer and row group
    assert one.equals(other)
    for layer in layers:
        got = np.asarray(one[f"layer_{layer}"].combine_chunks().flatten()).reshape(10, 6)
        np.testing.assert_array_equal(got, (wide[layer].view(np.uint32) & 0xFFFF0000).view(np.float32))
    # Only evenly spaced arrays of one layout are viewed together (the view then covers exactly theirs).
    assert stacked_view([buffer[1], buffer[0]]) is None
    assert stacked_view([buffer[0], buffer[2], buffer[1]]) is None
    assert stacked_view([buffer[0], buffer[1], uneven[3]]) is None
    assert stacked_view([buffer[0], buffer[1][:, :5]]) is None
    assert stacked_view([buffer[0], buffer[2]]).shape == (2, 10, 6)  # evenly spaced: layers 0 and 7
    # Arrays allocated apart are never one view, though two addresses in order are always evenly spaced.
    first, second = sorted((np.zeros((10, 6), np.float32), np.zeros((10, 6), np.float32)),
                           key=lambda a: a.__array_interface__["data"][0])
    assert stacked_view([first, second]) is None


def test_layers_allocated_far_apart_are_converted_one_by_one(tmp_path, fresh_python):
    """Two layers in unrelated memory (one on the heap, one in a mapping of its own far above it) stored as
    float16: each is converted by itself. Seen as one view, their span took in the heap above the first,
    where numpy's new arrays land; numpy took each for an overlap and copied again until the process
    crashed. Run in a child process, with every allocation on the heap, so a crash fails only this test."""
    script = f"""
import mmap
import numpy as np
import pyarrow.parquet as pq
from layertap.parts.writer import write_part

rows, hidden = 16, 4096
near = (np.arange(rows * hidden) % 1000).astype(np.float32).reshape(rows, hidden)
far = np.frombuffer(mmap.mmap(-1, rows * hidden * 4), np.float32).reshape(rows, hidden)
far[:] = -near
assert near.__array_interface__["data"][0] < far.__array_interface__["data"][0]
table = pq.read_table({str(tmp_path)!r} + "/" + write_part({str(tmp_path)!r}, "e", "p",
                      [f"{{i:064x}}" for i in range(rows)], {{0: near, 1: far}}, "float16"))
for layer, expected in ((0, near), (1, far)):
    got = np.asarray(table[f"layer_{{layer}}"].combine_chunks().flatten()).reshape(rows, hidden)
    assert got.dtype == np.float16 and np.array_equal(got, expected), layer
print("stored")
"""
    assert fresh_python(script, env={"MALLOC_MMAP_THRESHOLD_": str(1 << 30)}).strip() == "stored"


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


@pytest.mark.parametrize(
    "rows, row_bytes, limit, most, expected",
    [
        (10, 100, 10_000, 8, [(0, 10)]),  # fits in one file
        (10, 100, 500, 8, [(0, 5), (5, 10)]),
        (10, 100, 300, 8, [(0, 2), (2, 5), (5, 8), (8, 10)]),  # even sizes, none over the limit
        (10, 100, 1, 3, [(0, 3), (3, 7), (7, 10)]),  # never more files than threads to encode them
        (2, 100, 1, 8, [(0, 1), (1, 2)]),  # never an empty file
        (0, 100, 1, 8, []),
    ],
)
def test_batches_split_into_even_row_ranges_under_the_file_limit(rows, row_bytes, limit, most, expected):
    assert file_row_ranges(rows, row_bytes, limit, most) == expected


@pytest.mark.parametrize(
    "rows, min_bytes, expected_files",
    [
        (1024, 32, 8),  # 102,400 bytes: a file per encoder thread, each well above the minimum
        (1024, 30_000, 3),  # as many as stay at least the minimum
        (10, 600, 1),  # a small batch stays one file
        (4, 1, 4),  # never an empty file
    ],
)
def test_a_batch_uses_idle_encoders_while_its_files_stay_above_the_minimum(rows, min_bytes, expected_files):
    ranges = file_row_ranges(rows, 100, 10**9, 8, min_bytes)
    assert len(ranges) == expected_files
    assert ranges[0][0] == 0 and ranges[-1][1] == rows
    assert all(a < b for a, b in ranges) and all(x[1] == y[0] for x, y in zip(ranges, ranges[1:]))
    assert all((b - a) * 100 >= min_bytes for a, b in ranges)


def test_a_batch_as_large_as_a_7b_models_fills_the_encoders_with_files_near_the_minimum():
    # 1024 prompts x 33 layers x 4096 float32 = 553 MB: under the 128 MB limit alone it would be 5 files
    ranges = file_row_ranges(1024, 33 * 4096 * 4, 128_000_000, 16, MIN_FILE_BYTES)
    assert len(ranges) == 16
    assert min((b - a) * 33 * 4096 * 4 for a, b in ranges) >= MIN_FILE_BYTES


def test_a_large_batch_is_written_as_several_files_holding_its_rows_in_order(tmp_path):
    hashes = [f"{i:064x}" for i in range(10)]
    vecs = vectors([0, 3], n=10, hidden=4)  # 2 layers x 4 float32: 32 bytes per row, 320 in all
    files = write_batch_files(tmp_path, "e", "p", hashes, vecs, "float32", max_file_bytes=100, max_files=3)
    assert [f["part_id"] for f in files] == ["p-0", "p-1", "p-2"]
    assert [f["prompt_hashes"] for f in files] == [hashes[0:3], hashes[3:7], hashes[7:10]]
    tables = [pq.read_table(tmp_path / f["relpath"]) for f in files]
    assert [t["prompt_hash"].to_pylist() for t in tables] == [f["prompt_hashes"] for f in files]
    for layer in (0, 3):
        got = np.concatenate([np.asarray(t[f"layer_{layer}"].combine_chunks().flatten()).reshape(-1, 4)
                              for t in tables])
        np.testing.assert_array_equal(got, vecs[layer])
    again = write_batch_files(tmp_path, "e", "p", hashes, vecs, "float32", max_file_bytes=100, max_files=3)
    assert [f["relpath"] for f in again] == [f["relpath"] for f in files]  # a retry replaces, never adds
    assert len(list((tmp_path / "parts" / "e").iterdir())) == 3


@pytest.mark.parametrize("rows", [3, 5])
def test_vectors_that_do_not_match_the_prompts_are_refused_before_any_file_is_written(tmp_path, rows):
    """Rows past the prompts would otherwise be cut when the batch is split into files."""
    hashes = [f"{i:064x}" for i in range(4)]
    vecs = vectors([0], n=4)
    vecs[1] = np.zeros((rows, 4), np.float32)
    with pytest.raises(ValueError, match="one \\[4, hidden\\] array per layer"):
        write_batch_files(tmp_path, "e", "p", hashes, vecs, "float32", max_file_bytes=1, max_files=4)
    assert not (tmp_path / "parts").exists() or not list((tmp_path / "parts").rglob("*.parquet"))


def test_a_small_batch_stays_one_file_named_by_its_part_id(tmp_path):
    files = write_batch_files(tmp_path, "e", "p", HASHES, vectors([0]), "float32", max_file_bytes=10**6)
    assert files == [{"part_id": "p", "prompt_hashes": HASHES, "relpath": "parts/e/p.parquet"}]


def test_a_file_that_fails_fails_the_batch_after_the_others_finish(tmp_path, monkeypatch):
    import errno

    import layertap.parts.writer as writer

    real_create = writer.create_file

    def full_disk_for_the_last_file(path, *args):  # the fault, at the OS boundary
        if "-p-3-" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_create(path, *args)

    monkeypatch.setattr(writer, "create_file", full_disk_for_the_last_file)
    hashes = [f"{i:064x}" for i in range(4)]
    with pytest.raises(OSError, match="No space left on device"):
        write_batch_files(tmp_path, "e", "p", hashes, vectors([0, 1], n=4), "float32", max_file_bytes=1, max_files=4)
    assert not list((tmp_path / "staging").iterdir())
    written = sorted(p.name for p in (tmp_path / "parts" / "e").iterdir())
    assert written == ["p-0.parquet", "p-1.parquet", "p-2.parquet"]  # left unpublished, for a retry to replace


def test_the_room_a_value_needs_is_at_most_the_engine_s_own_width():
    """What a run's free-space check counts per value: a bfloat16 value stored as float32 has two all-zero
    low bytes, which the byte-plane split compresses away."""
    from layertap.parts.writer import stored_value_bytes

    assert stored_value_bytes("float32") == 4 and stored_value_bytes("float32", "float16") == 2
    assert stored_value_bytes("bfloat16") == stored_value_bytes("bfloat16", "float32") == 2
    assert stored_value_bytes("float16") == 2


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="per-thread priority is a Linux feature")
def test_files_are_encoded_on_threads_that_yield_to_the_engine(tmp_path, monkeypatch):
    """The encoders run at the background nice value; the thread that asked for the write keeps its own."""
    nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen = []
    real = writer_module.write_part

    def recording(*args, **kwargs):
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return real(*args, **kwargs)

    monkeypatch.setattr(writer_module, "write_part", recording)
    hashes = [f"{i:064x}" for i in range(10)]
    write_batch_files(tmp_path, "e", "p", hashes, vectors([0, 3], n=10, hidden=4), "float32",
                      max_file_bytes=100, max_files=3)
    assert len(seen) == 3 and all(value >= max(nice, background.BACKGROUND_NICE) for value in seen)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == nice
