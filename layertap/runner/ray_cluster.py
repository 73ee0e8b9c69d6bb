"""The Ray cluster the `ray` executor runs its engines on: joining it (or starting a local one), and
planning how many engines it holds and what each asks it for, before the run writes anything."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from layertap.errors import EngineError, InputError

# Environment the actors get from the flow's process: layertap's and vLLM's settings, where code and
# models are found.
FORWARDED_ENV_PREFIXES = ("LAYERTAP_", "VLLM_", "HF_")
FORWARDED_ENV = ("PYTHONPATH", "TRANSFORMERS_OFFLINE")


def ray_module():
    try:
        import ray
    except ImportError:
        raise InputError("executor: ray needs the ray extra (pip install 'layertap[ray]')") from None
    return ray


def cluster_address(settings) -> str:
    """The cluster to use: the setting, else RAY_ADDRESS, else "local" (a cluster of this machine started for
    the run; Ray would otherwise join a cluster `ray start` left running here)."""
    return settings.ray_address or os.environ.get("RAY_ADDRESS") or "local"


def forwarded_env() -> dict[str, str]:
    """The variables the actors are given (a cluster's workers do not inherit the flow's environment)."""
    return {name: value for name, value in os.environ.items()
            if name.startswith(FORWARDED_ENV_PREFIXES) or name in FORWARDED_ENV}


def connect(settings) -> str:
    """Join the settings' cluster (or start a local one) unless this process already has; returns its address."""
    ray = ray_module()
    address = cluster_address(settings)
    if not ray.is_initialized():
        try:
            ray.init(address=address, runtime_env={"env_vars": forwarded_env()}, log_to_driver=False,
                     include_dashboard=False, logging_level=logging.WARNING)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise EngineError(f"ray: cannot reach the cluster at {address}: {' '.join(str(exc).split())}") from None
    return address


def disconnect() -> None:
    """Leave the cluster (a local cluster started by this process stops)."""
    ray = ray_module()
    if ray.is_initialized():
        ray.shutdown()


@dataclass(frozen=True)
class EnginePlan:
    """How many engines, and what each asks the cluster for."""

    engines: int
    num_cpus: int
    num_gpus: int
    cluster: str  # what the cluster holds, for messages

    def describe(self) -> str:
        share = f"{self.num_gpus} GPU{'s' * (self.num_gpus > 1)} and " if self.num_gpus else ""
        return f"{self.engines} engine{'s' * (self.engines != 1)} of {share}{self.num_cpus} CPU{'s' * (self.num_cpus > 1)}"


def alive_nodes(ray) -> list[dict[str, float]]:
    return [node.get("Resources", {}) for node in ray.nodes() if node.get("Alive")]


def plan_engines(settings, nodes: list[dict[str, float]], on_gpu: bool, address: str) -> EnginePlan:
    """Engines for a cluster whose alive nodes hold `nodes` (Ray resources each); raises InputError, one
    line, when the engines asked for cannot all be placed.

    On GPUs each engine takes `tensor_parallel_size` GPUs of one node and that node's CPUs in proportion;
    "auto" is as many as the nodes' GPUs hold. On CPUs, "auto" is one engine per node, each taking the CPUs
    of the smallest node; a number of engines share the cluster's CPUs evenly (at least one each).
    """
    cpus = [int(node.get("CPU", 0)) for node in nodes]
    gpus = [int(node.get("GPU", 0)) for node in nodes]
    wanted = settings.engine_count()
    tp = settings.tensor_parallel_size
    where = f"the Ray cluster at {address}"
    if on_gpu:
        held = f"{sum(gpus)} GPUs on {len(nodes)} node{'s' * (len(nodes) != 1)}"
        fits = sum(g // tp for g in gpus)
        gpu_nodes = [(c, g) for c, g in zip(cpus, gpus) if g >= tp]
        share = max(1, min((c * tp // g for c, g in gpu_nodes), default=1))
        plan = EnginePlan(wanted or fits, share, tp, held)
        per_node = [min(g // tp, c // share) for c, g in zip(cpus, gpus)]
        if plan.engines == 0 or sum(per_node) < plan.engines:
            raise InputError(
                f"engines: {plan.describe()} (tensor_parallel_size {tp}) do not fit {where}, which holds {held}"
                f" (at most {sum(per_node)})")
        return plan
    held = f"{sum(cpus)} CPUs on {len(nodes)} node{'s' * (len(nodes) != 1)}"
    cpu_nodes = [c for c in cpus if c > 0]
    if wanted is None:
        share = max(1, min(cpu_nodes, default=1))
        plan = EnginePlan(sum(c // share for c in cpu_nodes), share, 0, held)
    else:
        plan = EnginePlan(wanted, max(1, sum(cpus) // wanted), 0, held)
    fits = sum(c // plan.num_cpus for c in cpus)
    if plan.engines == 0 or fits < plan.engines:
        raise InputError(f"engines: {plan.describe()} do not fit {where}, which holds {held} (at most {fits})")
    return plan


def on_gpu_cluster() -> bool:
    from layertap.runner.vllm_seam import vllm_is_cpu_build

    return not vllm_is_cpu_build()


def check_cluster(settings) -> EnginePlan:
    """Join the cluster and check that the engines asked for fit it, before the run writes anything."""
    address = connect(settings)
    return plan_engines(settings, alive_nodes(ray_module()), on_gpu_cluster(), address)

