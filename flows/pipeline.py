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
from collections import deque
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_first
from pathlib import Path

from prefect import get_run_logger
from prefect.logging.handlers import APILogHandler
from prefect.runtime import deployment, flow_run
from prefect.utilities.annotations import quote

from flows.store_turn import store_turn
from layertap import faults
from layertap import progress as run_progress
from layertap.batch import Part
from layertap.store.disk_space import check_room
from layertap.errors import EngineError, ModelUnusable, StoreUnwritable
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

# A run whose first batches all fail has a broken engine or model, not bad batches: stop instead of
# quarantining everything.
MAX_FAILURES_BEFORE_SUCCESS = 3


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
    store_dir = str(settings.store_path())
    if not settings.model:
        logger.info("no model given: using the tiny demo model in %s", settings.demo_model_dir())
    # A deployment run keeps its engine warm for the next one, and waits its turn on a store another run holds.
    deployed = deployment.id is not None
    settings = settings.model_copy(update={
        "model": resolve_model(settings), "store": store_dir,
        "warm_engine": deployed if settings.warm_engine is None else settings.warm_engine,
        "lock_timeout": (DEPLOYMENT_LOCK_WAIT_S if deployed else 0.0) if settings.lock_timeout is None
        else settings.lock_timeout,
    })
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

        embedded = refused = tokens = succeeded = extracted = done = 0
        quarantined = []
        watch = ProgressArtifact(dataset, planned, len(batches))
        elapsed = run_progress.stopwatch()
        # At most `batches_in_flight` extractions run at once (each holds its vectors in host memory until
        # written). The flow's thread waits for whichever comes first, the oldest extraction or the oldest
        # part's checks. A finished extraction frees its slot for the next batch at once, so the engine never
        # waits on the flow's own steps; its part's checks then run on a worker thread. Checked parts are
        # published in batch order, all that are waiting in one transaction: when publishing is slow (every
        # store statement waits for Python's lock while the engine loop computes in this process), the
        # flow publishes fewer, larger groups instead of falling further behind.
        waiting, in_flight, checking = deque(batches), deque(), deque()

        def report_progress() -> None:
            finished = len(quarantined) + succeeded
            run_progress.report(run_progress.Progress(finished, len(batches), done, planned, elapsed()))

        def fill() -> None:
            while waiting and len(in_flight) < settings.batches_in_flight:
                batch = waiting.popleft()
                in_flight.append((batch, extract_batch.submit(store_dir, store_uuid, batch, run)))

        def take(batch: WorkBatch, future) -> None:
            nonlocal extracted, done
            try:
                part = _extracted(future, store_dir, store_uuid, batch, run)
            except (StoreUnwritable, ModelUnusable):
                raise  # the store's disk or the model, not the batch: every later batch would fail the same way
            except Exception as exc:  # noqa: BLE001 - retries are spent: set the batch aside, go on
                error = " ".join(f"{type(exc).__name__}: {exc}".split())
                quarantined.append(quarantine_batch(store_dir, batch, error))
                done += batch.num_prompts
                report_progress()  # the last batch to finish may be this one: the bar must still end
                if not extracted and len(quarantined) >= MAX_FAILURES_BEFORE_SUCCESS:
                    raise EngineError(f"the first {len(quarantined)} batches all failed; last error: {error}") from None
                fill()
                return
            fill()
            # quote(): Prefect would otherwise walk every prompt hash the part lists, looking for futures, on
            # the flow's thread (~0.1 s per batch of 1024).
            checking.append((batch, part, validate_batch.submit(
                store_dir, quote(part), run, parity=extracted == 0)))
            extracted += 1

        def publish_checked() -> None:
            """Every part waiting, in batch order, once checked; up to the first that fails its checks, which
            has quarantined its files and stops the run here."""
            nonlocal succeeded, embedded, refused, tokens, done
            ready, failure = [], None
            while checking:
                batch, part, checked = checking.popleft()
                try:
                    checked.result()
                except Exception as exc:  # noqa: BLE001 - raised once the parts before it are published
                    failure = exc
                    break
                ready.append((batch, part))
            if ready:
                published = publish_batches(store_dir, quote([part for _, part in ready]))
                for (batch, part), counts in zip(ready, published):
                    succeeded += 1
                    embedded += counts["published"]
                    refused += counts["rejected"]
                    tokens += part.num_tokens
                    done += batch.num_prompts
                report_progress()
            if failure is not None:
                raise failure

        phase_started = time.perf_counter()
        activity_before = engine_cache.engine_activity(settings)  # both readings lie inside the phase's time
        with run_progress.listen(watch):
            if batches:
                report_progress()  # extraction starts: a terminal's bar appears at 0
            fill()
            while in_flight or checking:
                heads = [queue[0][-1] for queue in (in_flight, checking) if queue]
                wait_first([future.wrapped_future for future in heads], return_when=FIRST_COMPLETED)
                while in_flight and in_flight[0][1].wrapped_future.done():
                    take(*in_flight.popleft())
                if checking and checking[0][2].wrapped_future.done():
                    publish_checked()
        engine = _engine_use(activity_before or engine_cache.activity_when_attached(settings),
                             engine_cache.engine_activity(settings))
        # Batches overlap, so the extraction phase is timed on the wall clock, not summed per batch.
        extract_seconds = time.perf_counter() - phase_started if batches else 0.0
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
        quarantined=quarantined,
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
