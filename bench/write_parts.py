"""Parquet part writing benchmark: how fast this machine's disk and cores turn batches into store parts.

On short prompts the flow turns out more float32 per second than one writer thread can encode (a 7B
model's 33 layers are 553 MB per 1024 prompts), so part writing, not the engine, bounds it. This times
`layertap.parts.writer.write_part` (the flow's own writer: byte-stream split, LZ4, page checksums, fsync,
rename) with 1, 2, 4, 8 and 16 parts written at once (up to twice the cores), whole batches through
`write_batch_files` (split into files encoded in parallel, as the flow writes them) one and three at a
time, and other encodings of one part, next to a plain sequential file write of the same bytes, into a
directory of your choice (the store's disk, or /dev/shm to leave the disk out). Values are bfloat16
widened to float32, as the flow stores a bfloat16 engine's output. Writes
bench/results/write_parts-<date>[-tag].json.

    .venv/bin/python bench/write_parts.py [--dir /path/on/the/store/disk] [--prompts 1024] [--no-save]
        [--out FOLDER] [--tag TAG]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_stages import machine  # noqa: E402
from task_overhead import Spinners  # noqa: E402

from layertap.parts import bfloat16  # noqa: E402
from layertap.settings import Settings  # noqa: E402
from layertap.parts.checks import check_vectors  # noqa: E402
from layertap.parts.writer import _part_table, part_writer, write_batch_files, write_part  # noqa: E402

LAYERS, HIDDEN = 33, 4096


def bf16_vectors(prompts: int, seed: int) -> dict[int, np.ndarray]:
    """One [prompts, HIDDEN] float32 array per layer, every value exactly a bfloat16 (low 16 bits zero)."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((prompts, HIDDEN), dtype=np.float32)
    return {layer: ((base * (layer + 1)).view(np.uint32) & 0xFFFF0000).view(np.float32) for layer in range(LAYERS)}


def timed_parts(root: Path, vectors: dict[int, np.ndarray], concurrent: int) -> float:
    """Seconds to write `concurrent` parts at once, each on its own thread, as batches in flight do."""
    hashes = [f"{i:064x}" for i in range(next(iter(vectors.values())).shape[0])]
    store = Path(tempfile.mkdtemp(prefix="parts-", dir=root))
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrent) as pool:
        list(pool.map(lambda k: write_part(store, "bench", f"part{k}", hashes, vectors, "bfloat16"),
                      range(concurrent)))
    seconds = time.perf_counter() - start
    shutil.rmtree(store)
    return seconds


def timed_batches(root: Path, vectors: dict[int, np.ndarray], concurrent: int) -> tuple[float, int]:
    """Seconds to write `concurrent` batches at once through `write_batch_files` (each split into files of
    at most the default `part_file_mb`, encoded by the shared pool), and the files each batch became."""
    hashes = [f"{i:064x}" for i in range(next(iter(vectors.values())).shape[0])]
    store = Path(tempfile.mkdtemp(prefix="batches-", dir=root))
    limit = int(Settings.model_fields["part_file_mb"].default * 1e6)
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrent) as pool:
        written = list(pool.map(
            lambda k: write_batch_files(store, "bench", f"batch{k}", hashes, vectors, "bfloat16", limit),
            range(concurrent)))
    seconds = time.perf_counter() - start
    shutil.rmtree(store)
    return seconds, len(written[0])


def timed_plain_write(root: Path, vectors: dict[int, np.ndarray]) -> float:
    """Seconds to write the same bytes as one part, unencoded, with one sequential write and an fsync."""
    path = root / "plain.bin"
    start = time.perf_counter()
    with open(path, "wb") as sink:
        for array in vectors.values():
            sink.write(memoryview(array).cast("B"))
        sink.flush()
        os.fsync(sink.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


# Encodings tried next to the writer's own (one part, one thread, fsynced): says how much of a part's time
# is the encoder's choice and how much is bytes to the disk.
ENCODINGS = {
    "lz4_bss_checksums": dict(compression="lz4", byte_stream_split=True, write_page_checksum=True),
    "lz4_bss": dict(compression="lz4", byte_stream_split=True),
    "zstd1_bss": dict(compression="zstd", compression_level=1, byte_stream_split=True),
    "none_plain": dict(compression="none"),
    "none_bss": dict(compression="none", byte_stream_split=True),
}


def timed_encoding(root: Path, vectors: dict[int, np.ndarray], options: dict) -> tuple[float, int]:
    """Seconds and bytes to write one part's table with the given Parquet options, fsync included."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    options = dict(options)
    split = options.pop("byte_stream_split", False)
    rows = next(iter(vectors.values())).shape[0]
    table = pa.table({"prompt_hash": pa.array([f"{i:064x}" for i in range(rows)]),
                      **{f"layer_{layer}": pa.FixedSizeListArray.from_arrays(pa.array(a.reshape(-1)), HIDDEN)
                         for layer, a in vectors.items()}})
    path = root / "encoding.parquet"
    start = time.perf_counter()
    with pa.OSFile(str(path), "w") as sink:
        with pq.ParquetWriter(sink, table.schema, use_dictionary=False, write_statistics=["prompt_hash"],
                              use_byte_stream_split=[f"{c}.list.element" for c in table.column_names[1:]]
                              if split else False, **options) as parquet:
            parquet.write_table(table, row_group_size=rows)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    seconds, size = time.perf_counter() - start, path.stat().st_size
    path.unlink()
    return seconds, size


def least_cpu_seconds(fn, repeats: int = 5) -> float:
    """The least CPU time of `repeats` calls of `fn` (one thread): what it costs the cores, which on a busy
    host matters more than its wall time."""
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best


def _wall_seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def host_work_per_batch(vectors: dict[int, np.ndarray], files: int) -> dict[str, float]:
    """Seconds of one batch's host work, file by file as the flow does it, encoded into memory (no disk):
    building the files' tables from layers that are views of one host buffer (as a runner hands them
    over: widened in one numpy call per file) and from layers apart (one call per layer, as before
    2026-12-04); encoding them declared non-null (the writer's schema) and declared nullable (files before
    2026-12-04); the value checks in one pass and in a pass per check (before 2026-12-04). CPU time, except
    keys ending in _wall: wall time beside a thread computing in Python."""
    import pyarrow as pa

    rows = next(iter(vectors.values())).shape[0]
    hashes = [f"{i:064x}" for i in range(rows)]
    # As a runner hands a batch over: every layer a view of one [layers, rows, hidden] host buffer.
    buffer = bfloat16.from_bits(np.stack([(a.view(np.uint32) >> 16).astype(np.uint16) for a in vectors.values()]))
    patterns = {layer: buffer[j] for j, layer in enumerate(vectors)}
    apart = {layer: array.copy() for layer, array in patterns.items()}  # each layer an array of its own
    step = -(-rows // files)
    slices = [(a, min(rows, a + step)) for a in range(0, rows, step)]

    def nullable(table: pa.Table) -> pa.Table:
        return table.cast(pa.schema([pa.field(f.name, pa.list_(f.type.value_type, f.type.list_size))
                                     if pa.types.is_fixed_size_list(f.type) else pa.field(f.name, f.type)
                                     for f in table.schema]))

    def build_tables(layers: dict[int, np.ndarray] = patterns) -> list[pa.Table]:
        """The files' tables, bfloat16 widened to float32, as the writer builds them."""
        return [_part_table(hashes[a:b], {layer: v[a:b] for layer, v in layers.items()}, "bfloat16")
                for a, b in slices]

    declared = build_tables()  # built outside the timed encoding
    as_before = [nullable(table) for table in declared]

    def encode(tables: list[pa.Table]) -> None:
        for table in tables:
            with part_writer(pa.BufferOutputStream(), table.schema) as parquet:
                parquet.write_table(table, row_group_size=table.num_rows)

    def checks_one_pass() -> None:
        check_vectors(patterns, list(patterns), rows, HIDDEN)

    def checks_per_check() -> None:
        for array in patterns.values():
            finite = ((bfloat16.bits(array) & 0x7F80) != 0x7F80).all(axis=1)
            nonzero = ((bfloat16.bits(array) & 0x7FFF) != 0).any(axis=1)
            assert finite.all() and nonzero.all()

    def beside_a_busy_thread(fn) -> float:
        """Least wall time of 3 calls while one thread computes in Python, as vLLM's frontend and Prefect's
        task machinery do in the flow's process: every numpy call then waits for Python's lock."""
        with Spinners(1):
            return min(_wall_seconds(fn) for _ in range(3))

    return {
        "value_checks_one_pass_beside_a_busy_thread_wall": beside_a_busy_thread(checks_one_pass),
        "value_checks_pass_per_check_beside_a_busy_thread_wall": beside_a_busy_thread(checks_per_check),
        "build_tables_beside_a_busy_thread_wall": beside_a_busy_thread(build_tables),
        "build_tables_layers_apart_beside_a_busy_thread_wall": beside_a_busy_thread(lambda: build_tables(apart)),
        "build_tables": least_cpu_seconds(build_tables),
        "build_tables_layers_apart": least_cpu_seconds(lambda: build_tables(apart)),
        "encode_declared_non_null": least_cpu_seconds(lambda: encode(declared)),
        "encode_declared_nullable": least_cpu_seconds(lambda: encode(as_before)),
        "value_checks_one_pass": least_cpu_seconds(checks_one_pass),
        "value_checks_pass_per_check": least_cpu_seconds(checks_per_check),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where parts are written")
    parser.add_argument("--prompts", type=int, default=1024, help="prompts per part")
    parser.add_argument("--no-save", action="store_true", help="print only; do not write bench/results/")
    parser.add_argument("--out", help="results folder (default bench/results/)")
    parser.add_argument("--tag", default="", help="added to the results file's name")
    args = parser.parse_args()
    root = Path(args.dir)
    vectors = bf16_vectors(args.prompts, seed=0)
    part_mb = sum(a.nbytes for a in vectors.values()) / 1e6
    rows = {"plain_write_1_part": timed_plain_write(root, vectors)}
    for concurrent in (1, 2, 4, 8, 16)[: 1 + max(1, (os.cpu_count() or 1)).bit_length()]:
        rows[f"write_part_x{concurrent}"] = timed_parts(root, vectors, concurrent)
    files = 1
    for concurrent in (1, 3):
        rows[f"write_batch_files_x{concurrent}"], files = timed_batches(root, vectors, concurrent)
    encodings = {name: timed_encoding(root, vectors, options) for name, options in ENCODINGS.items()}
    host = host_work_per_batch(vectors, files)
    report = {
        "date": dt.date.today().isoformat(),
        "machine": machine(),
        "command": "python " + " ".join(sys.argv),
        "dir": str(root),
        "part": {"prompts": args.prompts, "layers": LAYERS, "hidden": HIDDEN, "float32_mb": round(part_mb, 1)},
        "files_per_batch": files,
        "seconds": {name: round(s, 3) for name, s in rows.items()},
        "float32_mb_per_s": {name: round(part_mb * (int(name.rsplit("x", 1)[1]) if "_x" in name else 1) / s, 1)
                             for name, s in rows.items()},
        "encodings_one_part": {name: {"seconds": round(s, 3), "mb": round(size / 1e6, 1)}
                               for name, (s, size) in encodings.items()},
        "host_seconds_per_batch": {name: round(s, 3) for name, s in host.items()},
    }
    for name, seconds in report["seconds"].items():
        print(f"{name:22s} {seconds:7.3f} s  {report['float32_mb_per_s'][name]:8.1f} MB/s of float32")
    for name, row in report["encodings_one_part"].items():
        print(f"encoding {name:20s} {row['seconds']:7.3f} s  {row['mb']:8.1f} MB on disk")
    for name, seconds in report["host_seconds_per_batch"].items():
        print(f"per batch {name:52s} {seconds:7.3f} s")
    if not args.no_save:
        folder = Path(args.out) if args.out else Path(__file__).resolve().parent / "results"
        folder.mkdir(parents=True, exist_ok=True)
        out = folder / f"write_parts-{report['date']}{'-' + args.tag if args.tag else ''}.json"
        out.write_text(json.dumps(report, indent=1))
        print("wrote", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
