"""The embedding pipeline every flow runs: ingest -> normalise/dedup -> register extraction -> plan ->
per batch: extract -> validate -> publish -> validate store, then the run's artifacts.

It runs inside whichever flow calls it, so the tasks, logs and artifacts land on that flow run's page.
Only work the store lacks is planned, so a rerun over unchanged inputs starts no engine. A run looks only
at the rows of its own input files, so datasets sharing a store never pull in each other's rows.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path

from prefect import get_run_logger
from prefect.logging.handlers import APILogHandler
from prefect.runtime import deployment, flow_run
from prefect.utilities.annotations import quote

from flows.store_turn import store_turn
from layertap import faults
from layertap import progress as run_progress
from layertap.batch import Part
from layertap.batch_loop import BatchLoop
from layertap.store.disk_space import check_room
from layertap.errors import ModelUnusable, StoreUnwritable
from layertap.preflight import check_run
from layertap.prepared_run import PreparedRun, prepare_run
from layertap.store.registry import Registry
from layertap.report import run_summary
from layertap.runner import engine_cache
from layertap.settings import DEPLOYMENT_LOCK_WAIT_S, Settings
from layertap.store.store_db import StoreDB
from layertap.store.plan import WorkBatch
from layertap.store.lock import store_lock
from layertap.parts.writer import stored_value_bytes
from tasks import (
    extract_batch,
    ingest,
    normalise,
    plan,
    publish_batches,
    quarantine_batch,
    register_extraction,
    validate_batch,
    validate_store,
)
from tasks.artifacts import ProgressArtifact, publish_counts


def run_settings(settings: Settings, deployed: bool) -> Settings:
    """The settings a run works with: its model folder and store path resolved, and a deployment run's
    defaults (its engine kept warm for the next run, a wait for a store another run holds)."""
    return settings.model_copy(update={
        "model": resolve_model(settings), "store": str(settings.store_path()),
        "warm_engine": deployed if settings.warm_engine is None else settings.warm_engine,
        "lock_timeout": (DEPLOYMENT_LOCK_WAIT_S if deployed else 0.0) if settings.lock_timeout is None
        else settings.lock_timeout,
    })


def resolve_model(settings: Settings) -> str:
    """The model folder to use; without one, the embedded tiny demo model (built once, then reused)."""
    if settings.model:
        return str(Path(settings.model).expanduser().resolve())
    from layertap.model.tiny_model import build_tiny_model

    return build_tiny_model(settings.demo_model_dir())


def _extracted(future, store: str, store_uuid: str, batch: WorkBatch, run: PreparedRun) -> Part:
    """A batch's part, reusing a cached part only while its files are still where the cache says."""
    part = Part.from_result(future.result())
    if not all((Path(store) / file.relpath).is_file() for file in part.files):
        part = extract_batch.with_options(refresh_cache=True)(store, store_uuid, batch, run)
    return part


class _TaskStages:
    """The batch loop's stages as this flow's Prefect tasks (`layertap.batch_loop.Stages`)."""

    def __init__(self, store: str, store_uuid: str, run: PreparedRun):
        self.store, self.store_uuid, self.run = store, store_uuid, run

    def extract(self, batch: WorkBatch):
        return extract_batch.submit(self.store, self.store_uuid, batch, self.run)

    def extracted(self, batch: WorkBatch, future) -> Part:
        return _extracted(future, self.store, self.store_uuid, batch, self.run)

    def check(self, batch: WorkBatch, part: Part, first: bool):
        # quote(): Prefect would otherwise walk every prompt hash the part lists, looking for futures, on
        # the flow's thread (~0.1 s per batch of 1024).
        return validate_batch.submit(self.store, quote(part), self.run, parity=first)

    def publish(self, ready: list[tuple[WorkBatch, Part]]):
        return publish_batches.submit(self.store, quote([part for _, part in ready]))

    def quarantine(self, batch: WorkBatch, error: str) -> dict:
        return quarantine_batch(self.store, batch, error)

    def concurrent(self, future):
        return future.wrapped_future


def _engine_use(before, after) -> dict:
    """The engine's seconds computing and waiting for work during the extraction phase. Waiting means the
    host's work on earlier batches (files, checks, publishing) held the batches back: more batches in flight
    or a faster store disk would help; none means the engine bounds the run."""
    if after is None:
        return {"engine_busy_seconds": None, "engine_idle_seconds": None}
    used = after.since(before)
    return {"engine_busy_seconds": round(used.stepping_s, 3), "engine_idle_seconds": round(used.idle_s, 3)}


@contextlib.contextmanager
def library_logs_to_prefect() -> Iterator[None]:
    """While the run lasts, layertap's own log records (out-of-memory splits, engines that stopped answering)
    reach its logs in the Prefect UI: the library's logger gets the API handler Prefect gives the loggers
    named in PREFECT_LOGGING_EXTRA_LOGGERS (the console already shows them, through the root logger)."""
    library = logging.getLogger("layertap")
    added = [handler for handler in logging.getLogger("prefect.extra").handlers
             if isinstance(handler, APILogHandler) and handler not in library.handlers]
    for handler in added:
        library.addHandler(handler)
    try:
        yield
    finally:
        for handler in added:  # outside a run Prefect would warn that a record has no run to go to
            library.removeHandler(handler)


def run_pipeline(settings: Settings, dataset: str | None = None) -> dict:
    """Embed the rows of `settings.input`; returns the run summary (also recorded in the store)."""
    started = time.perf_counter()
    logger = get_run_logger()
    prepared = check_run(settings)  # nothing is written before inputs, model, layers and store check out
    engine_cache.check_executor(settings)  # with the ray executor: the cluster holds the engines asked for
    if not settings.model:
        logger.info("no model given: using the tiny demo model in %s", settings.demo_model_dir())
    deployed = deployment.id is not None
    settings = run_settings(settings, deployed)
    store_dir = settings.store
    # One writing run per store; readers never wait on it. Deployment runs first take their store's turn in
    # Prefect (a concurrency limit per store), then its lock with what is left of the wait.
    turn = store_turn(store_dir, settings.lock_timeout, logger) if deployed else contextlib.nullcontext(
        settings.lock_timeout)
    if prepared is not None:
        prepared = prepared.with_settings(**settings.model_dump(include={"store", "warm_engine", "lock_timeout"}))
    with library_logs_to_prefect(), turn as lock_wait, store_lock(store_dir, lock_wait):
        return _run_locked(settings, prepared, store_dir, dataset, started, logger)


def _run_locked(
    settings: Settings, prepared: PreparedRun | None, store_dir: str, dataset: str | None, started: float, logger
) -> dict:
    history = Registry(store_dir)
    run_id = history.start_run(dataset, str(flow_run.get_id() or "") or None)

    try:
        # The model's files, layers and truncation length, read once for the run (by the preflight, unless the
        # model is the demo one it has just built).
        run = prepared or prepare_run(settings)
        settings = run.settings
        if StoreDB(store_dir).changed_sources(settings.input, settings.text_column):
            # New rows usually bring new prompts: the engine starts (or a warm one is attached) while they are
            # read and planned, not after.
            engine_cache.start_early(settings)
        ingested = ingest(store_dir, settings.input, settings.text_column)
        sources = ingested["sources"]
        normalised = normalise(store_dir, settings.remove_period)
        store_uuid = register_extraction(store_dir, run)
        eid, layer_list = run.extraction_id, run.layers
        batches = plan(store_dir, run, sources, fill=settings.batches_in_flight)
        planned = sum(b.num_prompts for b in batches)
        if batches:  # refused before any engine work when the output cannot fit
            check_room(store_dir, sum(b.num_prompts * len(b.layers) for b in batches), run.hidden_size,
                       stored_value_bytes(settings.dtype, run.stored_dtype))
            engine_cache.settle_engine_logging(settings)  # an engine here starts in a task, beside others logging

        watch = ProgressArtifact(dataset, planned, len(batches))
        elapsed = run_progress.stopwatch()
        loop = BatchLoop(
            _TaskStages(store_dir, store_uuid, run), batches, in_flight=settings.batches_in_flight,
            size=lambda batch: batch.num_prompts, fatal=(StoreUnwritable, ModelUnusable),
            progress=lambda done: run_progress.report(run_progress.Progress(
                done.batches_done, len(batches), done.prompts_done, planned, elapsed())),
        )
        phase_started = time.perf_counter()
        activity_before = engine_cache.engine_activity(settings)  # both readings lie inside the phase's time
        with run_progress.listen(watch):
            extraction = loop.run()
        engine = _engine_use(activity_before or engine_cache.activity_when_attached(settings),
                             engine_cache.engine_activity(settings))
        # Batches overlap, so the extraction phase is timed on the wall clock, not summed per batch.
        extract_seconds = time.perf_counter() - phase_started if batches else 0.0
        embedded = sum(done.result["published"] for done in extraction.published)
        refused = sum(done.result["rejected"] for done in extraction.published)
        tokens = sum(done.part.num_tokens for done in extraction.published)
        ledger = validate_store(store_dir, run.rules_id, eid, layer_list, sources)
        if not batches:
            logger.info("nothing to extract: %d prompts already embedded", ledger["embedded"])
    except BaseException as exc:
        history.finish_run(run_id, "failed", time.perf_counter() - started, {"error": str(exc)[:500]})
        raise
    finally:
        engine_cache.close_runners()

    summary = run_summary(
        dataset=dataset, store=store_dir, model=settings.model, extraction_id=eid, layers=layer_list,
        dimension=run.hidden_size, ledger=ledger, seconds=time.perf_counter() - started,
        new_rows=ingested["rows_new"], normalised=normalised, planned=planned, batches=len(batches),
        embedded=embedded, refused=refused, tokens=tokens, extract_seconds=extract_seconds, engine=engine,
        quarantined=extraction.quarantined,
    )
    publish_counts(summary)
    history.finish_run(run_id, "completed", summary["seconds"], summary)
    faults.hit("run.finished")  # the run recorded as completed, its summary not yet returned
    logger.info(
        "embed done: %d rows, %d new prompts, %d duplicates, %d rejected, %d planned, %d embedded, "
        "%d skipped as already embedded, %d refused by the engine, layers %s, dimension %d, extraction %s, %.1fs",
        summary["rows"], summary["new_prompts"], summary["duplicates"], summary["rejected"], planned, embedded,
        summary["skipped"], refused, ",".join(map(str, layer_list)), summary["dimension"], eid, summary["seconds"],
    )
    return summary
