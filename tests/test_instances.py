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


def test_efa_interfaces_follow_network_cards():
    assert INSTANCE_TYPES["g6.12xlarge"].efa_interfaces == 1
    assert (INSTANCE_TYPES["p4d.24xlarge"].gpus, INSTANCE_TYPES["p4d.24xlarge"].efa_interfaces) == (8, 4)
    assert INSTANCE_TYPES["g6.xlarge"].efa_interfaces == 0


def test_every_efa_gpu_type_is_in_the_efa_plugin_charts_allowlist():
    values = chart_values("aws-efa-k8s-device-plugin")
    allowlist = set(values["supportedInstanceLabels"]["values"])
    assert set(gpu_efa_instance_types()) - allowlist == set()
