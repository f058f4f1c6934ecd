"""gpuCapacity=karpenter: the controller, its IAM and interruption queue, the EC2NodeClass
and NodePool (strictly valid against Karpenter 1.14.1's CRDs), the RayJob's settings, the
teardown order, and the node group mode left as it was."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import yaml

from crd_schema import load_schemas, validate
from ray_train_eks.constructs.karpenter_iam import CONTROLLER_POLICIES, INTERRUPTION_RULES, controller_policy_text
from upstream import KARPENTER_CRDS, KARPENTER_REFERENCE, chart_values, upstream_file

pytestmark = pytest.mark.synth
#: What CloudFormation would put where the manifests hold a reference, by resource type.
FAKE_VALUES = {
    "AWS::EC2::Subnet": "subnet-0123456789abcdef0",
    "AWS::EC2::SecurityGroup": "sg-0123456789abcdef1",
    "AWS::EKS::Cluster": "sg-0123456789abcdef2",  # its ClusterSecurityGroupId
    "AWS::EC2::PlacementGroup": "RayTrainEks-GpuCapacityPlacementGroup-1A2B3C",
    "AWS::IAM::Role": "RayTrainEks-GpuCapacityNodeRole-1A2B3C",
}


@pytest.fixture(scope="module")
def crd_schemas():
    return load_schemas({
        "EC2NodeClass": upstream_file(f"{KARPENTER_CRDS}/karpenter.k8s.aws_ec2nodeclasses.yaml"),
        "NodePool": upstream_file(f"{KARPENTER_CRDS}/karpenter.sh_nodepools.yaml"),
    })


def _concrete(value, template: dict):
    """A resolved manifest with CloudFormation references replaced by values of the right shape."""
    if isinstance(value, dict):
        if set(value) == {"Ref"} or set(value) == {"Fn::GetAtt"}:
            target = value.get("Ref") or value["Fn::GetAtt"][0]
            return FAKE_VALUES[template["Resources"][target]["Type"]]
        if set(value) == {"Fn::Select"}:
            return "us-west-2a"
        return {k: _concrete(v, template) for k, v in value.items()}
    if isinstance(value, list):
        return [_concrete(v, template) for v in value]
    return value


def _objects(platform) -> tuple[dict, dict]:
    capacity = platform.stack.gpu_capacity
    resolved = platform.stack.resolve([capacity.node_class, capacity.node_pool])
    return tuple(_concrete(obj, platform.template) for obj in resolved)


def _chart(platform, name: str) -> dict:
    (props,) = [c["Properties"] for c in platform.resources("Custom::AWSCDK-EKS-HelmChart").values() if c["Properties"]["Chart"] == name]
    return props


def _depends(platform, key: str) -> set[str]:
    resources = platform.template["Resources"]
    if key not in resources:  # in the training code's nested stack: its stack resource carries the dependencies
        (key,) = [k for k, r in resources.items() if r["Type"] == "AWS::CloudFormation::Stack"]
    return set(resources[key].get("DependsOn", []))


def _key(platform, construct) -> str:
    """Logical id of a construct's CloudFormation resource (through wrappers such as CustomResource)."""
    if hasattr(construct, "logical_id"):
        return platform.stack.resolve(construct.logical_id)
    return platform.logical_id(construct)


# --------------------------------------------------------------------- the two modes

def test_node_group_mode_has_no_karpenter(default_platform):
    assert default_platform.stack.gpu_capacity is None
    assert not [c for c in default_platform.resources("Custom::AWSCDK-EKS-HelmChart").values() if c["Properties"]["Chart"] == "karpenter"]
    assert len(default_platform.resources("AWS::EKS::Nodegroup")) == 2
    # Nothing of Karpenter's but the shipped training code's text (it reads NodeClaims where they exist).
    code = {key for key, objects in default_platform.manifests().items()
            if any(o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("ray-train-eks-code") for o in objects)}
    rest = {key: r for key, r in default_platform.template["Resources"].items() if key not in code}
    assert "karpenter.sh" not in json.dumps(rest)


def test_the_training_code_is_one_configmap_a_manifest_in_a_stack_of_its_own_so_an_update_fits_lambdas_event(karpenter_platform):
    """CloudFormation takes 1 MB a template, and invokes a custom resource's function asynchronously with an
    event Lambda caps at 1 MB, which on an update holds the properties twice (new and old): the code's
    ConfigMaps are in a nested stack, one a manifest, each well under half of that."""
    code = {key: objects for key, objects in karpenter_platform.manifests().items()
            if any(o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("ray-train-eks-code") for o in objects)}
    assert len(code) >= 2 and all(len(objects) == 1 for objects in code.values())
    assert not set(code) & set(karpenter_platform.template["Resources"])  # none in the stack's own template
    sizes = [len(json.dumps(karpenter_platform.nested[key]["Properties"]).encode()) for key in code]
    assert max(sizes) < 400_000, sizes


def test_karpenter_mode_has_no_gpu_node_group(karpenter_platform):
    (nodegroup,) = karpenter_platform.resources("AWS::EKS::Nodegroup").values()
    assert nodegroup["Properties"]["AmiType"] == "AL2023_x86_64_STANDARD"  # the system nodes only
    assert karpenter_platform.resources("AWS::EC2::LaunchTemplate").keys() == {
        k for k in karpenter_platform.resources("AWS::EC2::LaunchTemplate") if "System" in k
    }


# --------------------------------------------------------------------- controller

def test_chart_is_pinned_oci_on_the_system_nodes_with_cluster_and_queue(karpenter_platform):
    props = _chart(karpenter_platform, "karpenter")
    assert (props["Repository"], props["Version"], props["Release"], props["Namespace"]) == (
        "oci://public.ecr.aws/karpenter/karpenter", "1.14.1", "karpenter", "kube-system")
    assert (props["Wait"], props["Timeout"]) == (True, "600s")
    queue = next(iter(karpenter_platform.resources("AWS::SQS::Queue")))
    cluster = next(iter(karpenter_platform.resources("AWS::EKS::Cluster")))
    values = karpenter_platform.stack.resolve(karpenter_platform.stack.gpu_capacity.chart_values)
    assert values["settings"] == {"clusterName": {"Ref": cluster}, "interruptionQueue": {"Fn::GetAtt": [queue, "QueueName"]},
                                  "featureGates": {"nodeRepair": True}}
    assert values["replicas"] == 1  # one system node: a second replica would stay Pending
    assert values["nodeSelector"] == {"ray-train-eks/node-role": "system"}
    # ... and these are the values the template hands Helm.
    text = json.dumps(props["Values"])
    assert '{"Fn::GetAtt": ["%s", "QueueName"]}' % queue in text and '\\"replicas\\":1,' in text


def test_replicas_follow_the_system_nodes(tmp_path):
    from platform_synth import synth_platform

    platform = synth_platform(tmp_path, {"gpuCapacity": "karpenter", "systemNodeCount": "3"})
    assert '\\"replicas\\":2' in json.dumps(_chart(platform, "karpenter")["Values"])


def test_every_helm_value_we_set_is_a_key_of_the_chart(karpenter_platform):
    upstream = chart_values("karpenter")
    # The values as the construct passed them (the template holds them as one Fn::Join).
    values = karpenter_platform.stack.gpu_capacity.chart_values
    assert set(values) <= set(upstream), set(values) - set(upstream)
    for key, value in values.items():
        if key != "nodeSelector" and isinstance(value, dict) and isinstance(upstream[key], dict) and upstream[key]:
            assert set(value) <= set(upstream[key]), (key, set(value) - set(upstream[key]))
    assert set(values["controller"]["resources"]) <= {"requests", "limits"}


def test_controller_policies_are_ours_scoped_to_this_cluster(karpenter_platform):
    policies = {k: v["Properties"] for k, v in karpenter_platform.resources("AWS::IAM::ManagedPolicy").items() if "GpuCapacity" in k}
    assert len(policies) == len(CONTROLLER_POLICIES) == 6
    role = next(k for k in karpenter_platform.resources("AWS::IAM::Role") if "GpuCapacityControllerRole" in k)
    cluster = next(iter(karpenter_platform.resources("AWS::EKS::Cluster")))
    texts = {}
    for name in CONTROLLER_POLICIES:
        (props,) = [p for k, p in policies.items() if k.startswith(f"GpuCapacity{name}")]
        assert props["Roles"] == [{"Ref": role}]
        sub = props["PolicyDocument"]["Fn::Sub"]
        text, variables = (sub, {}) if isinstance(sub, str) else sub
        assert text == controller_policy_text(name)
        assert json.loads(re.sub(r"\$\{[^}]+\}", "X", text))  # valid JSON once substituted
        # Every variable the text names is given, and the cluster's is this cluster.
        named = set(re.findall(r"\$\{([^}:]+)\}", text))
        assert named == set(variables), (name, named, set(variables))
        if "ClusterName" in variables:
            assert variables["ClusterName"] == {"Ref": cluster}
        texts[name] = text
    # Cluster-scoped by tag conditions; placement groups discoverable (placementGroupSelector).
    assert '"aws:ResourceTag/kubernetes.io/cluster/${ClusterName}":"owned"' in texts["NodeLifecyclePolicy"]
    assert "ec2:DescribePlacementGroups" in texts["ResourceDiscoveryPolicy"]
    assert "placement-group/*" in texts["NodeLifecyclePolicy"]


class _CloudFormationLoader(yaml.SafeLoader):
    """Reads a CloudFormation YAML template: ``!Sub x`` becomes ``{"Fn::Sub": x}``, and so on."""


def _intrinsic(loader: yaml.SafeLoader, suffix: str, node: yaml.Node):
    name = "Ref" if suffix == "Ref" else f"Fn::{suffix}"
    if isinstance(node, yaml.ScalarNode):
        return {name: loader.construct_scalar(node)}
    if isinstance(node, yaml.SequenceNode):
        return {name: loader.construct_sequence(node, deep=True)}
    return {name: loader.construct_mapping(node, deep=True)}


_CloudFormationLoader.add_multi_constructor("!", _intrinsic)


def _statements(document: dict) -> dict[str, dict]:
    """A policy's statements by Sid, with Action and Resource as sets (their order means nothing)."""
    def as_set(value):
        return frozenset([value] if isinstance(value, str) else value)
    return {s["Sid"]: {**s, "Action": as_set(s["Action"]), "Resource": as_set(s["Resource"])} for s in document["Statement"]}


def test_controller_policies_and_interruption_rules_are_upstreams_reference():
    """Ours, statement by statement (actions, resources, conditions), against Karpenter
    1.14.1's getting-started CloudFormation, where that file can be found."""
    reference = yaml.load(upstream_file(KARPENTER_REFERENCE).read_text(), Loader=_CloudFormationLoader)["Resources"]
    upstream_policies = [k for k, v in reference.items() if v["Type"] == "AWS::IAM::ManagedPolicy"]
    assert tuple(upstream_policies) == CONTROLLER_POLICIES
    for name in CONTROLLER_POLICIES:
        text = reference[name]["Properties"]["PolicyDocument"]["Fn::Sub"]
        text = text.replace("${KarpenterNodeRole.Arn}", "${NodeRoleArn}").replace(
            "${KarpenterInterruptionQueue.Arn}", "${InterruptionQueueArn}")
        assert _statements(json.loads(controller_policy_text(name))) == _statements(json.loads(text)), name
    upstream_rules = {k: v["Properties"]["EventPattern"] for k, v in reference.items() if v["Type"] == "AWS::Events::Rule"}
    assert upstream_rules == {name: {"source": [source], "detail-type": [detail]}
                              for name, (source, detail) in INTERRUPTION_RULES.items()}


def test_controller_gets_credentials_through_pod_identity_only(karpenter_platform):
    (association,) = [a["Properties"] for a in karpenter_platform.resources("AWS::EKS::PodIdentityAssociation").values()
                      if a["Properties"]["ServiceAccount"] == "karpenter"]
    assert association["Namespace"] == "kube-system"
    role_key = association["RoleArn"]["Fn::GetAtt"][0]
    trust = karpenter_platform.template["Resources"][role_key]["Properties"]["AssumeRolePolicyDocument"]["Statement"]
    assert trust == [{"Action": ["sts:AssumeRole", "sts:TagSession"], "Effect": "Allow", "Principal": {"Service": "pods.eks.amazonaws.com"}}]
    assert "Karpenter" not in json.dumps(karpenter_platform.resources("AWS::IAM::OIDCProvider"))
    assert not karpenter_platform.resources("Custom::AWSCDKOpenIdConnectProvider")


def test_node_role_has_the_eks_node_policies_and_an_ec2_linux_access_entry(karpenter_platform):
    role_key = next(k for k in karpenter_platform.resources("AWS::IAM::Role") if "GpuCapacityNodeRole" in k)
    role = karpenter_platform.template["Resources"][role_key]["Properties"]
    assert role["AssumeRolePolicyDocument"]["Statement"][0]["Principal"] == {"Service": "ec2.amazonaws.com"}
    managed = {m["Fn::Join"][1][-1].split("/")[-1] for m in role["ManagedPolicyArns"]}
    assert managed == {"AmazonEKSWorkerNodePolicy", "AmazonEKS_CNI_Policy", "AmazonEC2ContainerRegistryPullOnly"}
    (entry,) = [e["Properties"] for e in karpenter_platform.resources("AWS::EKS::AccessEntry").values()
                if e["Properties"]["PrincipalArn"] == {"Fn::GetAtt": [role_key, "Arn"]}]
    assert entry["Type"] == "EC2_LINUX"
    assert not entry.get("AccessPolicies")


def test_interruption_queue_is_encrypted_tls_only_and_fed_by_the_reference_rules(karpenter_platform):
    (queue_key, queue), = karpenter_platform.resources("AWS::SQS::Queue").items()
    assert queue["Properties"]["SqsManagedSseEnabled"] is True
    assert queue["Properties"]["MessageRetentionPeriod"] == 300
    (policy,) = karpenter_platform.resources("AWS::SQS::QueuePolicy").values()
    statements = policy["Properties"]["PolicyDocument"]["Statement"]
    assert any(s["Effect"] == "Deny" and s["Condition"] == {"Bool": {"aws:SecureTransport": "false"}} for s in statements)
    assert any(s["Effect"] == "Allow" and s["Principal"] == {"Service": "events.amazonaws.com"} for s in statements)
    # The interruption rules (the idle-GPU alarm's instance count runs on a schedule rule of its own).
    rules = [r["Properties"] for r in karpenter_platform.resources("AWS::Events::Rule").values()
             if "EventPattern" in r["Properties"]]
    expected = sorted(json.dumps({"detail-type": [detail], "source": [source]}, sort_keys=True)
                      for source, detail in INTERRUPTION_RULES.values())
    assert sorted(json.dumps(r["EventPattern"], sort_keys=True) for r in rules) == expected
    assert len(rules) == 5
    assert all(r["Targets"][0]["Arn"] == {"Fn::GetAtt": [queue_key, "Arn"]} for r in rules)


# --------------------------------------------------------------------- EC2NodeClass and NodePool

def test_node_class_and_node_pool_validate_strictly(karpenter_platform, crd_schemas):
    node_class, pool = _objects(karpenter_platform)
    defaulted = validate(node_class, crd_schemas)
    assert defaulted["spec"]["metadataOptions"]["httpPutResponseHopLimit"] == 1
    validate(pool, crd_schemas)


def test_strict_validation_catches_a_misspelled_field(karpenter_platform, crd_schemas):
    node_class, pool = _objects(karpenter_platform)
    pool["spec"]["disruption"]["consolidateafter"] = "5m"
    with pytest.raises(jsonschema.ValidationError, match="consolidateafter"):
        validate(pool, crd_schemas)
    node_class["spec"]["placementGroupSelector"] = {"name": "pg", "Id": "pg-1"}
    with pytest.raises(jsonschema.ValidationError, match="Id"):
        validate(node_class, crd_schemas)


def test_node_class_has_the_efa_wiring_of_the_node_group(karpenter_platform):
    resolved = karpenter_platform.stack.resolve(karpenter_platform.stack.gpu_capacity.node_class)["spec"]
    template = karpenter_platform.template["Resources"]
    assert resolved["amiSelectorTerms"] == [{"alias": "al2023@v20260714"}]
    assert "amiFamily" not in resolved  # the alias implies it
    (subnet,) = resolved["subnetSelectorTerms"]
    assert template[subnet["id"]["Ref"]]["Type"] == "AWS::EC2::Subnet" and "Private" in subnet["id"]["Ref"]
    cluster_sg, efa_sg = (term["id"]["Fn::GetAtt"] for term in resolved["securityGroupSelectorTerms"])
    assert cluster_sg[1] == "ClusterSecurityGroupId" and template[cluster_sg[0]]["Type"] == "AWS::EKS::Cluster"
    assert template[efa_sg[0]]["Properties"]["SecurityGroupEgress"][0]["Description"] == "Disallow all traffic"
    placement = resolved["placementGroupSelector"]["name"]["Fn::GetAtt"][0]
    assert template[placement]["Properties"]["Strategy"] == "cluster"
    assert resolved["metadataOptions"] == {"httpEndpoint": "enabled", "httpProtocolIPv6": "disabled", "httpPutResponseHopLimit": 1, "httpTokens": "required"}
    # containerd and kubelet on a RAID0 of the NVMe instance store; the root holds the OS.
    assert resolved["instanceStorePolicy"] == "RAID0"
    assert resolved["blockDeviceMappings"] == [{"deviceName": "/dev/xvda", "ebs": {
        "volumeSize": "50Gi", "volumeType": "gp3", "encrypted": True, "deleteOnTermination": True}}]
    assert "networkInterfaces" not in resolved  # per-pod EFA: Karpenter adds one efa interface per card
    role = resolved["role"]["Ref"]
    assert "GpuCapacityNodeRole" in role
    # The EFA group lets its members talk over every protocol, as the node group's does.
    ingress = [r["Properties"] for r in karpenter_platform.resources("AWS::EC2::SecurityGroupIngress").values()
               if r["Properties"]["GroupId"] == {"Fn::GetAtt": efa_sg}]
    assert ingress == [{"Description": "EFA from members", "GroupId": {"Fn::GetAtt": efa_sg}, "IpProtocol": "-1",
                        "SourceSecurityGroupId": {"Fn::GetAtt": efa_sg}}]


def test_node_pool_is_one_type_on_demand_in_the_gpu_subnets_az_and_limited(karpenter_platform):
    pool = karpenter_platform.stack.resolve(karpenter_platform.stack.gpu_capacity.node_pool)["spec"]
    requirements = {r["key"]: r["values"] for r in pool["template"]["spec"]["requirements"]}
    assert requirements["node.kubernetes.io/instance-type"] == ["g6.12xlarge"]
    assert requirements["karpenter.sh/capacity-type"] == ["on-demand"]
    subnet_ref = karpenter_platform.stack.resolve(karpenter_platform.stack.network.gpu_subnet.availability_zone)
    assert requirements["topology.kubernetes.io/zone"] == [subnet_ref]
    assert pool["limits"] == {"nvidia.com/gpu": "12"}  # 2 nodes x 4 L4, and room for one replacement
    assert pool["disruption"]["consolidationPolicy"] == "WhenEmpty"  # budgets: tests/test_spot.py
    assert pool["disruption"]["consolidateAfter"] == "5m"
    assert pool["template"]["spec"]["expireAfter"] == "Never"


def test_nodes_carry_the_labels_and_taint_the_pods_and_plugins_select(karpenter_platform):
    pool = karpenter_platform.stack.resolve(karpenter_platform.stack.gpu_capacity.node_pool)["spec"]["template"]
    assert pool["metadata"]["labels"] == {"nvidia.com/gpu.present": "true", "ray-train-eks/node-role": "gpu"}
    assert pool["spec"]["taints"] == [{"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}]
    _, job = karpenter_platform.ray_job()
    workers = job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]
    assert workers["spec"]["nodeSelector"].items() <= pool["metadata"]["labels"].items()
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in workers["spec"]["tolerations"]
    assert workers["spec"]["containers"][0]["resources"]["limits"]["vpc.amazonaws.com/efa"] in (1, "1")  # Karpenter launches with EFA


def test_p4d_nodes_get_four_gpus_worth_of_limit_per_node(tmp_path):
    from platform_synth import synth_platform

    platform = synth_platform(tmp_path, {"gpuCapacity": "karpenter", "gpuInstanceType": "p4d.24xlarge", "gpuNodeCount": "3",
                                         "gpuRootVolumeGiB": "400", "gpuAmiVersion": "v20260709"})
    node_class = platform.stack.resolve(platform.stack.gpu_capacity.node_class)["spec"]
    pool = platform.stack.resolve(platform.stack.gpu_capacity.node_pool)["spec"]
    assert pool["limits"] == {"nvidia.com/gpu": "32"}  # 3 + 1 spare
    assert node_class["blockDeviceMappings"][0]["ebs"]["volumeSize"] == "400Gi"
    assert node_class["amiSelectorTerms"] == [{"alias": "al2023@v20260709"}]


# --------------------------------------------------------------------- the RayJob in this mode

def test_rayjob_has_a_pre_running_deadline(karpenter_platform, default_platform):
    karpenter_job, node_group_job = karpenter_platform.ray_job()[1], default_platform.ray_job()[1]
    assert karpenter_job["spec"]["preRunningDeadlineSeconds"] == 1800
    assert {"condition": {"jobStatus": "SUCCEEDED", "ttlSeconds": 0}, "policy": "DeleteWorkers"} in (
        karpenter_job["spec"]["deletionStrategy"]["deletionRules"])  # the GPU workers go at once, the nodes empty
    assert "preRunningDeadlineSeconds" not in node_group_job["spec"]


def test_pre_running_deadline_is_configurable(tmp_path):
    from ray_train_eks.config import PlatformConfig

    config = PlatformConfig.from_context({"gpuCapacity": "karpenter", "preRunningDeadlineSeconds": "900"}.get, environ={})
    assert config.workload_spec().pre_running_deadline_seconds == 900
    config = PlatformConfig.from_context({"preRunningDeadlineSeconds": "600"}.get, environ={})
    assert config.workload_spec().pre_running_deadline_seconds == 600  # the node group may use one too


# --------------------------------------------------------------------- order and teardown

def test_creation_and_teardown_order(karpenter_platform):
    stack = karpenter_platform.stack
    capacity = stack.gpu_capacity
    pool, node_class = _key(karpenter_platform, capacity.node_pool_manifest), _key(karpenter_platform, capacity.node_class_manifest)
    chart = _key(karpenter_platform, capacity.chart)
    # NodePool after (on destroy: before) the EC2NodeClass, which is after the controller.
    assert node_class in _depends(karpenter_platform, pool)
    node_class_deps = _depends(karpenter_platform, node_class)
    assert chart in node_class_deps
    # What the instances and the controller need outlives the EC2NodeClass, whose finalizer
    # waits for the instances: the access entry, queue, EFA group and placement group.
    for construct in (capacity.node_access_entry, capacity.queue, capacity.security_group, capacity.placement_group):
        assert _key(karpenter_platform, construct) in node_class_deps
    chart_deps = _depends(karpenter_platform, chart)
    assert _key(karpenter_platform, capacity.pod_identity) in chart_deps
    assert all(stack.resolve(p.logical_id) in chart_deps for p in capacity.controller_policies)
    assert any("SystemNodes" in d for d in chart_deps)
    assert "ClusterEksPodIdentityAgentAddon623E6280" in _depends(karpenter_platform, _key(karpenter_platform, capacity.pod_identity))
    # The Ray objects go before the NodePool, so its nodes are empty when it goes.
    job_key, _ = karpenter_platform.ray_job()
    assert pool in _depends(karpenter_platform, job_key)
    # The cluster and the VPC go after all of it: the manifests depend on the cluster's kubectl barrier.
    assert any("KubectlReadyBarrier" in d for d in _depends(karpenter_platform, node_class))


def test_device_plugins_do_not_wait_for_gpu_nodes_in_karpenter_mode(karpenter_platform):
    for name in ("nvidia-device-plugin", "aws-efa-k8s-device-plugin"):
        (key,) = [k for k, c in karpenter_platform.resources("Custom::AWSCDK-EKS-HelmChart").items() if c["Properties"]["Chart"] == name]
        assert not any("GpuNodes" in d or "GpuCapacity" in d for d in _depends(karpenter_platform, key))


# --------------------------------------------------------------------- cost and outputs

def test_cost_says_running_and_idle_in_both_modes(karpenter_platform, default_platform):
    karpenter, node_group = karpenter_platform.template["Outputs"], default_platform.template["Outputs"]
    # With Container Insights (an estimate: 0.08 USD/hour running; idle 0.027 without GPU nodes, 0.066 with).
    assert (karpenter["EstimatedCostUsdPerHour"]["Value"], karpenter["EstimatedIdleCostUsdPerHour"]["Value"]) == ("9.64", "0.38")
    assert (node_group["EstimatedCostUsdPerHour"]["Value"], node_group["EstimatedIdleCostUsdPerHour"]["Value"]) == ("9.64", "9.62")
    assert "idle 0.38 (Karpenter removes the GPU nodes" in karpenter_platform.stack.cost.describe()
    assert "kubectl get nodepools,nodeclaims" in karpenter["WatchGpuNodesCommand"]["Value"]
    assert "WatchGpuNodesCommand" not in node_group


# --------------------------------------------------------------------- destroy that always finishes


@pytest.mark.parametrize("platform", ["default_platform", "karpenter_platform"])
def test_every_kubernetes_object_goes_before_the_core_addons_which_keep_running_when_deleted(platform, request):
    """coredns, vpc-cni, kube-proxy and the Pod Identity agent have no dependents of their own:
    CloudFormation would delete them first, in parallel with the RayJob, and the EC2NodeClass's
    finalizer (which needs DNS and the network to reach IAM and EC2) would run without them."""
    synthesized = request.getfixturevalue(platform)
    addons = {k for k, r in synthesized.resources("AWS::EKS::Addon").items()
              if r["Properties"]["AddonName"] in ("vpc-cni", "coredns", "kube-proxy", "eks-pod-identity-agent")}
    assert len(addons) == 4
    assert all(synthesized.template["Resources"][k]["Properties"]["PreserveOnDelete"] is True for k in addons)
    objects = {**synthesized.resources("Custom::AWSCDK-EKS-HelmChart"), **synthesized.resources("Custom::AWSCDK-EKS-KubernetesResource")}
    assert len(objects) >= 8  # charts, the Ray workload, the namespace, the service account (and Karpenter's)
    for key in objects:
        assert addons <= _depends(synthesized, key), key


def test_karpenters_crds_come_from_their_own_chart_installed_first_and_removed_last(karpenter_platform):
    crds = _chart(karpenter_platform, "karpenter-crd")
    assert (crds["Repository"], crds["Version"], crds["Release"], crds["Namespace"]) == (
        "oci://public.ecr.aws/karpenter/karpenter-crd", "1.14.1", "karpenter-crd", "kube-system")
    capacity = karpenter_platform.stack.gpu_capacity
    assert _key(karpenter_platform, capacity.crd_chart) in _depends(karpenter_platform, _key(karpenter_platform, capacity.chart))


def test_the_controller_knows_its_region_without_imds(karpenter_platform):
    values = karpenter_platform.stack.resolve(karpenter_platform.stack.gpu_capacity.chart_values)
    assert values["controller"]["env"] == [{"name": "AWS_REGION", "value": "us-west-2"}]
    upstream = chart_values("karpenter")
    assert upstream["controller"]["env"] == []  # the chart's own knob for extra variables


def test_node_termination_is_bounded_and_the_ray_namespace_empties_the_nodes_first(karpenter_platform, default_platform):
    capacity = karpenter_platform.stack.gpu_capacity
    assert capacity.node_pool["spec"]["template"]["spec"]["terminationGracePeriod"] == "10m"
    namespace = _key(karpenter_platform, karpenter_platform.stack.ray_service_account.namespace_manifest)
    assert _key(karpenter_platform, capacity.node_pool_manifest) in _depends(karpenter_platform, namespace)
    node_group_namespace = _key(default_platform, default_platform.stack.ray_service_account.namespace_manifest)
    assert _key(default_platform, default_platform.stack.gpu_nodes.nodegroup) in _depends(default_platform, node_group_namespace)


def test_serving_has_a_node_pool_of_its_own_whose_nodes_only_the_services_pods_select(karpenter_platform, crd_schemas):
    """servingGpuNodes (1): a second NodePool on the same EC2NodeClass, its own GPU limit, On-Demand,
    its nodes' role label the services' GPU workers select and training's workers do not (and the
    other way round), the device plugins' label and the GPU taint as on every GPU node."""
    from ray_train_eks.workload.serving import gpu_group

    capacity = karpenter_platform.stack.gpu_capacity
    serving = _concrete(karpenter_platform.stack.resolve(capacity.serving_pool), karpenter_platform.template)
    validate(serving, crd_schemas)
    assert serving["metadata"]["name"] == "gpu-efa-serving"
    spec = serving["spec"]
    assert spec["limits"] == {"nvidia.com/gpu": "4"}  # 1 node x 4 L4
    assert spec["template"]["spec"]["nodeClassRef"]["name"] == "gpu-efa"
    assert {r["key"]: r["values"] for r in spec["template"]["spec"]["requirements"]}["karpenter.sh/capacity-type"] == ["on-demand"]
    labels = spec["template"]["metadata"]["labels"]
    assert labels == {"nvidia.com/gpu.present": "true", "ray-train-eks/node-role": "gpu-serving"}
    training = karpenter_platform.stack.resolve(capacity.node_pool)["spec"]["template"]["metadata"]["labels"]
    workload = karpenter_platform.stack.ray_workload.spec
    serving_pods = gpu_group(workload, "chat")["template"]["spec"]["nodeSelector"]
    _, job = karpenter_platform.ray_job()
    training_pods = job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["nodeSelector"]
    assert serving_pods.items() <= labels.items() and not serving_pods.items() <= training.items()
    assert training_pods.items() <= training.items() and not training_pods.items() <= labels.items()
    assert karpenter_platform.stack.node.try_find_child("GpuCapacity").node.try_find_child("ServingNodePool") is not None
