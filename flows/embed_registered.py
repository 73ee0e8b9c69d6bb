"""The `embed-registered` flow: embed whatever is new in every dataset registered in a store.

The nightly schedule runs it, as a safety net for rows whose event was missed. Each dataset is its own
sub-run (with its own artifacts); one failing dataset does not stop the others, but fails this run.
"""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact

from flows.embed_dataset import embed_dataset_flow
from layertap.runner import engine_cache
from layertap.store.registry import Registry
from layertap.settings import load_settings


@flow(name="embed-registered", log_prints=False)
def embed_registered_flow(store: str | None = None, env_file: str | None = ".env") -> dict:
    """Run `embed-dataset` for each registered dataset; returns {dataset: summary or error}."""
    logger = get_run_logger()
    root = load_settings(env_file=env_file, store=store).store_path()
    names = Registry(root).names()
    logger.info("embed-registered: %d datasets in %s: %s", len(names), root, ", ".join(names) or "none")
    results: dict[str, dict] = {}
    failed = []
    with engine_cache.pin():  # datasets with the same model share one engine
        for name in names:
            state = embed_dataset_flow(name, str(root), env_file, return_state=True)
            if state.is_completed():
                results[name] = state.result()
            else:
                failed.append(name)
                results[name] = {"error": str(state.message or state.name)}
    create_table_artifact(
        [
            {"dataset": name, "status": "failed" if "error" in r else "ok", "new rows": r.get("new_rows", 0),
             "embedded": r.get("embedded", 0), "skipped": r.get("skipped", 0), "error": r.get("error", "")}
            for name, r in results.items()
        ],
        key="layertap-registered",
        description=f"New rows embedded per dataset in {root}",
    )
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(names)} datasets failed: {', '.join(failed)}")
    return results
