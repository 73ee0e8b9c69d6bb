"""One layer of a store's Parquet files, sorted by prompt hash, without holding the layer more than once.

Reading every file into one table, combining its chunks and reordering the rows held three copies of the
layer at once (9.4 GiB at the peak for 100,000 prompts of a 7B model, whose layer is 1.6 GB). Here the
prompt hashes are read first (small), their sorted order fixes each row's place, and each file's vectors
are then copied straight to their places in the one output array, several files at once.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from layertap.errors import StoreError
from layertap.parts.writer import encoder_threads


def _threads(files: int) -> int:
    """Files read at once: Arrow decodes without the GIL, so as many as the writer encodes (one per core this
    process may run on), at most 16, up to the files there are."""
    return max(1, min(files, encoder_threads(), 16))


def _read(path: str, column: str, metadata: pq.FileMetaData | None = None) -> tuple[pa.ChunkedArray, pq.FileMetaData]:
    """One column of one file, and the file's footer (passed back in, it is not parsed twice)."""
    with pq.ParquetFile(path, metadata=metadata) as file:
        return file.read(columns=[column]).column(0), file.metadata


def _same_vectors(kind: pa.DataType, expected: pa.FixedSizeListType) -> bool:
    """Same width and value type; the list's field name and nullability may differ (older files declared
    their values nullable)."""
    return (pa.types.is_fixed_size_list(kind) and kind.list_size == expected.list_size
            and kind.value_type == expected.value_type)


def read_layer_sorted(paths: list[str], column: str) -> tuple[pa.Array, pa.FixedSizeListArray]:
    """(prompt hashes in sorted order, the `column` vector of each, in the same order) over `paths`."""
    if not paths:
        raise StoreError("no files to read")
    with ThreadPoolExecutor(_threads(len(paths)), thread_name_prefix="layertap-read") as pool:
        per_file, footers = zip(*pool.map(lambda path: _read(path, "prompt_hash"), paths))
        hashes = pa.chunked_array(per_file).combine_chunks()
        order = pc.sort_indices(hashes).to_numpy()
        place = np.empty(len(order), np.int64)
        place[order] = np.arange(len(order))
        starts = np.cumsum([0] + [len(h) for h in per_file])
        vector_type = footers[0].schema.to_arrow_schema().field(column).type
        if not pa.types.is_fixed_size_list(vector_type):
            raise StoreError(f"{paths[0]}: column {column} is {vector_type}, not a fixed-size list of floats")
        out = np.empty((len(order), vector_type.list_size), vector_type.value_type.to_pandas_dtype())

        def fill(k: int) -> None:
            at = starts[k]
            for chunk in _read(paths[k], column, footers[k])[0].chunks:
                if not _same_vectors(chunk.type, vector_type) or chunk.null_count:
                    raise StoreError(
                        f"{paths[k]}: column {column} holds {chunk.type} with {chunk.null_count} missing "
                        f"vectors; expected {vector_type} with none missing, as in {paths[0]}"
                    )
                out[place[at:at + len(chunk)]] = chunk.flatten().to_numpy().reshape(len(chunk), -1)
                at += len(chunk)
            if at != starts[k + 1]:
                raise StoreError(f"{paths[k]}: {at - starts[k]} vectors for {starts[k + 1] - starts[k]} prompts")

        list(pool.map(fill, range(len(paths))))
    # One type whichever files were read: fixed_size_list<item: value type>[width].
    return hashes.take(pa.array(order)), pa.FixedSizeListArray.from_arrays(pa.array(out.reshape(-1)),
                                                                           vector_type.list_size)
