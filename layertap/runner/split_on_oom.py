"""Run a batch through the engine, halving it whenever the device runs out of memory.

An out-of-memory error says the batch was too big for the device right now, not that it is wrong, so
retrying the same batch would fail the same way. Halves are retried (recursively, down to one prompt)
and their results stitched back together in the batch's order of positions.
"""

from __future__ import annotations

import logging
import sys

import numpy as np

from layertap import faults
from layertap.errors import OutOfDeviceMemory
from layertap.runner.base import Extraction

log = logging.getLogger(__name__)


def is_out_of_memory(exc: BaseException) -> bool:
    """torch's error in this process, or a runner process's (`OutOfDeviceMemory`)."""
    if isinstance(exc, OutOfDeviceMemory):
        return True
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(exc, torch.OutOfMemoryError)


def _free_device_memory() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _merge(first: Extraction, second: Extraction, offset: int, layers: list[int]) -> Extraction:
    """Second half's positions shifted by `offset`; vectors stacked in the order of `kept`."""
    vectors = {
        layer: np.concatenate([np.asarray(first.vectors[layer]), np.asarray(second.vectors[layer])])
        for layer in layers
    }
    first.release()
    second.release()
    return Extraction(
        vectors=vectors,
        kept=first.kept + [offset + i for i in second.kept],
        rejected={**first.rejected, **{offset + i: r for i, r in second.rejected.items()}},
        num_tokens=first.num_tokens + second.num_tokens,
        truncated={**first.truncated, **{offset + i: n for i, n in second.truncated.items()}},
    )


def extract_splitting(
    runner, texts: list[str], layers: list[int], pooling: str, renew=None, **options
) -> Extraction:
    """`runner.extract(texts, layers, pooling, **options)`, split in halves on out-of-memory.

    An out-of-memory error inside an engine step takes that engine down; `renew()` then gives the runner
    the halves use (a fresh engine if the old one no longer answers). The `extract` fault point sits here,
    at the engine boundary, so injected engine failures travel the same path as real ones. A single prompt
    that does not fit re-raises the error.
    """
    try:
        faults.hit("extract", texts=texts, engine=runner)
        return runner.extract(texts, layers, pooling, **options)
    except Exception as exc:
        if not is_out_of_memory(exc) or len(texts) < 2:
            raise
    _free_device_memory()
    if renew is not None:
        runner = renew()
    mid = len(texts) // 2
    log.warning("out of memory on %d prompts: retrying as %d + %d", len(texts), mid, len(texts) - mid)
    first = extract_splitting(runner, texts[:mid], layers, pooling, renew, **options)
    second = extract_splitting(runner, texts[mid:], layers, pooling, renew, **options)
    return _merge(first, second, mid, sorted(set(layers)))
