"""The `embed` flow: input rows in, validated per-layer embeddings in the store out.

ingest -> normalise/dedup -> register extraction -> plan -> per batch: extract -> validate -> publish
-> validate store. Only work the store lacks is planned, so a rerun over unchanged inputs starts no engine.
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path

from prefect import flow, get_run_logger
from pydantic import ValidationError

from layertap import engine_cache
from layertap.errors import EngineError, InputError
from layertap.preflight import check_run
from layertap.settings import Settings, load_settings, settings_error_line
from layertap.store_lock import store_lock
from layertap.truncation import truncation_length
from tasks import (
    extract_batch,
    ingest,
    normalise,
    plan,
    publish_batch,
    quarantine_batch,
    register_extraction,
    validate_batch,
    validate_store,
)

# A run whose first batches all fail has a broken engine or model, not bad batches: stop instead of
# quarantining everything.
MAX_FAILURES_BEFORE_SUCCESS = 3


def resolve_model(settings: Settings) -> str:
    """The model folder to use; without one, the embedded tiny demo model (built once, then reused)."""
    if settings.model:
        return str(Path(settings.model).expanduser().resolve())
    from layertap.tiny_model import build_tiny_model

    return build_tiny_model(settings.demo_model_dir())


def _extracted(future, store: str, store_uuid: str, batch: dict, settings: Settings) -> dict:
    """A batch's part, reusing a cached part only while its file is still where the cache says."""
    part = future.result()
    if part["relpath"] is not None and not (Path(store) / part["relpath"]).is_file():
        part = extract_batch.with_options(refresh_cache=True)(store, store_uuid, batch, settings)
    return part


@flow(name="embed", log_prints=False, result_serializer="json")
def embed_flow(
    input: list[str] | str | None = None,
    text_column: str | None = None,
    model: str | None = None,
    layers: str | list[int] | None = None,
    pooling: str | None = None,
    dtype: str | None = None,
    store: str | None = None,
    remove_period: bool | None = None,
    batch_size: int | None = None,
    parity_sample: int | None = None,
    batches_in_flight: int | None = None,
    max_num_batched_tokens: int | None = None,
    max_model_len: int | None = None,
    gpu_memory_utilization: float | None = None,
    tensor_parallel_size: int | None = None,
    enforce_eager: bool | None = None,
    trust_remote_code: bool | None = None,
    load_format: str | None = None,
    truncate: bool | None = None,
    lock_timeout: float | None = None,
    env_file: str | None = ".env",
) -> dict:
    """Embed every input row's prompt at the requested layers; parameters left at None come from
    LAYERTAP_* environment variables, then `env_file`, then the defaults."""
    started = time.perf_counter()
    logger = get_run_logger()
    try:
        settings = load_settings(
            env_file=env_file,
            input=input,
            text_column=text_column,
            model=model,
            layers=layers,
            pooling=pooling,
            dtype=dtype,
            store=store,
            remove_period=remove_period,
            batch_size=batch_size,
            parity_sample=parity_sample,
            batches_in_flight=batches_in_flight,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            enforce_eager=enforce_eager,
            trust_remote_code=trust_remote_code,
            load_format=load_format,
            truncate=truncate,
            lock_timeout=lock_timeout,
        )
    except ValidationError as exc:
        raise InputError(settings_error_line(exc)) from None
    check_run(settings)  # nothing is written before inputs, model, layers and store check out
    store_dir = str(settings.store_path())
    if not settings.model:
        logger.info("no model given: using the tiny demo model in %s", settings.demo_model_dir())
    settings = settings.model_copy(update={"model": resolve_model(settings), "store": store_dir})

    with store_lock(store_dir, settings.lock_timeout):  # one writing run per store; readers never wait on it
        return _embed_locked(settings, store_dir, started, logger)


def _embed_locked(settings: Settings, store_dir: str, started: float, logger) -> dict:
    try:
        ingested = ingest(store_dir, settings.input, settings.text_column)
        normalised = normalise(store_dir, settings.remove_period)
        key = register_extraction(
            store_dir, settings.model, settings.pooling, settings.dtype, settings.remove_period,
            settings.layer_spec(),
            truncate_to=truncation_length(settings.model, settings.truncate, settings.max_model_len),
        )
        eid, layer_list = key["extraction_id"], key["layers"]
        batches = plan(store_dir, eid, layer_list, key["rules_id"], settings.batch_size)
        planned = sum(b["num_prompts"] for b in batches)

        # Up to `batches_in_flight` extractions run at once: the engine stays busy on the next batches
        # while the previous one is written, validated and published (publishing stays in batch order).
        embedded = refused = succeeded = 0
        quarantined = []
        in_flight: deque = deque()
        for batch in [*batches, None]:
            if batch is not None:
                in_flight.append((batch, extract_batch.submit(store_dir, key["store_uuid"], batch, settings)))
            while in_flight and (batch is None or len(in_flight) > settings.batches_in_flight):
                done_batch, future = in_flight.popleft()
                try:
                    part = _extracted(future, store_dir, key["store_uuid"], done_batch, settings)
                except Exception as exc:  # noqa: BLE001 - retries are spent: set the batch aside, go on
                    error = " ".join(f"{type(exc).__name__}: {exc}".split())
                    quarantined.append(quarantine_batch(store_dir, done_batch, error))
                    if not succeeded and len(quarantined) >= MAX_FAILURES_BEFORE_SUCCESS:
                        raise EngineError(f"the first {len(quarantined)} batches all failed; last error: {error}")
                    continue
                validate_batch(store_dir, part, key["hidden_size"], settings, parity=succeeded == 0)
                published = publish_batch(store_dir, part)
                succeeded += 1
                embedded += published["published"]
                refused += published["rejected"]
        ledger = validate_store(store_dir, key["rules_id"], eid, layer_list)
        if not batches:
            logger.info("nothing to extract: %d prompts already embedded", ledger["embedded"])
    finally:
        engine_cache.close_runners()

    rejected = dict(normalised.get("rejected") or {})
    summary = {
        "rows": ingested["rows_total"],
        "new_rows": ingested["rows_new"],
        "new_prompts": normalised["new_prompts"],
        "duplicates": normalised["duplicates"],
        "rejected": sum(rejected.values()),
        "refused": refused,
        "planned": planned,
        "embedded": embedded,
        "layers": layer_list,
        "dimension": key["hidden_size"],
        "store": store_dir,
        "model": settings.model,
        "extraction_id": eid,
        "ledger": ledger,
        "quarantined": quarantined,
        "seconds": round(time.perf_counter() - started, 3),
    }
    logger.info(
        "embed done: %d rows, %d new prompts, %d duplicates, %d rejected, %d planned, %d embedded, "
        "%d refused by the engine, layers %s, dimension %d, extraction %s, %.1fs",
        summary["rows"], summary["new_prompts"], summary["duplicates"], summary["rejected"], planned, embedded,
        refused, ",".join(map(str, layer_list)), summary["dimension"], eid, summary["seconds"],
    )
    return summary
