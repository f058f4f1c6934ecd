"""The system nodes' CPU budget: allocatable by EKS's formula, the requests of what runs
there (checked against the pinned charts), and a Ray head sized to what is left, so that
with Karpenter and the CloudWatch add-on the RayJob's submitter still fits."""

from __future__ import annotations

import pytest

from ray_train_eks import capacity
from ray_train_eks.capacity import CPU_REQUESTS_M, allocatable_cpu_m, system_node_budget
from ray_train_eks.config import ConfigError, PlatformConfig
from upstream import chart_values


def milli(quantity: str) -> int:
    return int(quantity[:-1]) if quantity.endswith("m") else int(float(quantity) * 1000)


def test_allocatable_cpu_follows_eks_kube_reserved_by_hand():
    # 6% of core 1 + 1% of core 2 + 0.5% of cores 3-4 + 0.25% of the rest.
    assert allocatable_cpu_m(4) == 4000 - (60 + 10 + 10) == 3920
    assert allocatable_cpu_m(8) == 8000 - (60 + 10 + 10 + 10) == 7910
    assert allocatable_cpu_m(48) == 48000 - (60 + 10 + 10 + 110) == 47810
    assert allocatable_cpu_m(1) == 940


def test_requests_are_those_of_the_pinned_charts():
    cloudwatch = chart_values("amazon-cloudwatch-observability")
    assert milli(cloudwatch["agent"]["resources"]["requests"]["cpu"]) == CPU_REQUESTS_M["cloudwatch-agent"][0]
    assert milli(cloudwatch["containerLogs"]["fluentBit"]["resources"]["requests"]["cpu"]) == CPU_REQUESTS_M["fluent-bit"][0]
    assert milli(cloudwatch["manager"]["resources"]["requests"]["cpu"]) == CPU_REQUESTS_M["cloudwatch-observability-operator"][0]
    kuberay = chart_values("kuberay-operator")["resources"]
    # Limits only: Kubernetes then sets the requests to the limits.
    assert "requests" not in kuberay and milli(kuberay["limits"]["cpu"]) == CPU_REQUESTS_M["kuberay-operator"][0]


def test_default_head_keeps_half_the_node_and_karpenter_makes_it_one_cpu():
    default = PlatformConfig.from_context({}.get, environ={})
    karpenter = PlatformConfig.from_context({"gpuCapacity": "karpenter"}.get, environ={})
    assert default.workload_spec().head_resources == (2, 8)
    # 3920 - (50 + 100 + 10 + 250 + 50) per node - (200 + 100 + 100 + 1000 + 500) - 50 (the watch in the head's
    # pod) = 1510m: one CPU.
    assert karpenter.system_budget.head_room_m == 1510
    assert karpenter.workload_spec().head_resources == (1, 8)
    two_nodes = PlatformConfig.from_context({"gpuCapacity": "karpenter", "systemNodeCount": "2"}.get, environ={})
    assert two_nodes.workload_spec().head_resources == (2, 8)


@pytest.mark.parametrize("context", [{}, {"gpuCapacity": "karpenter"}, {"gpuCapacity": "karpenter", "observability": "false"},
                                     {"workload": "cluster", "shutdownAfterJobFinishes": "false", "ttlSecondsAfterFinished": "0"}])
def test_everything_fits_on_one_system_node(context):
    config = PlatformConfig.from_context(context.get, environ={})
    budget = config.system_budget
    head_cpu, _ = config.workload_spec().head_resources
    taken = sum(budget.per_node.values()) + sum(budget.once.values()) + sum(budget.beside_head.values()) + head_cpu * 1000
    assert taken <= allocatable_cpu_m(config.system_instance.vcpus)


def test_a_head_with_less_than_one_cpu_left_is_rejected_at_synth(monkeypatch):
    monkeypatch.setitem(CPU_REQUESTS_M, "karpenter", (2500, "a heavier controller"))
    with pytest.raises(ConfigError) as error:
        PlatformConfig.from_context({"gpuCapacity": "karpenter"}.get, environ={})
    (problem,) = error.value.problems
    assert problem.startswith("systemInstanceType='m7i.xlarge' x systemNodeCount=1: 10m CPU left for the Ray head, which "
                              "needs 1000m (1 x 3920m allocatable, requested before the head: aws-node (per node) 50m")
    assert problem.endswith("use -c systemInstanceType=m7i.2xlarge or -c systemNodeCount=2")
    assert capacity.MIN_HEAD_CPU_M == 1000


def test_budget_without_a_submitter_or_observability():
    budget = system_node_budget(vcpus=4, nodes=1, observability=False, karpenter_replicas=0, submitter=False)
    assert budget.head_room_m == 3920 - 150 - 300 and budget.head_cpu() == 2


@pytest.mark.synth
def test_synthesized_rayjob_and_karpenter_use_the_budgeted_sizes(karpenter_platform, default_platform):
    def head_cpu(platform) -> str:
        _, obj = platform.ray_job()
        head, watch = obj["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"]
        assert watch["resources"]["requests"]["cpu"] == f"{CPU_REQUESTS_M['stopped-job-watch'][0]}m"
        return head["resources"]["requests"]["cpu"]

    assert (head_cpu(default_platform), head_cpu(karpenter_platform)) == ("2", "1")
    values = karpenter_platform.stack.gpu_capacity.chart_values
    assert milli(values["controller"]["resources"]["requests"]["cpu"]) == CPU_REQUESTS_M["karpenter"][0]
    assert values["replicas"] == karpenter_platform.stack.config.karpenter_replicas == 1
