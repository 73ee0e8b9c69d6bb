"""One batch, start to end on an engine's side: extract its vectors, check them, write its Parquet part.

The same function runs wherever the engine is: in the flow's own process (the `extract-batch` task, local
executor) and inside a Ray actor (`layertap.runner.ray_engines`). It needs the batch's texts, not the store's
database: the caller reads them, so the process that opens DuckDB stays the flow's. It returns the part's
metadata (file paths, prompt hashes, refusals), never its vectors.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from layertap import faults
from layertap.parts import background, checks
from layertap.store.disk_space import as_unwritable
from layertap.runner.engine_cache import discard_if_dead, get_runner
from layertap.errors import ValidationError
from layertap.prepared_run import PreparedRun
from layertap.settings import Settings
from layertap.runner.split_on_oom import extract_splitting
from layertap.store.plan import WorkBatch
from layertap.model.truncation import truncation_note
from layertap.parts.writer import part_id_for, write_batch_files

log = logging.getLogger(__name__)

# Value checks run beside the Parquet writers, on threads kept for the process: a thread started for each
# batch left glibc heap behind batch after batch (bench/host_side_memory.py: ~4.5 MB per batch, 1.5 without).
_CHECKERS = ThreadPoolExecutor(thread_name_prefix="layertap-check", initializer=background.lower_this_thread)


@dataclass(frozen=True)
class PartFile:
    """One Parquet file of a part: its id, its path in the store, and the prompts it holds in row order
    (None in a part cached before parts could span files: the part's prompts, then)."""

    part_id: str
    relpath: str
    prompt_hashes: list[str] | None = None


@dataclass(frozen=True)
class Part:
    """A batch's written part, as the flow sees it: where its files are and what they hold, never vectors."""

    batch_id: str
    extraction_id: str
    part_id: str
    files: list[PartFile]
    layers: list[int]
    num_prompts: int
    # What the part must hold, in plan order: passed on so that checking and publishing the part need not
    # read the batch from the store again (each store access opens the database file). None in a part
    # cached before it was passed on.
    prompt_hashes: list[str] | None = None
    rejected: dict[str, str] = field(default_factory=dict)
    truncated: dict[str, str] = field(default_factory=dict)
    # Why the values failed their check before writing (the part is still written, to be quarantined).
    problem: str | None = None
    num_tokens: int = 0
    seconds: float = 0.0
    # The Ray engine that extracted it ("index@host:pid"); None for a local engine.
    engine: str | None = None

    @classmethod
    def from_result(cls, value: Part | dict) -> Part:
        """A part from an `extract-batch` result, which a Prefect cache may hold as the plain dict of an
        earlier layertap (a single file named by `relpath` then)."""
        if isinstance(value, cls):
            return value
        data = dict(value)
        if "files" in data:
            files = [PartFile(**f) for f in data["files"]]
        else:
            files = [PartFile(data["part_id"], data["relpath"])] if data.get("relpath") else []
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in data.items() if k in names and k != "files"}, files=files)


def _renewed(settings: Settings):
    """The process's engine after an out-of-memory error: the same one if it still answers, else a new one."""
    discard_if_dead(settings, get_runner(settings))
    return get_runner(settings)


def batch_part_id(batch: WorkBatch, attempt: int | None = None) -> str:
    """The part's id: the batch's content (extraction, layers, prompts), plus the attempt when given, so a
    late attempt on another machine never overwrites the file an earlier one wrote and the flow checked."""
    part_id = part_id_for(batch.extraction_id, list(batch.layers), batch.prompt_hashes_digest)
    return part_id if attempt is None else f"{part_id}-a{int(attempt)}"


def run_batch(
    store: str, batch: WorkBatch, hashes: list[str], texts: list[str], run: PreparedRun, attempt: int | None = None
) -> Part:
    """Extract the batch's layers with this process's engine for the run's settings, check the values and
    write them as the batch's part (one or more files in the store's parts/); returns the part's metadata.

    Out-of-memory halves the batch here (on a fresh engine when the error took the engine down); any other
    failure is raised, after a dead or wedged engine was discarded so that the next attempt starts afresh.
    """
    settings = run.settings
    layers = list(batch.layers)
    truncate_to = run.truncate_to
    runner = get_runner(settings)
    runner.reserve_host_buffers(settings.batch_size, len(layers), settings.batches_in_flight, settings.pooling)
    started = time.perf_counter()
    try:
        options = {"truncate_to": truncate_to} if truncate_to else {}
        result = extract_splitting(runner, texts, layers, settings.pooling, renew=lambda: _renewed(settings),
                                   **options)
    except Exception:
        # An engine that failed mid-batch may be dead or wedged: if it fails a probe, the retry gets a fresh one.
        discard_if_dead(settings, runner)
        raise
    seconds = time.perf_counter() - started
    faults.hit("extract.returned")  # vectors in memory, nothing written yet
    kept = [hashes[i] for i in result.kept]
    rejected = {hashes[i]: reason for i, reason in sorted(result.rejected.items())}
    truncated = {hashes[i]: truncation_note(n, truncate_to) for i, n in sorted(result.truncated.items())}
    part_id = batch_part_id(batch, attempt)
    files, problem = [], None
    if kept:
        # Values are checked in memory while the files are encoded (both only read the vectors), so the
        # published part never has to be read back whole; a failing part is still written, for
        # validate-batch to quarantine and report.
        checked = _CHECKERS.submit(checks.check_vectors, result.vectors, layers, len(kept), runner.hidden_size,
                                   run.stored_dtype)
        try:
            files = write_batch_files(store, batch.extraction_id, part_id, kept, result.vectors,
                                      run.stored_dtype, max_file_bytes=int(settings.part_file_mb * 1e6))
        except OSError as exc:
            raise as_unwritable(exc, store) or exc from exc
        finally:
            wait([checked])  # the check is done with the vectors before their buffer is handed back
            result.release()
        try:
            checked.result()
        except ValidationError as exc:
            problem = str(exc)
    return Part(
        batch_id=batch.batch_id,
        extraction_id=batch.extraction_id,
        part_id=part_id,
        files=[PartFile(**file) for file in files],
        layers=layers,
        num_prompts=len(kept),
        prompt_hashes=[h for h in hashes if h not in rejected],
        rejected=rejected,
        truncated=truncated,
        problem=problem,
        num_tokens=result.num_tokens,
        seconds=round(seconds, 3),
    )
