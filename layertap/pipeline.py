"""The embed pipeline in one process, without Prefect: the flow's steps, run in order.

For programs that embed layertap without an orchestrator, and for the crash tests, which kill this
process at named points (`layertap.faults`) and need each restart to cost a process start, not a Prefect
server start. A part that a killed run had written completely but not published is checked and published
instead of extracted again, so a crash late in a batch costs no engine time.

    python -m layertap.pipeline     # settings from LAYERTAP_* variables; prints the ledger counts as JSON
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from layertap import engine_cache, faults
from layertap import validate as checks
from layertap.errors import ValidationError
from layertap.layers import resolve_layers
from layertap.model_fingerprint import fingerprint_model, read_model_info
from layertap.normalise import NormaliseRules
from layertap.preflight import check_run
from layertap.settings import Settings, load_settings
from layertap.split_on_oom import extract_splitting
from layertap.store import ExtractionKey, StoreDB, WorkBatch
from layertap.store_lock import store_lock
from layertap.truncation import truncation_length, truncation_note
from layertap.writer import part_id_for, write_part

log = logging.getLogger(__name__)


def _written_part(db: StoreDB, batch: WorkBatch, part_id: str, hashes: list[str], hidden: int) -> str | None:
    """The relpath of a complete, valid part a killed run left unpublished for this batch, if any."""
    relpath = f"parts/{batch.extraction_id}/{part_id}.parquet"
    if not (db.root / relpath).is_file():
        return None
    try:
        checks.check_part(str(db.root / relpath), hashes, batch.layers, hidden)
    except ValidationError:
        return None  # e.g. the engine had refused some prompts: extract again to learn which
    faults.hit("resume")
    return relpath


def _run_batch(db: StoreDB, batch: WorkBatch, settings: Settings, key: ExtractionKey) -> int:
    hashes, texts = db.batch_prompts(batch.batch_id)
    part_id = part_id_for(batch.extraction_id, batch.layers, batch.prompt_hashes_digest)
    relpath = _written_part(db, batch, part_id, hashes, key.hidden_size)
    rejected, notes, kept = {}, {}, hashes
    if relpath is None:
        options = {"truncate_to": key.truncate_to} if key.truncate_to else {}
        result = extract_splitting(engine_cache.get_runner(settings), texts, batch.layers, settings.pooling,
                                   **options)
        faults.hit("extract.returned")
        kept = [hashes[i] for i in result.kept]
        rejected = {hashes[i]: reason for i, reason in result.rejected.items()}
        notes = {hashes[i]: truncation_note(n, key.truncate_to) for i, n in result.truncated.items()}
        if kept:
            relpath = write_part(db.root, batch.extraction_id, part_id, kept, result.vectors, settings.dtype)
            checks.check_part(str(db.root / relpath), kept, batch.layers, key.hidden_size)
    db.reject_prompts(batch.extraction_id, rejected)
    db.note_prompts(batch.extraction_id, notes)
    if relpath is not None:
        db.publish_part(batch.extraction_id, part_id, relpath, batch.layers,
                        [h for h in hashes if h not in rejected])
    return len(kept)


def run_pipeline(settings: Settings) -> dict:
    """Ingest, normalise, plan, extract and publish what the store lacks; returns the ledger counts."""
    if not settings.model:
        raise ValueError("run_pipeline needs settings.model")
    check_run(settings)
    model = str(Path(settings.model).expanduser().resolve())
    settings = settings.model_copy(update={"model": model})
    store = settings.store_path()
    with store_lock(store, settings.lock_timeout):
        faults.hit("pipeline.locked")
        db = StoreDB(store)
        db.ingest(list(settings.input), settings.text_column)
        rules = NormaliseRules(remove_period=settings.remove_period)
        db.normalise(rules)
        info = read_model_info(model)
        key = ExtractionKey(
            model_fingerprint=fingerprint_model(model), model_path=model, pooling=settings.pooling,
            dtype=settings.dtype, rules_id=rules.rules_id, hidden_size=info.hidden_size,
            num_layers=info.num_layers,
            truncate_to=truncation_length(model, settings.truncate, settings.max_model_len),
        )
        eid = db.register_extraction(key)
        layers = resolve_layers(settings.layer_spec(), info.num_layers)
        embedded = 0
        try:
            for batch in db.plan(eid, layers, rules.rules_id, settings.batch_size):
                embedded += _run_batch(db, batch, settings, key)
        finally:
            engine_cache.close_runners()
        db.sweep_staging(min_age_s=0)  # under the lock, any unpublished file is a leftover
        faults.hit("ledger")
        counts = db.ledger_counts(rules.rules_id, eid, layers)
        if counts["pending"]:
            raise ValidationError(f"check 'store complete': {counts['pending']} rows still lack a result")
        faults.hit("finish")
    return {"embedded_now": embedded, "extraction_id": eid, "ledger": counts}


def main() -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    print(json.dumps(run_pipeline(load_settings(env_file=None))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
