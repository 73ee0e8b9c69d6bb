"""How many engines a Ray cluster holds and what each asks for, from the resources its nodes report."""

from __future__ import annotations

import pytest

from layertap.errors import InputError
from layertap.runner.ray_cluster import EnginePlan, cluster_address, plan_engines
from layertap.settings import load_settings


def plan(nodes, on_gpu, **settings):
    return plan_engines(load_settings(env_file=None, executor="ray", **settings), nodes, on_gpu, "head:6379")


def test_auto_on_gpus_is_the_gpus_over_the_tensor_parallel_size():
    nodes = [{"CPU": 32.0, "GPU": 8.0}, {"CPU": 32.0, "GPU": 8.0}]
    assert plan(nodes, True) == EnginePlan(16, 4, 1, "16 GPUs on 2 nodes")
    assert plan(nodes, True, tensor_parallel_size=2) == EnginePlan(8, 8, 2, "16 GPUs on 2 nodes")
    # Tensor parallelism stays within a node: three 3-GPU nodes hold three engines of 2, not four.
    assert plan([{"CPU": 12.0, "GPU": 3.0}] * 3, True, tensor_parallel_size=2).engines == 3


def test_auto_on_cpus_is_one_engine_per_node():
    assert plan([{"CPU": 2.0}], False) == EnginePlan(1, 2, 0, "2 CPUs on 1 node")
    assert plan([{"CPU": 16.0}, {"CPU": 16.0}], False) == EnginePlan(2, 16, 0, "32 CPUs on 2 nodes")


def test_a_number_of_engines_shares_the_cpus():
    assert plan([{"CPU": 2.0}], False, engines=2) == EnginePlan(2, 1, 0, "2 CPUs on 1 node")


@pytest.mark.parametrize(("nodes", "on_gpu", "settings", "expected"), [
    ([{"CPU": 2.0}], False, {"engines": 3},
     "engines: 3 engines of 1 CPU do not fit the Ray cluster at head:6379, which holds 2 CPUs on 1 node (at most 2)"),
    ([{"CPU": 8.0, "GPU": 2.0}], True, {"engines": 2, "tensor_parallel_size": 2},
     "engines: 2 engines of 2 GPUs and 8 CPUs (tensor_parallel_size 2) do not fit the Ray cluster at head:6379, "
     "which holds 2 GPUs on 1 node (at most 1)"),
    ([{"CPU": 8.0}], True, {},
     "engines: 0 engines of 1 GPU and 1 CPU (tensor_parallel_size 1) do not fit"),
])
def test_more_engines_than_the_cluster_holds_is_one_line(nodes, on_gpu, settings, expected):
    with pytest.raises(InputError) as info:
        plan(nodes, on_gpu, **settings)
    assert str(info.value).startswith(expected) and "\n" not in str(info.value)


def test_the_address_is_the_setting_then_ray_address_then_a_local_cluster(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert cluster_address(load_settings(env_file=None)) == "local"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert cluster_address(load_settings(env_file=None)) == "10.0.0.1:6379"
    assert cluster_address(load_settings(env_file=None, ray_address="head:6379")) == "head:6379"
