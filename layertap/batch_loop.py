"""The scheduler of a run's extraction phase: which batch goes next, how many are in flight, when a failed
batch is set aside and when the run stops instead.

It knows nothing of Prefect, the store or the engine: the stages a batch goes through (extract, check,
publish, quarantine) come from the caller as `Stages`, whose futures are `concurrent.futures` ones or
anything `Stages.concurrent` turns into one. So the flow wires its tasks in, and a test drives the loop
with plain thread-pool futures.

At most `in_flight` extractions run at once (each holds its vectors in host memory until written). The
loop waits for whichever comes first: the oldest extraction, the oldest part's checks, or the publication
under way. A finished extraction frees its slot for the next batch at once; its part's checks then run
beside it. The loop itself never blocks on a stage, so a slot is refilled as soon as it frees, while checks
and a publication are still running. Checked parts are published in batch order, one publication at a time,
each taking every part whose checks have passed by then: when publishing is slow the loop publishes fewer,
larger groups instead of falling behind.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Any, Protocol

from layertap.errors import EngineError

# A run whose first batches all fail has a broken engine or model, not bad batches: stop instead of
# quarantining everything.
MAX_FAILURES_BEFORE_SUCCESS = 3


class Stages(Protocol):
    """What the loop does to a batch; every future it returns has `.result()` (raising the stage's error)."""

    def extract(self, batch: Any) -> Any:
        """Start the batch's extraction; its future."""

    def extracted(self, batch: Any, future: Any) -> Any:
        """The finished extraction's part; raises when the batch failed (its retries spent)."""

    def check(self, batch: Any, part: Any, first: bool) -> Any:
        """Start the part's checks (`first`: the run's first extracted part); their future."""

    def publish(self, ready: list[tuple[Any, Any]]) -> Any:
        """Start publishing checked parts, in batch order, at once; its future, whose result has one entry
        for each."""

    def quarantine(self, batch: Any, error: str) -> Any:
        """Set a failed batch aside; the record the run reports."""

    def concurrent(self, future: Any) -> Future:
        """The `concurrent.futures.Future` to wait on for one of this object's futures."""


@dataclass
class Published:
    batch: Any
    part: Any
    result: Any


@dataclass
class LoopResult:
    """Every planned batch ends in `published` or `quarantined`, unless the loop raised."""

    published: list[Published] = field(default_factory=list)
    quarantined: list[Any] = field(default_factory=list)
    extracted: int = 0  # batches whose extraction succeeded (checked or not)
    prompts_done: int = 0

    @property
    def batches_done(self) -> int:
        return len(self.published) + len(self.quarantined)


class BatchLoop:
    """Runs `batches` through `stages`, `in_flight` extractions at a time.

    `size(batch)` is the batch's prompt count, for progress. `progress(result)` is called when extraction
    starts and after every batch that ends (quarantined or published). An extraction error of a `fatal`
    type stops the loop at once (the store's disk or the model, not the batch); any other sets the batch
    aside, unless the first `stop_after` batches all failed: then `EngineError`. A part that fails its
    checks raises once the parts before it are published; any error waits for the publication under way.
    """

    def __init__(
        self,
        stages: Stages,
        batches: Sequence[Any],
        *,
        in_flight: int,
        size: Callable[[Any], int],
        progress: Callable[[LoopResult], None] = lambda result: None,
        fatal: tuple[type[BaseException], ...] = (),
        stop_after: int = MAX_FAILURES_BEFORE_SUCCESS,
    ):
        if in_flight < 1:
            raise ValueError("in_flight must be at least 1")
        self.stages, self.batches, self.in_flight, self.size = stages, list(batches), in_flight, size
        self.progress, self.fatal, self.stop_after = progress, fatal, stop_after
        self.result = LoopResult()
        self._waiting: deque = deque(self.batches)
        self._extracting: deque = deque()  # (batch, future), in batch order
        self._checking: deque = deque()  # (batch, part, future), in batch order
        self._publishing: tuple[list, Any] | None = None  # ([(batch, part)], future) under way
        self._failed_check: BaseException | None = None  # raised once the publication before it is done

    def run(self) -> LoopResult:
        if self.batches:
            self.progress(self.result)  # extraction starts: a bar appears at 0
        try:
            self._fill()
            while self._extracting or self._checking or self._publishing:
                heads = [self._extracting[0][1]] if self._extracting else []
                if self._publishing:  # checks that end meanwhile wait for it: the next publication takes them
                    heads.append(self._publishing[1])
                elif self._checking:
                    heads.append(self._checking[0][2])
                wait([self.stages.concurrent(future) for future in heads], return_when=FIRST_COMPLETED)
                while self._extracting and self._done(self._extracting[0][1]):
                    self._take(*self._extracting.popleft())
                if self._publishing and self._done(self._publishing[1]):
                    self._published()
                if not self._publishing and self._checking and self._done(self._checking[0][2]):
                    self._publish_checked()
        except BaseException:
            if self._publishing is not None:  # the store is left as that publication leaves it
                wait([self.stages.concurrent(self._publishing[1])])
            raise
        return self.result

    def _done(self, future: Any) -> bool:
        return self.stages.concurrent(future).done()

    def _fill(self) -> None:
        if self._failed_check is not None:
            return  # the run stops once the parts before that one are published
        while self._waiting and len(self._extracting) < self.in_flight:
            batch = self._waiting.popleft()
            self._extracting.append((batch, self.stages.extract(batch)))

    def _take(self, batch: Any, future: Any) -> None:
        result = self.result
        try:
            part = self.stages.extracted(batch, future)
        except self.fatal:
            raise  # every later batch would fail the same way
        except Exception as exc:  # noqa: BLE001 - retries are spent: set the batch aside, go on
            error = " ".join(f"{type(exc).__name__}: {exc}".split())
            self._settle_publication()  # the store takes one write at a time from this loop
            result.quarantined.append(self.stages.quarantine(batch, error))
            result.prompts_done += self.size(batch)
            self.progress(result)  # the last batch to finish may be this one: the bar must still end
            if not result.extracted and len(result.quarantined) >= self.stop_after:
                raise EngineError(f"the first {len(result.quarantined)} batches all failed; last error: {error}") from None
            self._fill()
            return
        self._fill()
        if self._failed_check is None:  # else the run stops before this part could be published
            self._checking.append((batch, part, self.stages.check(batch, part, result.extracted == 0)))
        result.extracted += 1

    def _publish_checked(self) -> None:
        """Start publishing every part whose checks have passed, in batch order, up to the first whose checks
        have not ended or failed; a failure is raised once the parts before it are published."""
        ready = []
        while self._checking and self._done(self._checking[0][2]):
            batch, part, checked = self._checking.popleft()
            try:
                checked.result()
            except Exception as exc:  # noqa: BLE001 - raised once the parts before it are published
                self._failed_check = exc
                self._checking.clear()
                break
            ready.append((batch, part))
        if ready:
            self._publishing = (ready, self.stages.publish(ready))
        elif self._failed_check is not None:
            raise self._failed_check

    def _published(self) -> None:
        """Record the publication under way, now ended (raising its error); then a failed check's error."""
        ready, future = self._publishing
        self._publishing = None
        for (batch, part), published in zip(ready, future.result(), strict=True):
            self.result.published.append(Published(batch, part, published))
            self.result.prompts_done += self.size(batch)
        self.progress(self.result)
        if self._failed_check is not None:
            raise self._failed_check

    def _settle_publication(self) -> None:
        """Wait for the publication under way, if any, and record it."""
        if self._publishing is not None:
            wait([self.stages.concurrent(self._publishing[1])])
            self._published()
