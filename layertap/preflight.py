"""Checks a run passes before it writes anything, so a mistake costs one clear line and leaves the store
exactly as it was.

Each failure names the file, column or setting at fault: inputs that are missing, unreadable, of the wrong
format or without the text column; a model folder without a config, weights or tokenizer, or with code of
its own that the user has not allowed; layers the model does not have; a store written by another layertap
version.
"""

from __future__ import annotations

import json
from pathlib import Path

from layertap.errors import InputError
from layertap.prepared_run import PreparedRun, prepare_run
from layertap.store.inputs import check_inputs
from layertap.store.reader import Store
from layertap.store.schema import DB_NAME


def check_model_code(model_dir: str | Path, trust_remote_code: bool) -> None:
    """A model whose config points at its own Python code (auto_map) runs that code only on opt-in."""
    if trust_remote_code:
        return
    config = Path(model_dir) / "config.json"
    try:
        auto_map = json.loads(config.read_text()).get("auto_map")
    except (OSError, ValueError):
        return  # read_model_info reports an unreadable config
    if auto_map:
        raise InputError(
            f"model: {model_dir} ships its own code (auto_map in {config.name}); layertap runs it only when "
            "trust_remote_code is set (--trust-remote-code or LAYERTAP_TRUST_REMOTE_CODE=true)"
        )


def check_run(settings) -> PreparedRun | None:
    """Inputs, model, layers and store, in that order; raises InputError or StoreError. Returns the run
    prepared against its model (`prepare_run`), or None for the demo model, which is not built yet."""
    if not settings.input:
        raise InputError("input: no input files given (--input or LAYERTAP_INPUT)")
    check_inputs(list(settings.input), settings.text_column)
    run = None
    if settings.model:
        run = prepare_run(settings)  # the folder (config, weights, tokenizer), then the layers
        check_model_code(Path(settings.model).expanduser(), settings.trust_remote_code)
    if (settings.store_path() / DB_NAME).is_file():
        Store(settings.store_path())  # opens read-only and checks the schema version
    return run
