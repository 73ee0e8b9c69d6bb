"""Parquet parts: each batch as one or more files, durable on disk before the store's manifest may point at them.

A file is written under staging/, flushed and fsynced, then renamed into parts/<extraction_id>/ and the
directory fsynced, so a crash leaves either no file or a whole one, never a torn file behind a committed
manifest row. One column per layer lets readers fetch a single layer without touching the others.

Arrow encodes a Parquet file on one thread, at a few hundred MB/s, while an engine on a GPU turns out
float32 vectors at gigabytes per second (a 7B model's 33 layers are 553 MB per 1024 prompts). A large
batch is therefore split by rows into several files that are encoded at once, each published as a part:
enough files to keep each under the size limit, and up to one per core while each stays at least
`MIN_FILE_BYTES`, so that the last batches of a run, written while the engine has nothing left to do, use
every core.
"""

from __future__ import annotations

import hashlib
import json
import os
import math
import re
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from layertap import faults
from layertap.parts import allocators, background
from layertap.parts.bfloat16 import Widener, is_bfloat16, to_float32
from layertap.file_modes import create_file, make_dirs
from layertap.parts.layer_views import stacked_view
from layertap.settings import DTYPE_BYTES

# What each dtype is stored as: a stored dtype (`Settings.stored_dtype`) as itself; a bfloat16 engine's
# vectors, when given its dtype, as float32, which holds every bfloat16 value exactly (Arrow has no bfloat16).
_STORAGE = {"float32": np.float32, "bfloat16": np.float32, "float16": np.float16}
# Vectors that must be converted to their stored type (bfloat16 ones) are converted one row group at a time,
# just before it is encoded, so a file being written holds at most this many converted bytes. A batch is
# split into files written at once (16 of ~35 MB for a 7B model's 1024 prompts on 16 cores): 16 MB groups
# keep a quarter of a GiB converted where whole files kept 0.55 GiB. Smaller groups mean smaller pages: on
# normally distributed bfloat16 values a 35 MB file grows 0.8% in 16 MB groups (a dummy-weight model's
# vectors, which compress to a quarter, lose more: 100,000 prompts took 16.5 GB in 8 MB groups, 12.7 whole).
CONVERTED_ROW_GROUP_BYTES = 16_000_000
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def part_id_for(extraction_id: str, layers: list[int], prompt_digest: str) -> str:
    """Same batch, same part id: re-extracting an unpublished batch replaces its file, never adds one."""
    payload = json.dumps([extraction_id, sorted(layers), prompt_digest], separators=(",", ":"))
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


def stored_value_bytes(dtype: str, stored_dtype: str | None = None) -> int:
    """Bytes one value of an engine of `dtype` takes in the store, stored as `stored_dtype` (default: as the
    engine's dtype is stored): at most the engine's own width, since a bfloat16 value stored as float32 has
    two all-zero low bytes, which split into byte planes compress to almost nothing."""
    return min(DTYPE_BYTES[dtype], np.dtype(_STORAGE[stored_dtype or dtype]).itemsize)


def layer_column(layer: int) -> str:
    return f"layer_{layer}"


def _fsync(path: Path) -> None:
    """Flush a file's (or a directory's entries') data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _stored(array: np.ndarray, dtype: str, widen: Widener | None = None) -> np.ndarray:
    """`array` in the type it is stored as (no copy when it already is); bfloat16 is widened exactly first,
    by `widen` if given (into its buffer), else into a new array."""
    if is_bfloat16(array):
        wide = widen(array) if widen is not None else to_float32(array)
        return wide if _STORAGE[dtype] == np.float32 else wide.astype(_STORAGE[dtype])
    return np.ascontiguousarray(array, dtype=_STORAGE[dtype])


_WIDENERS = threading.local()


def _thread_widener() -> Widener:
    """This thread's `Widener`: a row group's layers are widened into it, encoded, and freed before the same
    thread widens the next group, so one buffer per encoding thread serves every group it writes."""
    widener = getattr(_WIDENERS, "widener", None)
    if widener is None:
        widener = _WIDENERS.widener = Widener()
    return widener


def _converted(array: np.ndarray, dtype: str) -> bool:
    """Whether `array` must be converted to be stored (bfloat16 patterns, or another dtype than stored)."""
    return is_bfloat16(array) or array.dtype != _STORAGE[dtype]


def _check_shapes(num_rows: int, vectors: dict[int, np.ndarray], dtype: str) -> None:
    if dtype not in _STORAGE:
        raise ValueError(f"dtype must be one of {', '.join(_STORAGE)}, got {dtype!r}")
    shapes = {np.shape(a) for a in vectors.values()}
    if len(shapes) != 1 or len(shape := shapes.pop()) != 2 or shape[0] != num_rows:
        got = {layer: np.shape(a) for layer, a in vectors.items()}
        raise ValueError(f"need one [{num_rows}, hidden] array per layer, got {got}")


def _vectors_column(stored: np.ndarray) -> pa.FixedSizeListArray:
    """Stored values as fixed_size_list rows of the last axis (leading axes flattened into rows), in place."""
    kind = pa.list_(pa.field("element", pa.from_numpy_dtype(stored.dtype), nullable=False), stored.shape[-1])
    return pa.FixedSizeListArray.from_arrays(pa.array(stored.reshape(-1)), type=kind)


def _layer_columns(
    vectors: dict[int, np.ndarray], dtype: str, widen: Widener | None = None
) -> list[tuple[int, pa.Array]]:
    """Each layer's column, in layer order, in the type it is stored as.

    Layers that must be converted (bfloat16 ones) and lie in one host buffer (`layer_views`) are converted
    in one numpy call (into `widen`'s buffer if given: the columns must then be encoded before it widens
    again) and wrapped as one Arrow array, each layer's column a slice of it: every numpy or Arrow call gives
    Python's lock up and waits to take it back, milliseconds each beside threads computing in Python, so a
    call per layer cost a file ~0.3 s of waiting (bench/write_parts.py)."""
    layers = sorted(vectors)
    arrays = [vectors[layer] for layer in layers]
    converting = _converted(arrays[0], dtype)
    together = stacked_view(arrays) if converting else None
    if together is None:
        return [(layer, _vectors_column(_stored(array, dtype))) for layer, array in zip(layers, arrays)]
    column, rows = _vectors_column(_stored(together, dtype, widen)), together.shape[1]
    return [(layer, column.slice(j * rows, rows)) for j, layer in enumerate(layers)]


def _part_table(
    prompt_hashes: list[str], vectors: dict[int, np.ndarray], dtype: str, widen: Widener | None = None
) -> pa.Table:
    """prompt_hash plus one fixed_size_list<float, H> column per layer, in layer order (shapes checked by
    the caller).

    Every field is declared non-null, as every value is: Parquet then stores no definition levels for the
    vectors' floats, which makes encoding about a fifth cheaper (bench/write_parts.py)."""
    fields = [pa.field("prompt_hash", pa.string(), nullable=False)]
    columns = [pa.array(prompt_hashes, pa.string())]
    for layer, column in _layer_columns(vectors, dtype, widen):
        fields.append(pa.field(layer_column(layer), column.type, nullable=False))
        columns.append(column)
    return pa.Table.from_arrays(columns, schema=pa.schema(fields))


def _row_groups(num_rows: int, vectors: dict[int, np.ndarray], dtype: str) -> list[tuple[int, int]]:
    """[start, stop) row ranges written one at a time: the whole file when its vectors are stored as they
    are (Arrow reads them in place), else as few even groups as keep each within `CONVERTED_ROW_GROUP_BYTES`
    once converted."""
    arrays = list(vectors.values())
    converted = any(_converted(a, dtype) for a in arrays)
    if not converted or num_rows == 0:
        return [(0, num_rows)]
    row_bytes = sum(a.shape[1] for a in arrays) * np.dtype(_STORAGE[dtype]).itemsize
    return _even_ranges(num_rows, min(num_rows, math.ceil(num_rows * row_bytes / CONVERTED_ROW_GROUP_BYTES)))


def _even_ranges(num_rows: int, count: int) -> list[tuple[int, int]]:
    """`count` consecutive [start, stop) ranges over `num_rows` rows, their sizes differing by at most one."""
    bounds = [round(k * num_rows / count) for k in range(count + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def part_writer(sink: pa.NativeFile, schema: pa.Schema) -> pq.ParquetWriter:
    """The Parquet writer every part is encoded with.

    Floats do not compress as they are, but split into byte planes they do: sign/exponent bytes repeat, and
    bfloat16 values held as float32 have two all-zero planes. LZ4 keeps the encoder and every later read
    fast; page checksums let readers detect a damaged file.
    """
    return pq.ParquetWriter(
        sink, schema,
        compression="lz4",
        use_byte_stream_split=[f"{name}.list.element" for name in schema.names[1:]],
        use_dictionary=False,
        write_statistics=["prompt_hash"],
        write_page_checksum=True,
    )


def write_part(
    store_dir: str | os.PathLike,
    extraction_id: str,
    part_id: str,
    prompt_hashes: list[str],
    vectors: dict[int, np.ndarray],
    dtype: str,
) -> str:
    """Write a part durably and atomically; returns its path relative to the store.

    Rewriting the same part id replaces the file in one rename (a retried batch never leaves two files).
    """
    for name in (extraction_id, part_id):
        if not _SAFE_NAME.match(name):
            raise ValueError(f"not a safe file name: {name!r}")
    _check_shapes(len(prompt_hashes), vectors, dtype)
    # Row groups are converted one at a time into this thread's buffer, each encoded before the next.
    widen = _thread_widener()
    tables = (_part_table(prompt_hashes[a:b], {layer: v[a:b] for layer, v in vectors.items()}, dtype, widen)
              for a, b in _row_groups(len(prompt_hashes), vectors, dtype))
    table = next(tables)
    root = Path(store_dir)
    staging = root / "staging"
    final_dir = root / "parts" / extraction_id
    make_dirs(staging)
    make_dirs(final_dir)
    staged = staging / f"{extraction_id}-{part_id}-{uuid.uuid4().hex}.parquet"  # retries never share one
    os.close(create_file(staged))  # created with the store's file mode, then written by Arrow's own file
    # handle: encoding and writing run without the GIL, so batches in flight write in parallel.
    with pa.OSFile(str(staged), "w") as sink:
        with part_writer(sink, table.schema) as parquet:
            while table is not None:
                parquet.write_table(table, row_group_size=max(1, table.num_rows))
                table = None  # encoded: freed before the next group is converted
                table = next(tables, None)
            faults.hit("write.row-group")  # data written, no footer: a crash leaves a torn file, in staging/
    faults.hit("write.before-fsync")
    _fsync(staged)
    faults.hit("write.before-rename")
    os.replace(staged, final_dir / f"{part_id}.parquet")
    _fsync(final_dir)
    faults.hit("write.renamed")
    return f"parts/{extraction_id}/{part_id}.parquet"


# Below this a file's fixed costs (footer, fsync, rename, manifest row) start to weigh against its encoding.
MIN_FILE_BYTES = 32_000_000

_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
_THREADS: int | None = None  # set by `limit_encoder_threads`


def limit_encoder_threads(count: int) -> None:
    """Encode at most `count` files at once in this process: a process given a share of a machine's cores
    (a Ray actor's CPUs) writes on that share, not on every core."""
    global _THREADS, _POOL
    with _POOL_LOCK:
        _THREADS, pool, _POOL = max(1, int(count)), _POOL, None
    if pool is not None:
        pool.shutdown(wait=False)


def encoder_threads() -> int:
    """Files encoded at once in this process, across all batches: one per core it may run on (Arrow's
    encoder holds no GIL), or the share `limit_encoder_threads` set."""
    if _THREADS is not None:
        return _THREADS
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no affinity API on this platform
        return max(1, os.cpu_count() or 1)


def _encoders() -> ThreadPoolExecutor:
    """One pool for the process, so batches written at once share the cores instead of oversubscribing them;
    made with the process's large blocks mapped and unmapped each time (`allocators`)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            allocators.fix_mmap_threshold()
            _POOL = ThreadPoolExecutor(encoder_threads(), thread_name_prefix="layertap-parquet",
                                       initializer=background.lower_this_thread)
        return _POOL


def file_row_ranges(
    num_rows: int, row_bytes: int, max_file_bytes: int, max_files: int, min_file_bytes: int = 0
) -> list[tuple[int, int]]:
    """Split `num_rows` into even [start, stop) ranges: enough to keep each file under `max_file_bytes`,
    and, while each stays at least `min_file_bytes`, one per encoder thread (never more than `max_files`,
    never an empty one).

    A batch written while the encoders are otherwise idle (the last ones of a run) then uses every core
    instead of a few, and a small batch stays one file."""
    if num_rows <= 0:
        return []
    total = num_rows * row_bytes
    needed = math.ceil(total / max(1, max_file_bytes))
    affordable = total // min_file_bytes if min_file_bytes > 0 else 1
    return _even_ranges(num_rows, max(1, min(max_files, num_rows, max(needed, affordable))))


def write_batch_files(
    store_dir: str | os.PathLike,
    extraction_id: str,
    part_id: str,
    prompt_hashes: list[str],
    vectors: dict[int, np.ndarray],
    dtype: str,
    max_file_bytes: int,
    max_files: int | None = None,
    min_file_bytes: int = MIN_FILE_BYTES,
) -> list[dict]:
    """Write a batch as one part, or as several row ranges encoded in parallel when it is large.

    Returns one {"part_id", "relpath", "prompt_hashes"} per file, in row order. File ids derive from the
    batch's part id, so a retried batch replaces its files. All files are waited for before an error is
    raised; files already written stay unpublished, for the retry to replace or the sweep to remove.
    """
    _check_shapes(len(prompt_hashes), vectors, dtype)  # before splitting: rows past the prompts would be cut
    row_bytes = len(vectors) * next(iter(vectors.values())).shape[1] * np.dtype(_STORAGE[dtype]).itemsize
    ranges = file_row_ranges(len(prompt_hashes), row_bytes, max_file_bytes, max_files or encoder_threads(),
                             min(min_file_bytes, max_file_bytes))
    if len(ranges) <= 1:
        return [{"part_id": part_id, "prompt_hashes": list(prompt_hashes),
                 "relpath": write_part(store_dir, extraction_id, part_id, prompt_hashes, vectors, dtype)}]
    files = [{"part_id": f"{part_id}-{k}", "prompt_hashes": list(prompt_hashes[a:b])}
             for k, (a, b) in enumerate(ranges)]
    futures = [
        _encoders().submit(write_part, store_dir, extraction_id, file["part_id"], file["prompt_hashes"],
                           {layer: array[a:b] for layer, array in vectors.items()}, dtype)
        for file, (a, b) in zip(files, ranges)
    ]
    errors = []
    for file, future in zip(files, futures):
        try:
            file["relpath"] = future.result()
        except Exception as exc:  # noqa: BLE001 - raised below, once every file has finished
            errors.append(exc)
    if errors:
        raise errors[0]
    return files
