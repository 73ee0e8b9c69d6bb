"""Engines as actors of a Ray cluster: the `ray` executor (`pip install 'layertap[ray]'`).

The flow stays where it is: it plans, checks, publishes and is the only process that opens the store's
database or holds its lock. Each engine is a Ray actor that owns one runner, built exactly as on one machine
(`engine_cache.get_runner` in the actor's process), and runs the same batch body as the local executor
(`layertap.batch.run_batch`): the flow sends a batch's texts, the actor extracts, checks the values and
writes the part's files into the store's folder (a filesystem mounted at the same path on every node), and
only the part's metadata comes back. Part files are named by the batch's content plus the Prefect attempt,
so a late attempt can never overwrite a file an earlier one wrote and the flow checked.

Ray's own retries are off (`max_task_retries=0`: no actor call is ever run twice by Ray): a failed batch
fails its Prefect task, and the task's retry runs on an engine that is up. A dead actor is restarted by Ray
(at most `ACTOR_MAX_RESTARTS` times), a batch that outlives `batch_timeout` kills its actor (which then
restarts), and out-of-memory halving happens inside the actor. The actors belong to the flow's process (not
detached): when it exits or dies, Ray ends them, and a local cluster started for the run ends with it.

Each engine asks Ray for `tensor_parallel_size` GPUs (tensor parallelism stays within one node) and its
node's CPUs in proportion, or on a CPU cluster for an even share of the cluster's CPUs; the Parquet writers
in the actor use as many threads as it has CPUs.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from layertap import faults
from layertap.errors import EngineError
from layertap.runner.ray_cluster import alive_nodes, connect, disconnect, on_gpu_cluster, plan_engines, ray_module

log = logging.getLogger(__name__)

# Restarts Ray gives each engine actor after it died (engine crash, out of host memory, a batch that kills
# it): enough for a few bad batches, not for an engine that cannot start at all.
ACTOR_MAX_RESTARTS = 3
# How long engines may take to be placed on the cluster and start their vLLM engine.
READY_TIMEOUT_S = 900.0


def expected_identity(settings) -> dict[str, str]:
    """What every engine must report: the flow's layertap code and vLLM version, and the model's fingerprint."""
    from layertap.model.fingerprint import fingerprint_model
    from layertap.runner.warm_engine import installed_version, layertap_code

    return {"layertap_code": layertap_code(), "vllm_version": installed_version("vllm"),
            "fingerprint": fingerprint_model(settings.model)}


def engine_settings(settings):
    """The settings an actor builds its engine from: the run's, for an engine of the actor's own process."""
    return settings.model_copy(update={"executor": "local", "warm_engine": False})


class EngineActor:
    """One engine on the cluster (run as a Ray actor): the runner for `settings` in this process, and the
    batch body on it."""

    def __init__(self, settings, num_cpus: int, index: int):
        from layertap.runner.engine_cache import get_runner
        from layertap.parts.writer import limit_encoder_threads

        limit_encoder_threads(num_cpus)  # Parquet encoders on the actor's share of the node's cores
        self.settings, self.index, self.num_cpus = settings, index, num_cpus
        self.runner = get_runner(settings)

    def ready(self) -> dict[str, Any]:
        """Where this engine runs and what it serves."""
        import ray

        report = expected_identity(self.settings)
        report.update(
            host=socket.gethostname(), pid=os.getpid(), node=ray.get_runtime_context().get_node_id(),
            devices=",".join(str(g) for g in ray.get_gpu_ids()) or "cpu", cpus=self.num_cpus,
            num_layers=self.runner.num_layers, hidden_size=self.runner.hidden_size,
        )
        return report

    def run_batch(self, store: str, batch, hashes: list[str], texts: list[str], run,
                  attempt: int | None, fault_spec: str | None = None):
        """The batch body on this actor's engine, with the prepared run (pooling, truncation, part size) and
        fault points (`faults.follow`); returns its `Part`."""
        from dataclasses import replace

        from layertap.batch import run_batch

        faults.follow(fault_spec)
        part = run_batch(store, batch, hashes, texts, replace(run, settings=engine_settings(run.settings)), attempt)
        return replace(part, engine=f"{self.index}@{socket.gethostname()}:{os.getpid()}")

    def reference(self, texts: list[str], layers: list[int], pooling: str, trust_remote_code: bool) -> dict:
        """Hugging Face's vectors for the parity sample, computed here so the flow never loads torch."""
        from layertap.runner.engine_cache import get_runner

        return get_runner(self.settings).reference(texts, layers, pooling, trust_remote_code)

    def activity(self):
        from layertap.runner.engine_cache import engine_activity

        return engine_activity(self.settings)


@dataclass
class _Engine:
    index: int
    handle: Any
    report: dict | None = None
    probe: Any = None  # a pending `ready` call: the engine is starting or restarting
    in_flight: int = 0
    done: int = 0
    deaths: int = 0
    dead: bool = False
    gone_pid: int | None = None  # the process of the instance that went down: its answers do not count

    def name(self) -> str:
        where = f" on {self.report['host']}" if isinstance(self.report, dict) else ""
        return f"{self.index}{where}"


class RayEngines:
    """The run's engines on a Ray cluster, used through `engine_cache` like one local runner."""

    def __init__(self, settings, ready_timeout: float = READY_TIMEOUT_S):
        ray = ray_module()
        self.settings = settings
        self.ready_timeout = ready_timeout
        self.address = connect(settings)
        self.plan = plan_engines(settings, alive_nodes(ray), on_gpu_cluster(), self.address)
        self.expected = expected_identity(settings)
        self._lock = threading.Lock()
        self._closed = False
        actor_settings = engine_settings(settings)
        actor = ray.remote(EngineActor).options(
            num_cpus=self.plan.num_cpus, num_gpus=self.plan.num_gpus, max_restarts=ACTOR_MAX_RESTARTS,
            max_task_retries=0, max_concurrency=settings.batches_in_flight + 4,
        )
        self.engines = [_Engine(i, actor.remote(actor_settings, self.plan.num_cpus, i))
                        for i in range(self.plan.engines)]
        log.info("ray: starting %s on %s", self.plan.describe(), self.address)
        try:
            for engine in self.engines:
                engine.probe = engine.handle.ready.remote()
            ray.wait([e.probe for e in self.engines], num_returns=len(self.engines), timeout=ready_timeout)
            for engine in self.engines:
                self._settle(engine, wait=False)
                if engine.probe is not None:
                    raise EngineError(
                        f"ray: engine {engine.index} was not up within {ready_timeout:.0f}s on {self.address} "
                        f"(it asks for {self.plan.describe().split(' of ', 1)[1]}; the cluster holds {self.plan.cluster})")
                if engine.dead:
                    raise EngineError(f"ray: engine {engine.index} could not start: {engine.report}")
        except BaseException:
            self.close()
            raise
        self.hidden_size = self.engines[0].report["hidden_size"]
        self.num_layers = self.engines[0].report["num_layers"]
        log.info("ray: %d engines up: %s", len(self.engines),
                 ", ".join(f"{e.index} on {e.report['host']} (pid {e.report['pid']}, {e.report['devices']})"
                           for e in self.engines))

    # --- engines' states ----------------------------------------------------------------------------
    def _settle(self, engine: _Engine, wait: bool) -> None:
        """Take a finished `ready` probe's answer: the engine is up (if it serves what the flow expects), or
        dead for good (its restarts spent, or it cannot start)."""
        ray = ray_module()
        while True:
            if engine.probe is None or engine.dead:
                return
            done, _ = ray.wait([engine.probe], timeout=None if wait else 0)
            if not done:
                return
            try:
                report = ray.get(engine.probe)
            except ray.exceptions.ActorUnavailableError:
                report = None  # still restarting
            except ray.exceptions.RayActorError as exc:
                engine.dead, engine.probe, engine.report = True, None, _cause_text(exc)
                log.warning("ray: engine %d is gone: %s", engine.index, engine.report)
                return
            # An answer from the instance that went down does not count either: an actor serves calls
            # beside a hung batch, so a probe sent as it is killed can reach it before the kill lands.
            if report is not None and report.get("pid") != engine.gone_pid:
                break
            engine.probe = engine.handle.ready.remote()  # ask again
            if not wait:
                return
            time.sleep(0.5)
        engine.probe = None
        wrong = {name: (report.get(name), want) for name, want in self.expected.items() if report.get(name) != want}
        if wrong:
            ray.kill(engine.handle, no_restart=True)
            engine.dead, engine.report = True, report
            raise EngineError(
                f"ray: engine {engine.index} on {report.get('host')} serves "
                + ", ".join(f"{name} {got} where this flow has {want}" for name, (got, want) in wrong.items())
                + ": refusing it")
        engine.report = report

    def _restarting(self, engine: _Engine) -> None:
        """The engine died (or was killed): Ray restarts it; it takes batches again once it answers."""
        with self._lock:
            engine.deaths += 1
            engine.gone_pid = engine.report.get("pid") if isinstance(engine.report, dict) else None
            if not engine.dead and engine.probe is None:
                engine.probe = engine.handle.ready.remote()
                log.warning("ray: engine %s went down (%d time%s); Ray restarts it at most %d times",
                            engine.name(), engine.deaths, "s" * (engine.deaths > 1), ACTOR_MAX_RESTARTS)

    def _pick(self) -> _Engine:
        """The engine that is up with the fewest batches in flight; waits (bounded) while all restart."""
        ray = ray_module()
        deadline = time.monotonic() + self.ready_timeout
        while True:
            with self._lock:
                if self._closed:
                    raise EngineError("ray: the run's engines were closed")
                for engine in self.engines:
                    self._settle(engine, wait=False)
                up = [e for e in self.engines if not e.dead and e.probe is None]
                if up:
                    engine = min(up, key=lambda e: (e.in_flight, e.done, e.index))
                    engine.in_flight += 1
                    return engine
                waiting = [e.probe for e in self.engines if not e.dead and e.probe is not None]
            if not waiting:
                raise EngineError(f"ray: every engine died ({len(self.engines)} engines, "
                                  f"{ACTOR_MAX_RESTARTS} restarts each)")
            if time.monotonic() > deadline:
                raise EngineError(f"ray: no engine came back up within {self.ready_timeout:.0f}s")
            ray.wait(waiting, num_returns=1, timeout=min(5.0, max(0.1, deadline - time.monotonic())))

    # --- what the flow calls ------------------------------------------------------------------------------
    def run_batch(self, store: str, batch, hashes: list[str], texts: list[str], run, attempt: int | None = None):
        """Run the batch body (a `WorkBatch` of the `PreparedRun`) on an engine that is up; returns its `Part`.
        A dead or hung engine fails the batch (for Prefect to retry elsewhere) and is restarted by Ray."""
        settings = run.settings
        ray = ray_module()
        engine = self._pick()
        try:
            call = engine.handle.run_batch.options(max_task_retries=0)
            ref = call.remote(store, batch, hashes, texts, run, attempt, faults.active())
            try:
                part = ray.get(ref, timeout=settings.batch_timeout)
            except ray.exceptions.GetTimeoutError:
                ray.kill(engine.handle, no_restart=False)
                self._restarting(engine)
                raise EngineError(
                    f"batch {batch.batch_id} ran over {settings.batch_timeout:.0f}s on engine "
                    f"{engine.name()}: taken as hung, the engine is restarted") from None
            except ray.exceptions.RayTaskError as exc:
                raise _original(exc) from None
            except ray.exceptions.RayActorError as exc:
                self._restarting(engine)
                raise EngineError(f"engine {engine.name()} died during batch {batch.batch_id}: "
                                  f"{_cause_text(exc)}") from None
        finally:
            with self._lock:
                engine.in_flight -= 1
        with self._lock:
            engine.done += 1
        return part

    def batches_done(self) -> dict[str, int]:
        """Batches each engine finished in this pool's life, by engine index."""
        with self._lock:
            return {str(e.index): e.done for e in self.engines}

    def reference(self, texts, layers, pooling, trust_remote_code):
        """The parity sample's Hugging Face vectors, computed on an engine's node (on another one if the engine
        dies meanwhile: the check has no retries of its own)."""
        ray = ray_module()
        for _ in range(len(self.engines) * (ACTOR_MAX_RESTARTS + 1)):
            engine = self._pick()
            try:
                return ray.get(engine.handle.reference.remote(texts, list(layers), pooling, trust_remote_code))
            except ray.exceptions.RayTaskError as exc:
                raise _original(exc) from None
            except ray.exceptions.RayActorError:
                self._restarting(engine)
            finally:
                with self._lock:
                    engine.in_flight -= 1
        raise EngineError("ray: every engine died while computing the parity sample's reference")

    def activity(self):
        """The engines' `EngineActivity` added up (engines that are down count nothing)."""
        from layertap.runner.base import EngineActivity

        ray = ray_module()
        total = EngineActivity()
        refs = [e.handle.activity.remote() for e in self.engines if not e.dead and e.probe is None]
        for ref in refs:
            try:
                one = ray.get(ref, timeout=30)
            except Exception:  # noqa: BLE001 - an engine that died has nothing to report
                continue
            if one is not None:
                total = EngineActivity(total.steps + one.steps, total.stepping_s + one.stepping_s,
                                       total.idle_s + one.idle_s, total.in_engine + one.in_engine)
        return total

    def healthy(self) -> bool:
        with self._lock:
            return not self._closed and any(not e.dead for e in self.engines)

    def actor_pids(self) -> list[int]:
        """The engines' process ids as they last reported them."""
        with self._lock:
            return [e.report["pid"] for e in self.engines if isinstance(e.report, dict)]

    def close(self) -> None:
        """Stop the engines; leave the cluster (a local one stops with it)."""
        ray = ray_module()
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for engine in self.engines:
            try:
                ray.kill(engine.handle, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        disconnect()


def _cause_text(exc: BaseException) -> str:
    """Why an actor call failed, in one line: the batch's own error, or why the actor died."""
    cause = getattr(exc, "cause", None)
    return " ".join(str(cause if isinstance(cause, BaseException) else exc).split())[:500]


def _original(exc: BaseException) -> BaseException:
    """The exception a batch raised inside an actor, without Ray's wrapping (a full store disk stays
    `StoreUnwritable`, so it is not retried)."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else EngineError(_cause_text(exc))
