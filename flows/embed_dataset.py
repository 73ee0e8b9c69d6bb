"""The `embed-dataset` flow: embed whatever is new in one registered dataset.

This is what the rows-added event triggers (`layertap add` emits it), so it takes only the dataset's name
and store: the files and extraction settings come from the store's registry, which keeps the dataset's
vectors on one extraction key however the run was started. Rows already embedded are never re-embedded.
"""

from __future__ import annotations

from prefect import flow

from flows.pipeline import run_pipeline
from layertap.store.registry import dataset_settings


@flow(name="embed-dataset", flow_run_name="embed-dataset-{dataset}", log_prints=False)
def embed_dataset_flow(
    dataset: str, store: str | None = None, env_file: str | None = ".env", options: dict | None = None
) -> dict:
    """Embed the new rows of `dataset` in `store` (default: LAYERTAP_STORE, then ./layertap-store);
    `options` are run settings such as batch_size or engine options (default: from the environment)."""
    return run_pipeline(dataset_settings(dataset, store, env_file, options), dataset=dataset)
