"""Spot GPUs with graceful preemption, in the template, per event: the GPU worker pods drain
their Ray node from a preStop hook, with a deadline inside the two minutes EC2 gives on Spot
and the rest of their grace period on-demand; no pod blocks Karpenter's drain
(``do-not-disrupt``), the NodePool's budgets keep drift and consolidation off running nodes and
bring an on-demand fallback back to Spot; the node group and the NodePool take Spot when asked;
the account checks read Spot's quota; the cost says so."""

from __future__ import annotations

import json

import pytest

from ray_train_eks.charts import (
    DRAIN_HOOK,
    DRAIN_HOOK_LAUNCHER,
    DRAIN_MARGIN_SECONDS,
    SPOT_DRAIN_DEADLINE_SECONDS,
    WORKER_TERMINATION_GRACE_SECONDS,
    RayWorkloadSpec,
    workload_problems,
)

pytestmark = pytest.mark.synth


def _workers(platform) -> dict:
    _, job = platform.ray_job()
    return job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]


def _prestop(platform) -> list[str]:
    (container,) = _workers(platform)["containers"]
    return container["lifecycle"]["preStop"]["exec"]["command"]


def test_gpu_workers_drain_their_ray_node_before_they_stop(default_platform):
    pod = _workers(default_platform)
    assert pod["terminationGracePeriodSeconds"] == WORKER_TERMINATION_GRACE_SECONDS == 300
    # On-demand: the node goes when its pods have gone (a drain respects their grace), so the
    # deadline is the grace less the margin for SIGTERM.
    assert _prestop(default_platform) == [
        "/bin/sh", "-c", DRAIN_HOOK_LAUNCHER, "ray-train-eks-prestop", DRAIN_HOOK,
        str(WORKER_TERMINATION_GRACE_SECONDS - DRAIN_MARGIN_SECONDS)]
    # The same call as `ray drain-node`, with reason preemption, holding while the raylet runs.
    assert "DRAIN_NODE_REASON_PREEMPTION" in DRAIN_HOOK and "drain_node(" in DRAIN_HOOK and "wait_procs(" in DRAIN_HOOK
    compile(DRAIN_HOOK, "<preStop>", "exec")
    # The head keeps its plain stop: it runs the driver and Ray Train's controller, on an on-demand node.
    _, job = default_platform.ray_job()
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert head["lifecycle"]["preStop"]["exec"]["command"] == ["/bin/sh", "-c", "ray stop"]


@pytest.mark.parametrize("mode", ["nodegroup", "karpenter"])
def test_on_spot_the_drain_deadline_comes_before_ec2_takes_the_instance(spot_platforms, mode):
    # EC2 takes the instance 120 s after the notice; the hook starts seconds after it.
    assert _prestop(spot_platforms[mode])[-1] == str(SPOT_DRAIN_DEADLINE_SECONDS) == "90"
    assert _workers(spot_platforms[mode])["terminationGracePeriodSeconds"] == 300


def test_no_ray_pod_blocks_karpenters_drain(karpenter_platform, spot_platforms):
    # A do-not-disrupt pod is never evicted by Karpenter's drain (IsEvictable): its preStop hook
    # would not run before EC2 takes a Spot instance.
    for platform in (karpenter_platform, spot_platforms["karpenter"]):
        cluster = platform.ray_job()[1]["spec"]["rayClusterSpec"]
        for template in (cluster["headGroupSpec"]["template"], cluster["workerGroupSpecs"][0]["template"]):
            assert "karpenter.sh/do-not-disrupt" not in template.get("metadata", {}).get("annotations", {})


def test_the_nodepool_budgets_keep_voluntary_disruption_off_running_nodes_and_bring_spot_back(
        spot_platforms, karpenter_platform):
    on_demand = karpenter_platform.stack.gpu_capacity.node_pool["spec"]["disruption"]
    spot = spot_platforms["karpenter"].stack.gpu_capacity.node_pool["spec"]["disruption"]
    empty, no_drift = {"nodes": "100%", "reasons": ["Empty"]}, {"nodes": "0", "reasons": ["Drifted"]}
    assert on_demand == {"consolidationPolicy": "WhenEmpty", "consolidateAfter": "5m", "budgets": [empty, no_drift]}
    # Spot with an on-demand fallback: consolidation may replace an on-demand node by Spot, one at a time.
    assert spot == {"consolidationPolicy": "WhenEmptyOrUnderutilized", "consolidateAfter": "5m",
                    "budgets": [empty, no_drift, {"nodes": "1", "reasons": ["Underutilized"]}]}


def test_a_drain_deadline_too_short_for_a_checkpoint_is_rejected():
    assert workload_problems(RayWorkloadSpec(drain_deadline_seconds=10)) == [
        "drain_deadline_seconds=10: the training needs time to write and upload a checkpoint after the notice; "
        "use at least 30, e.g. 90 on Spot, or None"]


def test_a_grace_period_too_short_for_a_checkpoint_is_rejected():
    assert workload_problems(RayWorkloadSpec(worker_termination_grace_seconds=30)) == [
        "worker_termination_grace_seconds=30: the preStop hook keeps 30 s for SIGTERM and a checkpoint needs time; "
        "use at least 60, e.g. 300"]


@pytest.fixture(scope="module")
def spot_platforms(tmp_path_factory):
    from platform_synth import synth_platform

    return {mode: synth_platform(tmp_path_factory.mktemp(mode), {"gpuCapacity": mode, "gpuCapacityType": "spot"})
            for mode in ("nodegroup", "karpenter")}


def test_spot_node_group_and_nodepool_with_on_demand_fallback(spot_platforms, default_platform, karpenter_platform):
    node_group = spot_platforms["nodegroup"].stack.gpu_nodes.nodegroup.node.default_child
    assert spot_platforms["nodegroup"].stack.resolve(node_group.capacity_type) == "SPOT"
    assert default_platform.stack.resolve(default_platform.stack.gpu_nodes.nodegroup.node.default_child.capacity_type) == "ON_DEMAND"

    def capacity_types(platform):
        requirements = platform.stack.gpu_capacity.node_pool["spec"]["template"]["spec"]["requirements"]
        (requirement,) = [r for r in requirements if r["key"] == "karpenter.sh/capacity-type"]
        return requirement["values"]

    # Karpenter orders reserved, spot, on-demand when several are allowed (and falls back on
    # insufficient capacity): spot first, on-demand when Spot has none.
    assert capacity_types(spot_platforms["karpenter"]) == ["spot", "on-demand"]
    assert capacity_types(karpenter_platform) == ["on-demand"]


def test_spot_is_checked_against_spots_quota_and_priced_as_an_upper_bound(spot_platforms):
    platform = spot_platforms["nodegroup"]
    (checks,) = [r for r in platform.resources("AWS::CloudFormation::CustomResource").values() if "Quotas" in r["Properties"]]
    gpu = json.loads(checks["Properties"]["Quotas"])[0]
    assert (gpu["Code"], gpu["Name"]) == ("L-3819A6DF", "All G and VT Spot Instance Requests")
    describe = platform.stack.cost.describe()
    assert "GPU nodes on Spot: their price varies by AZ and hour" in describe and "an upper bound" in describe


def test_the_ray_pods_may_read_the_spot_price_a_run_is_billed_only_where_the_gpu_nodes_can_be_spot(spot_platforms, default_platform):
    # A run prices each Spot node at EC2's Spot price in its zone (training/telemetry/cost.py).
    def pods_actions(platform):
        role = platform.stack.resolve(platform.stack.ray_service_account.role.role_name)
        return json.dumps([p["Properties"]["PolicyDocument"] for p in platform.resources("AWS::IAM::Policy").values()
                           if role in p["Properties"].get("Roles", [])])

    for platform in spot_platforms.values():
        assert '"Action": "ec2:DescribeSpotPriceHistory", "Effect": "Allow", "Resource": "*"' in pods_actions(platform)
    assert "ec2:DescribeSpotPriceHistory" not in pods_actions(default_platform)


def test_spot_with_a_capacity_reservation_is_rejected():
    from ray_train_eks.config import ConfigError, PlatformConfig

    with pytest.raises(ConfigError) as raised:
        PlatformConfig.from_context({"gpuCapacityType": "spot", "capacityReservationId": "cr-0123456789abcdef0"}, environ={})
    assert raised.value.problems == [
        "gpuCapacityType='spot' leaves the named capacity reservations out (a reservation holds On-Demand capacity); "
        "use -c gpuCapacityType=reserved, or name no reservation"]
    # The construct's own rule, as a consumer of EfaNodeGroup meets it (the earlier rule stays importable).
    from ray_train_eks.constructs.efa_node_group import spot_reservation_problem

    assert spot_reservation_problem("spot", "cr-0123456789abcdef0") == (
        "capacity_reservation_id='cr-0123456789abcdef0' with capacity_type=spot: a capacity reservation holds "
        "on-demand capacity; drop one of them")
    assert spot_reservation_problem("on-demand", "cr-0123456789abcdef0") is None
    with pytest.raises(ConfigError) as raised:
        PlatformConfig.from_context({"gpuCapacityType": "preemptible"}, environ={})
    assert raised.value.problems == [
        "gpuCapacityType='preemptible': 'preemptible' is not a capacity type; use on-demand, spot, or reserved (with "
        "capacity reservations), or an order of them for Karpenter, e.g. -c gpuCapacityType=reserved,on-demand"]


def test_gpu_workers_stage_checkpoints_on_the_nodes_disk(default_platform):
    pod = _workers(default_platform)
    assert {"name": "scratch", "emptyDir": {}} in pod["volumes"]
    (container,) = pod["containers"]
    assert {"name": "scratch", "mountPath": "/scratch"} in container["volumeMounts"]
    assert {"name": "RAY_TRAIN_EKS_SCRATCH", "value": "/scratch"} in container["env"]


def test_the_workers_preflight_runs_the_prestop_hook_in_check_mode(default_platform):
    import json

    (container,) = _workers(default_platform)["containers"]
    (check,) = [e["value"] for e in container["env"] if e["name"] == "RAY_TRAIN_EKS_PRESTOP_CHECK"]
    assert json.loads(check) == [*_prestop(default_platform), "check"]
