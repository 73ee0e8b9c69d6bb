"""`layertap serve` builds its deployments from prefect.yaml, so both ways of running agree."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_serve_builds_the_prefect_yaml_deployments():
    from flows.serve import deployments_from_prefect_file
    from layertap.events import ROWS_ADDED

    found = {d.name: d for d in deployments_from_prefect_file(ROOT / "prefect.yaml")}
    assert set(found) == {"embed", "embed-new-rows", "embed-nightly"}
    assert {name: d.flow_name for name, d in found.items()} == {
        "embed": "embed", "embed-new-rows": "embed-dataset", "embed-nightly": "embed-registered"}
    (trigger,) = found["embed-new-rows"].triggers
    assert trigger.expect == {ROWS_ADDED} and trigger.parameters == {
        "dataset": "{{ event.payload.dataset }}", "store": "{{ event.payload.store }}"}
    (schedule,) = found["embed-nightly"].schedules
    assert schedule.schedule.cron == "0 2 * * *"
    assert all(d.concurrency_limit == 1 for d in found.values())
