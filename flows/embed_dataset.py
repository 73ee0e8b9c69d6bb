"""The `embed-dataset` flow: embed whatever is new in one registered dataset.

This is what the rows-added event triggers (`layertap add` emits it), so it takes only the dataset's name
and store: the files and extraction settings come from the store's registry, which keeps the dataset's
vectors on one extraction key however the run was started. Rows already embedded are never re-embedded.
"""

from __future__ import annotations

from prefect import flow
from pydantic import ValidationError

from flows.pipeline import run_pipeline
from layertap.errors import InputError
from layertap.registry import EXTRACTION_OPTIONS, Registry
from layertap.settings import load_settings, settings_error_line


# What a dataset fixes when it is created; a run can change everything else (batch size, engine options).
FIXED = ("input", "store", "text_column", *EXTRACTION_OPTIONS)


def dataset_settings(dataset: str, store: str | None, env_file: str | None, options: dict | None = None):
    """The dataset's files and extraction settings on top of `options` and the environment."""
    options = {k: v for k, v in (options or {}).items() if v is not None}
    fixed = sorted(set(options) & set(FIXED))
    if fixed:
        raise InputError(f"{', '.join(fixed)}: fixed by dataset {dataset}, not a run option")
    try:
        base = load_settings(env_file=env_file, store=store, **options)
        found = Registry(base.store_path(), create=False).get(dataset)
        if not found.sources:
            raise InputError(f"dataset {dataset} has no files (layertap add --dataset {dataset} --input ...)")
        return load_settings(
            env_file=env_file, store=str(base.store_path()), input=found.sources, text_column=found.text_column,
            **options, **found.options,
        )
    except ValidationError as exc:
        raise InputError(settings_error_line(exc)) from None


@flow(name="embed-dataset", flow_run_name="embed-dataset-{dataset}", log_prints=False)
def embed_dataset_flow(
    dataset: str, store: str | None = None, env_file: str | None = ".env", options: dict | None = None
) -> dict:
    """Embed the new rows of `dataset` in `store` (default: LAYERTAP_STORE, then ./layertap-store);
    `options` are run settings such as batch_size or engine options (default: from the environment)."""
    return run_pipeline(dataset_settings(dataset, store, env_file, options), dataset=dataset)
