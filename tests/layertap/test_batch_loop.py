"""The run's batch loop on its own, driven by plain thread-pool futures: no engine, no Prefect, no store."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from layertap.batch_loop import MAX_FAILURES_BEFORE_SUCCESS, BatchLoop
from layertap.errors import EngineError


class Handle:
    """A future the loop can only wait on through `Stages.concurrent`, as with Prefect's futures."""

    def __init__(self, future: Future):
        self.wrapped = future

    def result(self):
        return self.wrapped.result()


class Disk(Exception):
    """Stands for an error no batch can get past (a full disk)."""


class Stages:
    """Records what the loop asked for and when; extraction and checks run on a thread pool."""

    def __init__(self, pool, fail=(), fail_check=(), fatal=(), delay=lambda batch: 0.0, publish_delay=0.0,
                 fail_publish=(), check_delay=lambda batch: 0.0):
        self.pool, self.fail, self.fail_check, self.fatal = pool, set(fail), set(fail_check), set(fatal)
        self.fail_publish, self.check_delay = set(fail_publish), check_delay
        self.delay, self.publish_delay = delay, publish_delay
        self.events: list[tuple[str, object]] = []
        self.outstanding = self.most_outstanding = 0
        self.lock = threading.Lock()

    def _record(self, *event):
        with self.lock:
            self.events.append(event)

    def extract(self, batch):
        with self.lock:
            self.outstanding += 1
            self.most_outstanding = max(self.most_outstanding, self.outstanding)
        self._record("extract", batch["id"])

        def body():
            time.sleep(self.delay(batch))
            if batch["id"] in self.fatal:
                raise Disk("no space left on the store's disk")
            if batch["id"] in self.fail:
                raise RuntimeError(f"batch {batch['id']}\nfailed")
            return {"batch": batch["id"], "tokens": 10 * batch["n"]}

        return Handle(self.pool.submit(body))

    def extracted(self, batch, future):
        with self.lock:
            self.outstanding -= 1
        return future.result()

    def check(self, batch, part, first):
        self._record("check", batch["id"], first)

        def body():
            time.sleep(self.check_delay(batch))
            if batch["id"] in self.fail_check:
                raise ValueError(f"part {batch['id']} has NaN")
            self._record("checked", batch["id"])
        return Handle(self.pool.submit(body))

    def publish(self, ready):
        ids = tuple(batch["id"] for batch, _ in ready)
        self._record("publish", ids)

        def body():
            time.sleep(self.publish_delay)
            if set(ids) & self.fail_publish:
                raise OSError("the store's database is read-only")
            self._record("published", ids)
            return [{"published": batch["n"]} for batch, _ in ready]
        return Handle(self.pool.submit(body))

    def quarantine(self, batch, error):
        self._record("quarantine", batch["id"])
        return {"batch_id": batch["id"], "error": error}

    def concurrent(self, handle):
        return handle.wrapped

    def named(self, kind):
        return [event[1] for event in self.events if event[0] == kind]

    def published(self):
        return [batch for group in self.named("publish") for batch in group]


def planned(n: int) -> list[dict]:
    return [{"id": i, "n": 1 + i % 4} for i in range(n)]


@pytest.fixture
def pool():
    with ThreadPoolExecutor(max_workers=8) as executor:
        yield executor


def loop_for(stages, batches, in_flight=3, **kwargs):
    reports = []
    loop = BatchLoop(stages, batches, in_flight=in_flight, size=lambda batch: batch["n"],
                     progress=lambda done: reports.append((done.batches_done, done.prompts_done)), **kwargs)
    return loop, reports


def test_batches_finishing_out_of_order_are_published_in_order_with_at_most_n_in_flight(pool):
    rng = random.Random(7)
    delays = {i: rng.uniform(0, 0.03) for i in range(12)}
    stages = Stages(pool, delay=lambda batch: delays[batch["id"]])
    batches = planned(12)
    loop, reports = loop_for(stages, batches, in_flight=3)
    result = loop.run()
    assert stages.published() == list(range(12))
    assert stages.named("extract") == list(range(12))  # handed out in plan order
    assert stages.most_outstanding == 3
    assert [p.batch["id"] for p in result.published] == list(range(12))
    assert [p.result["published"] for p in result.published] == [b["n"] for b in batches]
    assert result.quarantined == [] and result.extracted == 12
    assert result.batches_done == 12 and result.prompts_done == sum(b["n"] for b in batches)
    assert reports[0] == (0, 0) and reports[-1] == (12, result.prompts_done)
    assert reports == sorted(reports)  # progress only goes forward
    firsts = [first for kind, *rest in stages.events if kind == "check" for first in rest[1:]]
    assert firsts == [True] + [False] * 11  # only the first extracted part gets the first-part checks


def test_a_freed_slot_takes_the_next_batch_before_the_finished_one_is_checked(pool):
    stages = Stages(pool)
    BatchLoop(stages, planned(4), in_flight=1, size=lambda batch: batch["n"]).run()
    position = {event[:2]: i for i, event in enumerate(stages.events) if event[0] != "publish"}
    for before, after in zip(range(4), range(1, 4)):
        assert position[("extract", after)] < position[("check", before)]
    assert stages.most_outstanding == 1


def test_parts_checked_while_the_loop_was_busy_are_published_in_one_call(pool):
    class Instant(Stages):
        def extract(self, batch):  # every extraction has finished by the time the loop looks
            handle = super().extract(batch)
            handle.wrapped.result()
            return handle

        def check(self, batch, part, first):
            handle = super().check(batch, part, first)
            handle.wrapped.exception()
            return handle

    stages = Instant(pool)
    BatchLoop(stages, planned(4), in_flight=4, size=lambda batch: batch["n"]).run()
    assert stages.named("publish") == [(0, 1, 2, 3)]


def test_a_freed_slot_is_refilled_while_a_publication_is_under_way(pool):
    stages = Stages(pool, publish_delay=0.3, delay=lambda batch: 0.05)
    result = BatchLoop(stages, planned(4), in_flight=1, size=lambda batch: batch["n"]).run()
    order = [event[:2] for event in stages.events]
    assert order.index(("extract", 2)) < order.index(("published", (0,)))  # submitted during batch 0's publication
    assert stages.published() == [0, 1, 2, 3] and result.batches_done == 4


def test_a_part_still_being_checked_does_not_hold_back_the_parts_before_it(pool):
    stages = Stages(pool, check_delay=lambda batch: {0: 0.05, 1: 0.3}.get(batch["id"], 0.0))
    BatchLoop(stages, planned(4), in_flight=1, size=lambda batch: batch["n"]).run()
    order = [event[:2] for event in stages.events]
    assert order.index(("published", (0,))) < order.index(("checked", 1))
    assert stages.published() == [0, 1, 2, 3]


def test_a_failed_publication_stops_the_run_with_its_error(pool):
    stages = Stages(pool, fail_publish={1}, delay=lambda batch: 0.02 * batch["id"])
    loop, _ = loop_for(stages, planned(6), in_flight=1)
    with pytest.raises(OSError, match="read-only"):
        loop.run()
    assert stages.named("published") == [(0,)] and loop.result.batches_done == 1


def test_a_failing_batch_is_set_aside_and_every_other_batch_published(pool):
    stages = Stages(pool, fail={2, 5})
    batches = planned(8)
    loop, reports = loop_for(stages, batches, in_flight=2)
    result = loop.run()
    assert stages.published() == [0, 1, 3, 4, 6, 7]
    assert [q["batch_id"] for q in result.quarantined] == [2, 5]
    assert result.quarantined[0]["error"] == "RuntimeError: batch 2 failed"  # one line
    assert result.batches_done == 8 and result.prompts_done == sum(b["n"] for b in batches)
    assert reports[-1] == (8, result.prompts_done)


def test_the_last_batch_failing_still_ends_the_progress(pool):
    stages = Stages(pool, fail={3}, delay=lambda batch: 0.05 if batch["id"] == 3 else 0.0)
    loop, reports = loop_for(stages, planned(4), in_flight=4)
    result = loop.run()
    assert reports[-1] == (4, result.prompts_done) == (4, sum(b["n"] for b in planned(4)))


def test_the_first_batches_all_failing_stop_the_run(pool):
    stages = Stages(pool, fail=set(range(10)))
    loop, _ = loop_for(stages, planned(10), in_flight=2)
    with pytest.raises(EngineError, match=r"the first 3 batches all failed; last error: RuntimeError: batch 2 failed"):
        loop.run()
    assert stages.named("quarantine") == [0, 1, 2] == list(range(MAX_FAILURES_BEFORE_SUCCESS))
    assert len(stages.named("extract")) < 10  # the rest was never handed out
    assert stages.named("publish") == []


def test_failures_after_a_success_do_not_stop_the_run(pool):
    stages = Stages(pool, fail=set(range(1, 8)))
    result = loop_for(stages, planned(8), in_flight=2, stop_after=2)[0].run()
    assert stages.published() == [0] and len(result.quarantined) == 7 and result.batches_done == 8


def test_an_error_of_a_fatal_kind_stops_at_once_without_setting_the_batch_aside(pool):
    stages = Stages(pool, fatal={1})
    loop, _ = loop_for(stages, planned(6), in_flight=1, fatal=(Disk,))
    with pytest.raises(Disk):
        loop.run()
    assert stages.named("quarantine") == [] and stages.named("extract") == [0, 1]


def test_a_part_failing_its_checks_stops_the_run_after_the_parts_before_it_are_published(pool):
    stages = Stages(pool, fail_check={2}, delay=lambda batch: 0.02 * batch["id"])
    loop, _ = loop_for(stages, planned(6), in_flight=2)
    with pytest.raises(ValueError, match="part 2 has NaN"):
        loop.run()
    assert stages.published() == [0, 1]
    assert loop.result.batches_done == 2


def test_nothing_planned_does_nothing(pool):
    stages = Stages(pool)
    loop, reports = loop_for(stages, [])
    result = loop.run()
    assert stages.events == [] and reports == [] and result.batches_done == 0


def test_at_least_one_batch_in_flight():
    with pytest.raises(ValueError):
        BatchLoop(Stages(None), planned(1), in_flight=0, size=lambda batch: batch["n"])
