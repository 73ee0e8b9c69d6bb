"""The rows-added event: how any producer tells layertap that a dataset has new rows.

`layertap add` emits it; so can anything else that can reach the Prefect API (see the README). The
`embed-new-rows` deployment's trigger matches it and runs `embed-dataset` for that dataset only.
"""

from __future__ import annotations

ROWS_ADDED = "layertap.dataset.rows-added"
RESOURCE_PREFIX = "layertap.dataset."


def resource(dataset: str, store: str) -> dict[str, str]:
    """The event's resource: one per dataset and store, so triggers can match one dataset or all."""
    return {
        "prefect.resource.id": f"{RESOURCE_PREFIX}{dataset}",
        "prefect.resource.name": dataset,
        "layertap.store": store,
    }


def payload(dataset: str, store: str, files: list[str]) -> dict:
    """What the trigger reads: `dataset` and `store` become the flow run's parameters; `files` (absolute
    paths) are for people reading the event feed."""
    return {"dataset": dataset, "store": store, "files": list(files)}
