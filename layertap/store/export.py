"""Copy one layer (or all) out of the store into plain files, for people who do not use DuckDB.

Parquet: `layer_<L>.parquet` with prompt_hash, text and embedding (a fixed-size list). NumPy:
`layer_<L>.npy` (prompts x dimension) with `layer_<L>.csv` naming each row's prompt_hash and text, in the
same order. Files are written under a temporary name and renamed, so a reader never sees half a file.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow.parquet as pq

from layertap.errors import InputError
from layertap.store.reader import Store

FORMATS = ("parquet", "npy")


def _replace(tmp: Path, final: Path) -> Path:
    os.replace(tmp, final)
    return final


def export_layers(
    store_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    layers: Literal["all"] | list[int] = "all",
    fmt: str = "parquet",
    *,
    model: str | None = None,
    pooling: str | None = None,
    dtype: str | None = None,
    store_dtype: str | None = None,
) -> list[Path]:
    """Write the requested layers; returns the files written (data files first, then their indexes)."""
    if fmt not in FORMATS:
        raise InputError(f"export format {fmt!r}: use one of {', '.join(FORMATS)}")
    store = Store(store_dir)
    picked = {"model": model, "pooling": pooling, "dtype": dtype, "store_dtype": store_dtype}
    if layers == "all":
        layers = store.layers(**picked)
        if not layers:
            raise InputError(f"{store.root}: nothing to export yet (no layer has results)")
    out = Path(output_dir).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for layer in layers:
        table = store.embeddings(layer, **picked)
        stem = out / f"layer_{store.resolve_layer(layer, **picked)}"  # file names use 0..N
        if fmt == "parquet":
            tmp = stem.with_suffix(".parquet.tmp")
            pq.write_table(table, tmp)
            written.append(_replace(tmp, stem.with_suffix(".parquet")))
            continue
        embedding = table.column("embedding").combine_chunks()
        width = embedding.type.list_size
        vectors = np.asarray(embedding.flatten()).reshape(table.num_rows, width)
        tmp = stem.with_suffix(".tmp.npy")
        np.save(tmp, vectors)
        written.append(_replace(tmp, stem.with_suffix(".npy")))
        tmp = stem.with_suffix(".csv.tmp")
        with tmp.open("w", newline="", encoding="utf-8") as handle:
            writer = csv.writer(handle)
            writer.writerow(["row", "prompt_hash", "text"])
            writer.writerows(
                zip(range(table.num_rows), table.column("prompt_hash").to_pylist(), table.column("text").to_pylist())
            )
        written.append(_replace(tmp, stem.with_suffix(".csv")))
    return written
