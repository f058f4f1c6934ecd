"""Node health in both GPU capacity modes: the EKS node monitoring agent add-on, node repair with
thresholds that repair one bad node of two, the taint a training worker may put on its own node
(and nothing else, by admission policy), and the worker pods that do not land on it."""

from __future__ import annotations

import copy
import json

import celpy
import pytest

from platform_synth import synth_platform
from ray_train_eks.charts import (NODE_NAME_ENV, POD_GPUS_ENV, UNHEALTHY_TAINT_ENV, UNHEALTHY_TAINT_KEY, RayWorkloadSpec,
                                  node_marker_objects, worker_group_spec, workload_problems)
from ray_train_eks.constructs.node_health import (ADDON_NAME, node_group_repair_config,
                                                  unhealthy_nodes_repaired)
from ray_train_eks.scheduling import GPU_TAINT_KEY, RAY_NAMESPACE, RAY_SERVICE_ACCOUNT


def _addon(platform) -> dict | None:
    found = [r["Properties"] for r in platform.resources("AWS::EKS::Addon").values() if r["Properties"]["AddonName"] == ADDON_NAME]
    assert len(found) <= 1
    return found[0] if found else None


@pytest.mark.parametrize("platform", ["default_platform", "karpenter_platform"])
def test_the_monitoring_agent_runs_in_both_modes_with_dcgm_on_the_tainted_gpu_nodes(platform, request):
    platform = request.getfixturevalue(platform)
    addon = _addon(platform)
    configuration = json.loads(addon["ConfigurationValues"])
    # The agent's own DaemonSet tolerates every taint (chart default); DCGM's tolerates none unless told.
    assert configuration == {"dcgmAgent": {"tolerations": [{"key": GPU_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}]}}
    assert "ServiceAccountRoleArn" not in addon and "PodIdentityAssociations" not in addon  # no IAM (EKS User Guide)


def test_the_node_group_repairs_one_bad_node_of_two(default_platform):
    (group,) = [g for g in default_platform.resources("AWS::EKS::Nodegroup").values()
                if g["Properties"]["Labels"].get("ray-train-eks/node-role") == "gpu"]
    repair = dict(group["Properties"]["NodeRepairConfig"])
    overrides = repair.pop("NodeRepairConfigOverrides")
    assert repair == {"Enabled": True, "MaxUnhealthyNodeThresholdCount": 1, "MaxParallelNodesRepairedCount": 1}
    # A GPU fault replaces the node, never reboots it: a reboot keeps the Node object and the taint
    # the training put on it, and a fixed-size group has no spare node for the next worker pod.
    # Every override has all four values (EKS API: "you must specify all the values").
    assert {o["RepairAction"] for o in overrides} == {"Replace", "NoAction"}
    assert {o["NodeMonitoringCondition"] for o in overrides} == {"AcceleratedHardwareReady"}
    assert {o["MinRepairWaitTimeMins"] for o in overrides} == {10}
    reasons = {o["NodeUnhealthyReason"] for o in overrides}
    assert {"NvidiaXID48Error", "NvidiaXID79Error", "NvidiaXID74Error", "NvidiaDoubleBitError"} <= reasons


def test_repair_overrides_are_the_agents_own_reasons():
    """Generated from the pinned agent's reasons (training/resilience/agent_reasons.py, v1.7.0): every
    override names a reason the agent writes; every Fatal GPU reason it writes replaces the node
    (XID 46, 62, 109, 110, 136, 140, 143, 155, 156, 158, the fabric's among them; XID 94 is no
    longer named: the agent only warns about it); its own DCGMError repairs nothing."""
    from ray_train_eks.training_code.resilience.agent_reasons import (AGENT_VERSION, EMITTED, FATAL_GPU_REASONS,
                                                                    WELL_KNOWN_XIDS)

    assert AGENT_VERSION == "v1.7.0"
    overrides = node_group_repair_config(2)["NodeRepairConfigOverrides"]
    actions = {o["NodeUnhealthyReason"]: o["RepairAction"] for o in overrides}
    assert all(EMITTED.match(reason) for reason in actions), [r for r in actions if not EMITTED.match(r)]
    assert {reason for reason, action in actions.items() if action == "Replace"} == set(FATAL_GPU_REASONS)
    assert {f"NvidiaXID{code}Error" for code in WELL_KNOWN_XIDS} <= set(actions)
    assert {"NvidiaXID46Error", "NvidiaXID62Error", "NvidiaXID109Error", "NvidiaXID110Error", "NvidiaXID136Error",
            "NvidiaXID140Error", "NvidiaXID143Error", "NvidiaXID155Error", "NvidiaXID156Error", "NvidiaXID158Error",
            "NvidiaFabricError", "FabricManagerNotRunning"} <= set(actions)
    assert "NvidiaXID94Error" not in actions and not EMITTED.match("NvidiaXID94Fault")
    assert actions["DCGMError"] == "NoAction"


def test_repair_thresholds_at_every_size():
    # The node group: half, at least one (a 2-node group repairs 1; EKS's default stops only above
    # five nodes and 20 %, so an 8-node group would stop at 2 bad nodes).
    assert [unhealthy_nodes_repaired(n) for n in (1, 2, 3, 8, 16)] == [1, 1, 1, 4, 8]
    assert node_group_repair_config(8)["MaxUnhealthyNodeThresholdCount"] == 4


def test_karpenter_repairs_and_has_room_for_a_replacement(karpenter_platform):
    capacity = karpenter_platform.stack.gpu_capacity
    assert capacity.chart_values["settings"]["featureGates"] == {"nodeRepair": True}
    # Two nodes of the type's GPUs, and one more while a node taken out of the run still stands.
    assert capacity.gpu_limit == 3 * capacity.instance.gpus
    (gpu_quota,) = [q for q in karpenter_platform.stack.account_checks.quotas if "replacement" in q["Why"]]
    assert gpu_quota["Vcpus"] == 3 * capacity.instance.vcpus


def test_both_can_be_turned_off(tmp_path):
    platform = synth_platform(tmp_path, {"nodeMonitoring": "false", "nodeRepair": "false"})
    assert _addon(platform) is None
    assert all("NodeRepairConfig" not in g["Properties"] for g in platform.resources("AWS::EKS::Nodegroup").values())


def test_the_karpenter_feature_gate_follows_the_setting(tmp_path):
    platform = synth_platform(tmp_path, {"gpuCapacity": "karpenter", "nodeRepair": "false"})
    assert platform.stack.gpu_capacity.chart_values["settings"]["featureGates"] == {"nodeRepair": False}


# ---------------------------------------------------------------------- the scheduling rule

def test_gpu_worker_pods_are_recreated_elsewhere_and_never_tolerate_the_unhealthy_taint():
    spec = RayWorkloadSpec(gpu_instance_type="p5.48xlarge")
    template = worker_group_spec(spec)["template"]["spec"]
    # Never: a worker whose Ray node ended is deleted and created anew by KubeRay, so the scheduler
    # places it again (Always would restart it in place, on the broken node).
    assert template["restartPolicy"] == "Never"
    for toleration in template.get("tolerations", []):
        assert toleration.get("key") not in (None, UNHEALTHY_TAINT_KEY), toleration  # no key: tolerates everything
    env = {e["name"]: e for e in template["containers"][0]["env"]}
    assert env[NODE_NAME_ENV]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env[UNHEALTHY_TAINT_ENV]["value"] == UNHEALTHY_TAINT_KEY and env[POD_GPUS_ENV]["value"] == "8"


def test_the_chart_names_the_environment_the_training_reads():
    import training.resilience.faults as faults
    import training.resilience.health as health

    assert (NODE_NAME_ENV, UNHEALTHY_TAINT_ENV, POD_GPUS_ENV) == (faults.NODE_NAME_ENV, faults.UNHEALTHY_TAINT_ENV,
                                                                  health.POD_GPUS_ENV)
    from ray_train_eks.workload.spec import REPLACEMENT_TIMEOUT_ENV
    from training.resilience import preemption

    assert REPLACEMENT_TIMEOUT_ENV == preemption.REPLACEMENT_TIMEOUT_ENV


@pytest.mark.parametrize(("platform", "bound"), [("default_platform", "1500"), ("karpenter_platform", "1500")])
def test_a_node_taken_out_waits_a_bounded_time_for_a_replacement_in_both_capacity_modes(platform, bound, request):
    """The node group replaces a node only through repair, which a straggler never gets; Karpenter may
    find no capacity or quota for a new node: either way the driver (on the head) stops the run 25
    minutes after the fault, at the next 15-minute start timeout, instead of idle GPUs until the deadline."""
    from ray_train_eks.workload.spec import REPLACEMENT_TIMEOUT_ENV

    _, job = request.getfixturevalue(platform).ray_job()
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert {e["name"]: e.get("value") for e in head["env"]}.get(REPLACEMENT_TIMEOUT_ENV) == bound


def test_the_platform_applies_the_node_marker_before_the_ray_pods(default_platform):
    manifests = default_platform.manifests()
    (marker_key,) = [k for k, objects in manifests.items() if any(o["kind"] == "ClusterRole" for o in objects)]
    job_key, _ = default_platform.ray_job()
    assert marker_key in default_platform.template["Resources"][job_key]["DependsOn"]
    assert [o["kind"] for o in manifests[marker_key]] == ["ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy",
                                                         "ValidatingAdmissionPolicyBinding"]


def test_no_taint_key_means_no_node_permission():
    assert node_marker_objects(RayWorkloadSpec(unhealthy_taint_key=None)) == []
    env = {e["name"] for e in worker_group_spec(RayWorkloadSpec(unhealthy_taint_key=None))["template"]["spec"]["containers"][0]["env"]}
    assert UNHEALTHY_TAINT_ENV not in env
    (problem,) = workload_problems(RayWorkloadSpec(unhealthy_taint_key="Bad Key!"))
    assert "unhealthy_taint_key='Bad Key!'" in problem and "ray-train-eks/gpu-unhealthy" in problem


def test_the_service_account_may_get_and_patch_nodes_and_under_karpenter_read_why_a_node_does_not_come():
    import dataclasses

    role, binding, policy, policy_binding = node_marker_objects(RayWorkloadSpec())
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}]
    (karpenter_role, *_) = node_marker_objects(dataclasses.replace(RayWorkloadSpec(), node_claims_readable=True))
    assert karpenter_role["rules"][1:] == [{"apiGroups": ["karpenter.sh"], "resources": ["nodeclaims"], "verbs": ["list"]},
                                           {"apiGroups": [""], "resources": ["events"], "verbs": ["list"]}]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": RAY_SERVICE_ACCOUNT, "namespace": RAY_NAMESPACE}]
    assert binding["roleRef"]["name"] == role["metadata"]["name"] == policy_binding["spec"]["policyName"]
    assert policy_binding["spec"]["validationActions"] == ["Deny"] and policy["spec"]["failurePolicy"] == "Fail"
    (condition,) = policy["spec"]["matchConditions"]
    assert condition["expression"] == f'request.userInfo.username == "system:serviceaccount:{RAY_NAMESPACE}:{RAY_SERVICE_ACCOUNT}"'


NODE = {"metadata": {"name": "ip-10-0-1-6", "labels": {"ray-train-eks/node-role": "gpu"}, "annotations": {"a": "1"},
                     "finalizers": ["karpenter.sh/termination"]},
        "spec": {"providerID": "aws:///us-west-2a/i-0", "taints": [{"key": GPU_TAINT_KEY, "value": "true", "effect": "NoSchedule"}]}}


#: The user information the API server builds from a Ray pod's bound token, for a pod on NODE.
ON_NODE = {"username": f"system:serviceaccount:{RAY_NAMESPACE}:{RAY_SERVICE_ACCOUNT}",
           "extra": {"authentication.kubernetes.io/pod-name": ["finetune-gpu-workers-x"],
                     "authentication.kubernetes.io/node-name": [NODE["metadata"]["name"]]}}


def _admitted(new: dict, old: dict = NODE, user: dict = ON_NODE) -> list[str]:
    """The policy's failed validations' messages for an update of ``old`` to ``new`` by the Ray pods'
    service account (``user``: its request's user information), evaluated by a CEL interpreter as
    the API server would."""
    policy = node_marker_objects(RayWorkloadSpec())[2]["spec"]
    environment = celpy.Environment()
    variables = {v["name"]: environment.program(environment.compile(v["expression"])).evaluate({}) for v in policy["variables"]}
    activation = {"object": celpy.json_to_cel(new), "oldObject": celpy.json_to_cel(old), "variables": celpy.json_to_cel(variables),
                  "request": celpy.json_to_cel({"userInfo": user})}
    return [v["message"] for v in policy["validations"]
            if not bool(environment.program(environment.compile(v["expression"])).evaluate(activation))]


def _with(change) -> dict:
    node = copy.deepcopy(NODE)
    change(node)
    return node


OURS = {"key": UNHEALTHY_TAINT_KEY, "value": "gpu-error", "effect": "NoSchedule"}


def test_the_policy_lets_the_pods_add_or_remove_their_taint():
    tainted = _with(lambda n: n["spec"]["taints"].append(OURS))
    assert _admitted(tainted) == []
    assert _admitted(NODE, old=tainted) == []  # taken off again (a person, or a later version)
    no_taints = _with(lambda n: n["spec"].pop("taints"))
    assert _admitted(_with(lambda n: n["spec"].update(taints=[OURS])), old=no_taints) == []  # a node without taints


def test_the_policy_lets_the_pods_mark_only_the_node_they_run_on():
    tainted = _with(lambda n: n["spec"]["taints"].append(OURS))
    elsewhere = {**ON_NODE, "extra": {**ON_NODE["extra"], "authentication.kubernetes.io/node-name": ["ip-10-0-2-9"]}}
    unbound = {"username": ON_NODE["username"]}  # a token bound to no pod (a Secret-based one): no extra at all
    no_node = {**ON_NODE, "extra": {"authentication.kubernetes.io/pod-name": ["finetune-gpu-workers-x"]}}
    for user in (elsewhere, unbound, no_node):
        assert _admitted(tainted, user=user) == [
            "the Ray pods may mark only the node they run on (the node their service-account token names)"], user
    assert _admitted(tainted) == []


@pytest.mark.parametrize("change, refused", [
    (lambda n: n["spec"]["taints"].clear(), "no taint of a node but"),
    (lambda n: n["spec"]["taints"].append({"key": "other", "effect": "NoExecute"}), "no taint of a node but"),
    (lambda n: n["spec"]["taints"].append({**OURS, "effect": "NoExecute"}), "with effect NoSchedule only"),
    (lambda n: n["metadata"]["labels"].update({"ray-train-eks/node-role": "system"}), "metadata.labels"),
    (lambda n: n["metadata"].pop("annotations"), "metadata.annotations"),
    (lambda n: n["metadata"].pop("finalizers"), "metadata.finalizers"),
    (lambda n: n["spec"].update(unschedulable=True), "spec.unschedulable"),
])
def test_the_policy_refuses_every_other_change(change, refused):
    assert any(refused in message for message in _admitted(_with(change))), refused


def test_a_worker_pod_whose_ray_node_ended_ends_within_a_minute():
    """KubeRay v1.7.0 injects a liveness probe that takes 120 x 5 s to fail only where the container
    has none (common/pod.go initLivenessAndReadinessProbe); the GPU worker's own probe asks the same
    endpoint and ends the pod within a minute (tests/training/test_preemption.py runs it against
    pods whose Ray node a hardware fault ended)."""
    (container,) = worker_group_spec(RayWorkloadSpec())["template"]["spec"]["containers"]
    probe = container["livenessProbe"]
    assert probe["httpGet"] == {"path": "/api/healthz", "port": 52365}  # the dashboard agent's, as KubeRay's
    assert probe["failureThreshold"] * probe["periodSeconds"] + probe["timeoutSeconds"] <= 60
    assert probe["initialDelaySeconds"] >= 30  # `ray start` has its agent up well before (KubeRay's delay)


def test_two_dcgms_each_with_its_own_client_and_only_the_exporter_profiles():
    """docs/operations.md, "Two DCGMs on a GPU node": the monitoring agent's host engine is its own
    (its configuration names no other DCGM: the add-on's schema has no such key at v1.7.0), the
    CloudWatch add-on's exporter (chart 6.4.0) runs DCGM embedded, with no remote-engine argument,
    and our configuration of it leaves that so; the idle alarm's profiling metric is the exporter's."""
    from upstream import chart_values

    from ray_train_eks.constructs.observability import TOLERATE_EVERYTHING, addon_configuration
    from ray_train_eks.constructs.node_health import monitoring_agent_configuration

    agent = monitoring_agent_configuration([{"key": GPU_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}])
    assert set(agent) == {"dcgmAgent"} and set(agent["dcgmAgent"]) == {"tolerations"}
    exporter = chart_values("amazon-cloudwatch-observability")["dcgmExporter"]
    assert exporter["enabled"] is True
    remote = ("-r", "--remote-hostengine-info", "DCGM_REMOTE_HOSTENGINE_INFO")
    assert not [a for a in exporter.get("arguments") or [] if a.split("=")[0] in remote]
    assert not exporter.get("hostNetwork")
    ours = addon_configuration(TOLERATE_EVERYTHING)
    assert "dcgmExporter" not in ours  # the exporter as the chart runs it: embedded
    assert ours["agent"]["config"]["logs"]["metrics_collected"]["kubernetes"]["accelerated_compute_metrics"] is True

