"""The instance table and the cost estimate built on it."""

from __future__ import annotations

import pytest

from ray_train_eks.instances import INSTANCE_TYPES, estimate_cost, gpu_efa_instance_types
from upstream import chart_values


def test_default_cost_adds_instances_control_plane_and_nat():
    cost = estimate_cost(gpu_instance_type="g6.12xlarge", gpu_node_count=2, system_instance_type="m7i.xlarge", system_node_count=1)
    # 2 x 4.6016 + 0.2016 + 0.10 + 0.045, by hand
    assert cost.total_usd == pytest.approx(9.5498)
    assert cost.describe().startswith(
        "9.55 USD/hour on demand while a job runs = GPU nodes 9.20 + system nodes 0.20 + EKS control plane 0.10 + NAT gateway 0.045; "
        "idle 9.55 (the GPU node group stays up"
    )
    assert cost.idle_usd == cost.total_usd


def test_on_demand_gpus_cost_nothing_idle():
    cost = estimate_cost(gpu_instance_type="g6.12xlarge", gpu_node_count=2, system_instance_type="m7i.xlarge", system_node_count=1,
                         gpu_on_demand=True)
    assert cost.total_usd == pytest.approx(9.5498)
    # 0.2016 + 0.10 + 0.045: the system node, the control plane and the NAT gateway stay.
    assert cost.idle_usd == pytest.approx(0.3466)
    assert "; idle 0.35 (Karpenter removes the GPU nodes when no job runs)" in cost.describe()


def test_serving_costs_nothing_idle_and_its_own_gpu_nodes_while_it_answers():
    common = dict(gpu_instance_type="g6.12xlarge", gpu_node_count=2, system_instance_type="m7i.xlarge", system_node_count=1)
    # Karpenter: the serving NodePool's nodes of their own, up to 2 x 4.6016 while answering, gone when idle.
    karpenter = estimate_cost(**common, gpu_on_demand=True, serving_gpu_nodes=2, serving_idle_minutes=15)
    assert karpenter.serving_usd == pytest.approx(9.2032)
    assert karpenter.idle_usd == pytest.approx(0.3466) and karpenter.total_usd == pytest.approx(9.5498)
    assert ("; serving: 0.00 idle (a service's head runs on the system nodes; its GPU nodes go 15 min after the last "
            "request), up to 9.20 more while served models answer (2 GPU node(s) at 4.60)") in karpenter.describe()
    # The node group: replicas take its nodes, nothing more (a job waits for them).
    node_group = estimate_cost(**common, serving_gpu_nodes=1)
    assert node_group.serving_usd == 0.0 and "; serving: nothing more, idle or answering" in node_group.describe()
    assert "serving" not in estimate_cost(**common, gpu_on_demand=True).describe()


def test_the_deploy_says_what_serving_adds_beside_the_idle_and_running_figures(karpenter_platform, default_platform):
    outputs = karpenter_platform.template["Outputs"]
    serving = outputs["EstimatedServingCostUsdPerHour"]
    assert serving["Value"] == f"{karpenter_platform.stack.cost.serving_usd:.2f}" == "4.60"  # servingGpuNodes=1 g6.12xlarge
    assert "a service's head runs on the system nodes" in outputs["EstimatedIdleCostUsdPerHour"]["Description"]
    assert "EstimatedServingCostUsdPerHour" not in default_platform.template["Outputs"]  # the node group's nodes: nothing more


def test_efa_interfaces_follow_network_cards():
    assert INSTANCE_TYPES["g6.12xlarge"].efa_interfaces == 1
    assert (INSTANCE_TYPES["p4d.24xlarge"].gpus, INSTANCE_TYPES["p4d.24xlarge"].efa_interfaces) == (8, 4)
    assert INSTANCE_TYPES["g6.xlarge"].efa_interfaces == 0


def test_every_efa_gpu_type_is_in_the_efa_plugin_charts_allowlist():
    values = chart_values("aws-efa-k8s-device-plugin")
    allowlist = set(values["supportedInstanceLabels"]["values"])
    assert set(gpu_efa_instance_types()) - allowlist == set()
