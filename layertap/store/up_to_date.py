"""A run with nothing to do, finished from the store alone.

Starting Prefect, torch or vLLM costs seconds, and a rerun over unchanged inputs needs none of them. Before
anything heavy starts, the store says whether the run would read, normalise or extract anything; when it
would not, the run is recorded in the store's history with the summary a flow run would have given, and
that is all.
"""

from __future__ import annotations

import time
from pathlib import Path

from layertap import faults
from layertap.store.normalise import NormaliseRules
from layertap.prepared_run import PreparedRun, prepare_run
from layertap.store.registry import Registry
from layertap.report import run_summary
from layertap.store.inputs import expand_inputs
from layertap.store.schema import DB_NAME
from layertap.store.store_db import StoreDB
from layertap.store.lock import store_lock
from layertap.model.tiny_model import is_built
from layertap.parts.checks import check_store_complete


def built_model(settings) -> str | None:
    """The model folder the run would use, or None when it is the demo model and not built yet."""
    if settings.model:
        return str(Path(settings.model).expanduser().resolve())
    demo = settings.demo_model_dir()
    return str(demo) if is_built(demo) else None


def finish_if_up_to_date(settings, dataset: str | None = None, run: PreparedRun | None = None) -> dict | None:
    """The run's summary, recorded as a completed run, when the store already holds everything the inputs
    ask for; None when there is work (or the store or model do not exist yet). `run`: the settings already
    prepared against the model (the preflight's)."""
    started = time.perf_counter()
    store_dir = settings.store_path()
    model = built_model(settings)
    if model is None or not (store_dir / DB_NAME).is_file():
        return None
    with store_lock(store_dir, settings.lock_timeout or 0.0):
        db = StoreDB(store_dir)
        if db.changed_sources(settings.input, settings.text_column):
            return None
        rules = NormaliseRules(remove_period=settings.remove_period)
        sources = expand_inputs(settings.input)
        if db.rows_to_normalise(rules, sources):
            return None
        run = run or prepare_run(settings, model)
        key, layers = run.key, run.layers
        if not db.has_extraction(key.extraction_id):
            return None
        if db.pending_prompts(key.extraction_id, layers, rules.rules_id, sources):
            return None
        ledger = check_store_complete(db, rules.rules_id, key.extraction_id, layers, sources)
        summary = run_summary(dataset=dataset, store=str(store_dir), model=model, extraction_id=key.extraction_id,
                              layers=layers, dimension=key.hidden_size, ledger=ledger,
                              seconds=time.perf_counter() - started)
        history = Registry(store_dir)
        history.finish_run(history.start_run(dataset, None), "completed", summary["seconds"], summary)
        faults.hit("run.finished")
        return summary
