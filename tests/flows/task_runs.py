"""What the Prefect server recorded of a flow run's tasks, for the flow tests that count retries."""

from __future__ import annotations


def extract_run_counts(flow_run_id) -> list[int]:
    """The run count of each of the flow run's extract-batch task runs, sorted."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return sorted(r.run_count for r in runs if r.name.startswith("extract-batch"))
