"""Checks a batch must pass before it is published, and the parity sample against Hugging Face.

Each check raises `ValidationError` naming itself, so a failed run says what was wrong, not just that
something was.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from layertap import faults
from layertap.errors import ValidationError
from layertap.parts import bfloat16
from layertap.parts.layer_views import stacked_view
from layertap.parts.writer import layer_column

# Layers of one host buffer are checked a block at a time, each block's scratch (magnitudes) at most this big.
CHECK_BLOCK_BYTES = 32_000_000
# float16's largest finite value, and the largest bfloat16 (as its bit pattern, sign cleared) not above it:
# 65280; the next bfloat16, 65536, would be stored as inf.
FLOAT16_MAX = float(np.finfo(np.float16).max)
BFLOAT16_PATTERN_BELOW_FLOAT16_MAX = 0x477F
# Minimum cosine between layertap's vectors and transformers' for the same prompt and layer.
PARITY_MIN_COSINE = {"float32": 0.99999, "float16": 0.99, "bfloat16": 0.99}


def check_store_complete(db, rules_id: str, extraction_id: str, layers: list[int], sources: list[str] | None) -> dict:
    """The end of every run, under the store's lock: remove unpublished leftovers (of this run or of one that
    crashed), then check that the store holds every requested layer of every prompt in scope (but quarantined
    ones) and that the ledger accounts for every input row. Returns the ledger's counts."""
    db.sweep_staging(min_age_s=0)  # the run holds the store's lock: any unpublished file is a leftover
    counts = db.ledger_counts(rules_id, extraction_id, list(layers), sources)
    faults.hit("validate-store.counted")  # every batch published, the ledger not yet checked
    if counts["pending"]:
        raise ValidationError(
            f"check 'store complete': {counts['pending']} rows still lack a result for some of layers "
            f"{','.join(map(str, layers))}"
        )
    accounted = sum(counts[status] for status in ("embedded", "duplicate", "rejected", "quarantined"))
    if accounted != counts["rows"]:
        raise ValidationError(f"check 'ledger': accounts for {accounted} of {counts['rows']} input rows")
    return counts


def check_vectors(
    vectors: dict[int, np.ndarray], layers: list[int], num_rows: int, hidden_size: int, stored_dtype: str = "float32",
) -> None:
    """One vector per prompt and layer, of the model's width, finite, not all zero, and (stored as float16)
    inside float16's range, so that no value is stored as inf."""
    missing = sorted(set(layers) - set(vectors))
    if missing:
        raise ValidationError(f"check 'layers present': layers {missing} missing")
    arrays = [np.asarray(vectors[layer]) for layer in layers]
    for layer, array in zip(layers, arrays):
        if array.shape != (num_rows, hidden_size):
            raise ValidationError(
                f"check 'shape': layer {layer} has shape {array.shape}, expected ({num_rows}, {hidden_size})"
            )
    for layer, finite, zero, too_big in _checked_rows_by_layer(layers, arrays, stored_dtype == "float16"):
        if not finite.all():
            raise ValidationError(
                f"check 'finite': layer {layer} has {int((~finite).sum())} vectors with NaN or inf"
            )
        if zero.any():
            raise ValidationError(f"check 'non-zero': layer {layer} has {int(zero.sum())} all-zero vectors")
        if too_big is not None and too_big.any():
            raise ValidationError(
                f"check 'float16 range': layer {layer} has {int(too_big.sum())} vectors with values beyond "
                f"float16's largest ({FLOAT16_MAX:g}); store this model's vectors as float32 (--store-dtype float32)"
            )


def _checked_rows_by_layer(layers: list[int], arrays: list[np.ndarray], float16_range: bool):
    """(layer, finite rows, all-zero rows, rows beyond float16's range or None) for each layer. Layers that
    lie in one host buffer are checked several at a time (`layer_views`): fewer numpy calls, each of which
    waits for Python's lock."""
    together = stacked_view(arrays)
    if together is None:
        for layer, array in zip(layers, arrays):
            yield layer, *_checked_rows(array, float16_range)
        return
    per_block = max(1, CHECK_BLOCK_BYTES // max(1, arrays[0].nbytes))
    for start in range(0, len(layers), per_block):
        finite, zero, too_big = _checked_rows(together[start:start + per_block], float16_range)
        for j in range(len(finite)):
            yield layers[start + j], finite[j], zero[j], None if too_big is None else too_big[j]


def _checked_rows(array: np.ndarray, float16_range: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Per row (along the last axis): no NaN or inf; all zeros; (if asked) a finite value beyond float16's
    range. All from each row's largest magnitude, one pass over the values (NaN propagates through a
    maximum), as these checks run beside the engine on every batch."""
    if bfloat16.is_bfloat16(array):
        peaks = bfloat16.row_peaks(array)
        finite = peaks < bfloat16.EXPONENT_PATTERN
        return finite, peaks == 0, (finite & (peaks > BFLOAT16_PATTERN_BELOW_FLOAT16_MAX)) if float16_range else None
    if array.shape[-1] == 0:
        return np.ones(array.shape[:-1], bool), np.ones(array.shape[:-1], bool), None
    peaks = np.abs(array).max(axis=-1)
    finite = np.isfinite(peaks)
    return finite, peaks == 0, (finite & (peaks > FLOAT16_MAX)) if float16_range else None


def _vectors(table: pa.Table, layers: list[int]) -> dict[int, np.ndarray]:
    return {
        layer: np.asarray(table.column(layer_column(layer)).combine_chunks().flatten(), dtype=np.float32)
        .reshape(table.num_rows, -1)
        for layer in layers
    }


def check_files_cover(listed: list[list[str]], expected_hashes: list[str]) -> None:
    """The files a batch was written as list, between them, each of the batch's prompts exactly once."""
    together = [h for hashes in listed for h in hashes]
    if sorted(together) != sorted(expected_hashes):
        raise ValidationError(
            f"check 'one result per prompt': the part's {len(listed)} files list {len(together)} rows "
            f"({len(set(together))} distinct), expected the batch's {len(expected_hashes)} prompts"
        )


def check_part(path: str, expected_hashes: list[str], layers: list[int], hidden_size: int) -> list[str]:
    """Check a written part against its batch without re-reading its vectors; returns the stored order.

    The footer must parse, the rows must be exactly the batch's prompts (in any order: the engine finishes
    prompts in its own order), and the columns exactly its layers, each a list of `hidden_size` floats.
    The vectors' values were checked in memory before they were written (`check_vectors`); the part's
    page checksums cover what happens to them on disk.
    """
    try:
        part = pq.ParquetFile(path, page_checksum_verification=True)
        schema = part.schema_arrow
        got = part.read(columns=["prompt_hash"]).column("prompt_hash").to_pylist()
    except (OSError, pa.ArrowException) as exc:
        raise ValidationError(f"check 'readable': {path}: {exc}") from exc
    if sorted(got) != sorted(expected_hashes):
        raise ValidationError(
            f"check 'one result per prompt': {path} holds {len(got)} rows "
            f"({len(set(got))} distinct), expected the batch's {len(expected_hashes)} prompts"
        )
    columns = {name for name in schema.names if name.startswith("layer_")}
    expected = {layer_column(layer) for layer in layers}
    if columns != expected:
        raise ValidationError(f"check 'layers present': {path} has {sorted(columns)}, expected {sorted(expected)}")
    for name in sorted(columns):
        kind = schema.field(name).type
        if getattr(kind, "list_size", None) != hidden_size or not pa.types.is_floating(kind.value_type):
            raise ValidationError(
                f"check 'shape': {path} column {name} is {kind}, expected {hidden_size} floats per row"
            )
    return got


def stored_rows(path: str, layers: list[int], rows: list[int]) -> dict[int, np.ndarray]:
    """A few rows of a part as float32, for the parity comparison."""
    return _vectors(pq.read_table(path, columns=[layer_column(layer) for layer in layers]).take(rows), layers)


@dataclass(frozen=True)
class ParityReport:
    """Worst agreement per layer over the sample."""

    prompts: int
    min_cosine: dict[int, float]
    max_abs_error: dict[int, float]


def compare(ours: dict[int, np.ndarray], reference: dict[int, np.ndarray], dtype: str) -> ParityReport:
    """Cosine and max-abs error per layer; raises when any prompt falls below the dtype's tolerance."""
    threshold = PARITY_MIN_COSINE[dtype]
    cosines, errors = {}, {}
    for layer, ref in reference.items():
        got = np.asarray(ours[layer], dtype=np.float64)
        ref = np.asarray(ref, dtype=np.float64)
        denom = np.linalg.norm(got, axis=1) * np.linalg.norm(ref, axis=1)
        cos = (got * ref).sum(axis=1) / np.maximum(denom, 1e-30)
        cosines[layer] = float(cos.min())
        errors[layer] = float(np.abs(got - ref).max())
        if cosines[layer] < threshold:
            raise ValidationError(
                f"check 'parity': layer {layer} cosine {cosines[layer]:.6f} < {threshold} against "
                f"Hugging Face on prompt {int(cos.argmin())} of the sample"
            )
    return ParityReport(len(next(iter(reference.values()))), cosines, errors)


def parity_check(
    model: str,
    texts: list[str],
    vectors: dict[int, np.ndarray],
    layers: list[int],
    pooling: str,
    dtype: str,
    trust_remote_code: bool = False,
    engine=None,
) -> ParityReport:
    """Recompute `texts` with transformers (`hf_reference`: on the GPU in the engine's dtype where it fits,
    else in float32 on the CPU) and compare with `vectors` (rows = texts), at the engine dtype's tolerance.
    Given an engine that can compute the reference (`VllmRunner.reference`, or `RunnerClient.reference` for
    one in another process, so this process never loads torch), it does, with the reference it keeps."""
    if hasattr(engine, "reference"):
        expected = engine.reference(texts, layers, pooling, trust_remote_code)
    else:
        from layertap.runner.hf_runner import hf_reference

        expected = hf_reference(model, texts, layers, pooling, trust_remote_code, dtype)
    return compare({layer: vectors[layer] for layer in layers}, expected, dtype)


def parity_sample(prompt_hashes: list[str], size: int) -> list[int]:
    """Deterministic sample: the positions of the `size` smallest hashes (hashes are uniformly random)."""
    order = sorted(range(len(prompt_hashes)), key=prompt_hashes.__getitem__)
    return sorted(order[:size])
