"""Fine-grained assertions on the synthesized platform, one behaviour per test."""

from __future__ import annotations

import json

import pytest
import yaml
from aws_cdk.assertions import Match, Template


pytestmark = pytest.mark.synth


@pytest.fixture(scope="module")
def template(default_platform) -> Template:
    return Template.from_json(default_platform.template)


# --------------------------------------------------------------------- network

def test_vpc_spans_two_azs_with_one_nat_gateway(template, default_platform):
    template.resource_count_is("AWS::EC2::VPC", 1)
    template.resource_count_is("AWS::EC2::NatGateway", 1)
    subnets = default_platform.resources("AWS::EC2::Subnet")
    assert len(subnets) == 4  # public and private in each of two AZs
    azs = {str(s["Properties"]["AvailabilityZone"]) for s in subnets.values()}
    assert len(azs) == 2


def test_vpc_has_flow_logs(template):
    template.has_resource_properties("AWS::EC2::FlowLog", {"ResourceType": "VPC", "TrafficType": "ALL"})


def test_gpu_nodes_use_one_private_subnet(default_platform):
    nodegroup = _gpu_nodegroup(default_platform)
    subnets = nodegroup["Properties"]["Subnets"]
    assert len(subnets) == 1
    assert "Private" in subnets[0]["Ref"]


def test_pinned_azs_are_used_without_lookup(p4d_platform):
    azs = {s["Properties"]["AvailabilityZone"] for s in p4d_platform.resources("AWS::EC2::Subnet").values()}
    assert azs == {"us-east-1b", "us-east-1c"}
    gpu_subnet = _gpu_nodegroup(p4d_platform)["Properties"]["Subnets"][0]["Ref"]
    assert p4d_platform.template["Resources"][gpu_subnet]["Properties"]["AvailabilityZone"] == "us-east-1b"


# --------------------------------------------------------------------- cluster

def test_cluster_runs_kubernetes_1_36_with_matching_kubectl_layer(template, default_platform):
    template.has_resource_properties("AWS::EKS::Cluster", {"Version": "1.36"})
    layers = default_platform.resources("AWS::Lambda::LayerVersion")
    assert any("kubectl" in str(v["Properties"].get("Description", "")).lower() for v in layers.values())


def test_cluster_uses_managed_node_groups_not_auto_mode(default_platform):
    cluster = default_platform.one("AWS::EKS::Cluster")["Properties"]
    assert not cluster.get("ComputeConfig", {}).get("Enabled", False)
    assert len(default_platform.resources("AWS::EKS::Nodegroup")) == 2


def test_admin_role_gets_a_cluster_admin_access_entry(template):
    template.has_resource_properties(
        "AWS::EKS::AccessEntry",
        {
            "PrincipalArn": "arn:aws:iam::123456789012:role/Admin",
            "AccessPolicies": [
                Match.object_like({"AccessScope": {"Type": "cluster"}, "PolicyArn": Match.any_value()})
            ],
        },
    )


@pytest.mark.parametrize("addon", ["vpc-cni", "coredns", "kube-proxy", "eks-pod-identity-agent"])
def test_eks_addons_are_installed(template, addon):
    template.has_resource_properties("AWS::EKS::Addon", {"AddonName": addon})


def test_system_node_group_is_on_demand_al2023_m7i(default_platform):
    system = _system_nodegroup(default_platform)["Properties"]
    assert system["InstanceTypes"] == ["m7i.xlarge"]
    assert system["AmiType"] == "AL2023_x86_64_STANDARD"
    assert system["CapacityType"] == "ON_DEMAND"
    assert system["Labels"] == {"ray-train-eks/node-role": "system"}


def test_system_nodes_have_room_for_the_dlc_image_of_the_head_and_submitter(default_platform):
    ref = _system_nodegroup(default_platform)["Properties"]["LaunchTemplate"]["Id"]["Ref"]
    (device,) = default_platform.template["Resources"][ref]["Properties"]["LaunchTemplateData"]["BlockDeviceMappings"]
    assert device["Ebs"]["VolumeSize"] == 100


# --------------------------------------------------------------------- GPU nodes

def test_gpu_node_group_is_al2023_nvidia_labelled_and_tainted(default_platform):
    gpu = _gpu_nodegroup(default_platform)["Properties"]
    assert "InstanceTypes" not in gpu  # in the launch template, see EfaNodeGroup
    assert _gpu_launch_template(default_platform)["InstanceType"] == "g6.12xlarge"
    assert gpu["AmiType"] == "AL2023_x86_64_NVIDIA"
    assert gpu["ScalingConfig"] == {"MinSize": 2, "DesiredSize": 2, "MaxSize": 2}
    assert gpu["Labels"]["nvidia.com/gpu.present"] == "true"
    assert gpu["Taints"] == [{"Key": "nvidia.com/gpu", "Value": "true", "Effect": "NO_SCHEDULE"}]


def test_g6_12xlarge_gets_one_efa_interface_with_both_security_groups(default_platform):
    interfaces = _gpu_launch_template(default_platform)["NetworkInterfaces"]
    assert len(interfaces) == 1
    assert interfaces[0]["InterfaceType"] == "efa"
    assert (interfaces[0]["DeviceIndex"], interfaces[0]["NetworkCardIndex"]) == (0, 0)
    groups = interfaces[0]["Groups"]
    assert {"Fn::GetAtt": [_cluster_id(default_platform), "ClusterSecurityGroupId"]} in groups
    assert {"Fn::GetAtt": [_efa_group_id(default_platform), "GroupId"]} in groups


def test_p4d_gets_four_efa_interfaces_one_per_network_card(p4d_platform):
    interfaces = _gpu_launch_template(p4d_platform)["NetworkInterfaces"]
    assert [(i["NetworkCardIndex"], i["DeviceIndex"], i["InterfaceType"]) for i in interfaces] == [
        (0, 0, "efa"), (1, 1, "efa"), (2, 1, "efa"), (3, 1, "efa"),
    ]
    assert _gpu_nodegroup(p4d_platform)["Properties"]["ScalingConfig"]["DesiredSize"] == 3


def test_efa_security_group_allows_all_traffic_from_and_to_itself_and_no_other_egress(default_platform):
    group = _efa_group_id(default_platform)
    ingress = default_platform.one("AWS::EC2::SecurityGroupIngress")["Properties"]
    egress = default_platform.one("AWS::EC2::SecurityGroupEgress")["Properties"]
    assert ingress["IpProtocol"] == "-1" and ingress["SourceSecurityGroupId"] == {"Fn::GetAtt": [group, "GroupId"]}
    assert egress["IpProtocol"] == "-1" and egress["DestinationSecurityGroupId"] == {"Fn::GetAtt": [group, "GroupId"]}
    # Without an inline egress rule EC2 gives a new group allow-all egress; this one matches nothing.
    (inline,) = default_platform.template["Resources"][group]["Properties"]["SecurityGroupEgress"]
    assert (inline["CidrIp"], inline["IpProtocol"], inline["FromPort"], inline["ToPort"]) == ("255.255.255.255/32", "icmp", 252, 86)


def test_gpu_nodes_sit_in_a_cluster_placement_group(template, default_platform):
    template.has_resource_properties("AWS::EC2::PlacementGroup", {"Strategy": "cluster"})
    placement_id = next(iter(default_platform.resources("AWS::EC2::PlacementGroup")))
    assert _gpu_launch_template(default_platform)["Placement"] == {"GroupName": {"Fn::GetAtt": [placement_id, "GroupName"]}}


def test_capacity_reservations_are_targeted_without_our_placement_group(p4d_platform):
    data = _gpu_launch_template(p4d_platform)
    (group_id,) = p4d_platform.resources("AWS::ResourceGroups::Group")
    assert data["CapacityReservationSpecification"] == {
        "CapacityReservationPreference": "capacity-reservations-only",
        "CapacityReservationTarget": {"CapacityReservationResourceGroupArn": {"Fn::GetAtt": [group_id, "Arn"]}}
    }
    assert "Placement" not in data
    assert not p4d_platform.resources("AWS::EC2::PlacementGroup")


def _user_data_node_configs(data: dict) -> list[dict]:
    """The nodeadm NodeConfigs of a launch template's user data (``Fn::Base64`` of MIME
    multipart text), read back part by part as EKS merges them."""
    import email

    user_data = data["UserData"]["Fn::Base64"]
    assert user_data.isascii()  # Fn::Base64 encodes the text as it is
    message = email.message_from_string(user_data)
    assert message.is_multipart() and message.get_content_type() == "multipart/mixed"
    return [yaml.safe_load(part.get_payload()) for part in message.get_payload()
            if part.get_content_type() == "application/node.eks.aws"]


def test_gpu_nodes_keep_containerd_and_kubelet_on_their_nvme(default_platform):
    data = _gpu_launch_template(default_platform)
    (node_config,) = _user_data_node_configs(data)
    # The NodeConfig the GPU nodes boot with: SOCI's parallel pull and unpack (nodeadm's feature
    # gate), its state on the RAID0 with containerd's.
    assert node_config == {"apiVersion": "node.eks.aws/v1alpha1", "kind": "NodeConfig",
                           "spec": {"featureGates": {"FastImagePull": True},
                                    "instance": {"localStorage": {"strategy": "RAID0"}}}}
    # The root holds the OS only: 50 GiB at gp3's baseline.
    (device,) = data["BlockDeviceMappings"]
    assert (device["Ebs"]["VolumeSize"], device["Ebs"]["VolumeType"]) == (50, "gp3")
    assert "Throughput" not in device["Ebs"] and "Iops" not in device["Ebs"]
    # No custom AMI: EKS merges its own NodeConfig (cluster, endpoint, CA) with ours.
    assert "ImageId" not in data


def test_system_nodes_without_nvme_pull_the_image_with_throughput(default_platform, tmp_path):
    nodegroups = default_platform.resources("AWS::EKS::Nodegroup")
    (system,) = [n for k, n in nodegroups.items() if "SystemNodes" in k]
    data = default_platform.template["Resources"][system["Properties"]["LaunchTemplate"]["Id"]["Ref"]]["Properties"]["LaunchTemplateData"]
    (device,) = data["BlockDeviceMappings"]
    assert (device["Ebs"]["VolumeSize"], device["Ebs"]["Throughput"], device["Ebs"]["Iops"]) == (100, 400, 4000)
    assert "UserData" not in data  # m7i has no instance store

    from platform_synth import synth_platform

    with_nvme = synth_platform(tmp_path, {"systemInstanceType": "m6id.xlarge"})
    (system,) = [n for k, n in with_nvme.resources("AWS::EKS::Nodegroup").items() if "SystemNodes" in k]
    data = with_nvme.template["Resources"][system["Properties"]["LaunchTemplate"]["Id"]["Ref"]]["Properties"]["LaunchTemplateData"]
    assert _user_data_node_configs(data)[0]["spec"]["instance"]["localStorage"] == {"strategy": "RAID0"}
    assert data["BlockDeviceMappings"][0]["Ebs"]["VolumeSize"] == 50


# --------------------------------------------------------------------- Helm add-ons

def test_helm_charts_are_pinned(default_platform):
    charts = {c["Properties"]["Chart"]: c["Properties"] for c in default_platform.resources("Custom::AWSCDK-EKS-HelmChart").values()}
    assert {name: props["Version"] for name, props in charts.items()} == {
        "nvidia-device-plugin": "0.20.0",
        "aws-efa-k8s-device-plugin": "v0.5.30",
        "kuberay-operator": "1.7.0",
    }
    assert charts["kuberay-operator"]["Repository"] == "https://ray-project.github.io/kuberay-helm/"


def test_helm_timeouts_fit_inside_the_kubectl_lambda(default_platform):
    for chart in default_platform.resources("Custom::AWSCDK-EKS-HelmChart").values():
        assert chart["Properties"]["Timeout"] == "600s"
        assert chart["Properties"]["Wait"] is True


def test_nvidia_plugin_is_not_in_default_namespace_and_tolerates_the_taint(default_platform):
    props = _chart(default_platform, "nvidia-device-plugin")
    assert props["Namespace"] not in ("default", None)
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in _values(props)["tolerations"]
    assert _values(props)["mofedEnabled"] is False  # the EKS EFA guide's setting: no Mellanox OFED on EFA nodes


@pytest.mark.parametrize("chart", ["nvidia-device-plugin", "aws-efa-k8s-device-plugin", "kuberay-operator"])
def test_every_helm_value_we_set_is_a_key_of_the_pinned_chart(default_platform, chart):
    from upstream import chart_values

    upstream = chart_values(chart)
    ours = _values(_chart(default_platform, chart))
    assert ours and set(ours) <= set(upstream), set(ours) - set(upstream)
    for key, value in ours.items():
        if isinstance(value, dict) and isinstance(upstream[key], dict) and upstream[key]:
            assert set(value) <= set(upstream[key]), (key, set(value) - set(upstream[key]))


def test_efa_plugin_uses_the_regions_registry_and_tolerates_the_taint(default_platform, p4d_platform):
    values = _values(_chart(default_platform, "aws-efa-k8s-device-plugin"))
    assert values["image"]["repository"] == "602401143452.dkr.ecr.us-west-2.amazonaws.com/eks/aws-efa-k8s-device-plugin"
    assert values["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert values["supportedInstanceLabels"]["values"] == ["g6.12xlarge"]
    p4d_values = _values(_chart(p4d_platform, "aws-efa-k8s-device-plugin"))
    assert p4d_values["image"]["repository"].startswith("602401143452.dkr.ecr.us-east-1.amazonaws.com/")


def test_kuberay_operator_runs_on_system_nodes(default_platform):
    values = _values(_chart(default_platform, "kuberay-operator"))
    assert values["nodeSelector"] == {"ray-train-eks/node-role": "system"}


def test_no_load_balancer_services_are_created(default_platform):
    """A LoadBalancer service leaves an ELB and ENIs that block cdk destroy."""
    text = str(default_platform.template)
    assert "LoadBalancer" not in text


# --------------------------------------------------------------------- storage

def test_bucket_is_encrypted_private_tls_only_versioned_and_retained(template, default_platform):
    template.has_resource(
        "AWS::S3::Bucket",
        {
            "DeletionPolicy": "Retain",
            "UpdateReplacePolicy": "Retain",
            "Properties": Match.object_like(
                {
                    "BucketEncryption": Match.any_value(),
                    "VersioningConfiguration": {"Status": "Enabled"},
                    "PublicAccessBlockConfiguration": {
                        "BlockPublicAcls": True, "BlockPublicPolicy": True, "IgnorePublicAcls": True, "RestrictPublicBuckets": True,
                    },
                }
            ),
        },
    )
    policy = default_platform.one("AWS::S3::BucketPolicy")["Properties"]["PolicyDocument"]["Statement"]
    assert any(s["Effect"] == "Deny" and s["Condition"] == {"Bool": {"aws:SecureTransport": "false"}} for s in policy)


def test_destroy_data_deletes_the_bucket(p4d_platform):
    bucket = p4d_platform.one("AWS::S3::Bucket")
    assert bucket["DeletionPolicy"] == "Delete"
    assert p4d_platform.resources("Custom::S3AutoDeleteObjects")


def test_ray_pods_get_a_pod_identity_role_for_the_bucket_only(default_platform):
    association = default_platform.one("AWS::EKS::PodIdentityAssociation")["Properties"]
    assert (association["Namespace"], association["ServiceAccount"]) == ("ray-train", "ray-train")
    role_id = association["RoleArn"]["Fn::GetAtt"][0]
    bucket_id = next(iter(default_platform.resources("AWS::S3::Bucket")))
    policies = [p for p in default_platform.resources("AWS::IAM::Policy").values() if {"Ref": role_id} in p["Properties"]["Roles"]]
    statements = [s for p in policies for s in p["Properties"]["PolicyDocument"]["Statement"]]
    metrics = [s for s in statements if s["Action"] == "cloudwatch:PutMetricData"]
    # PutMetricData has no resource-level permissions: the namespace condition is the scope.
    assert metrics == [{"Action": "cloudwatch:PutMetricData", "Effect": "Allow", "Resource": "*",
                        "Condition": {"StringEquals": {"cloudwatch:namespace": "RayTrainEks/Training"}}}]
    # The MLflow App's data-plane actions, on that App only (constructs/tracking.py MLFLOW_APP_ACTIONS).
    from ray_train_eks.constructs.tracking import MLFLOW_APP_ACTIONS

    (app_id,) = default_platform.resources("AWS::SageMaker::MlflowApp")
    tracking = [s for s in statements if "sagemaker:CallMlflowAppApi" in _as_list(s["Action"])]
    assert tracking == [{"Action": list(MLFLOW_APP_ACTIONS), "Effect": "Allow", "Resource": {"Fn::GetAtt": [app_id, "Arn"]}}]
    # A run's end and its faults, published to the alarm's topic (encrypted: a data key of its key).
    (topic_id,) = default_platform.resources("AWS::SNS::Topic")
    topic_key = default_platform.one("AWS::SNS::Topic")["Properties"]["KmsMasterKeyId"]
    notify = [s for s in statements if s["Action"] == "sns:Publish" or "kms:GenerateDataKey" in _as_list(s["Action"])]
    assert notify == [{"Action": "sns:Publish", "Effect": "Allow", "Resource": {"Ref": topic_id}},
                      {"Action": ["kms:GenerateDataKey", "kms:Decrypt"], "Effect": "Allow", "Resource": topic_key}]
    for statement in statements:
        if statement in metrics or statement in tracking or statement in notify:
            continue
        assert all("*" not in action for action in _as_list(statement["Action"]))
        assert bucket_id in str(statement["Resource"])
    role = default_platform.template["Resources"][role_id]["Properties"]
    assert "ManagedPolicyArns" not in role
    assert "pods.eks.amazonaws.com" in str(role["AssumeRolePolicyDocument"])


# --------------------------------------------------------------------- Ray workload

def test_rayjob_is_applied_after_kuberay_and_the_service_account(default_platform):
    job_id, _ = default_platform.ray_job()
    depends = default_platform.template["Resources"][job_id]["DependsOn"]
    kuberay = [k for k, v in default_platform.resources("Custom::AWSCDK-EKS-HelmChart").items() if v["Properties"]["Chart"] == "kuberay-operator"]
    assert set(kuberay) <= set(depends)
    assert any("RayServiceAccount" in d for d in depends)
    assert "aws.cdk.eks/prune" not in json.dumps(default_platform.manifests()[job_id])  # exactly what dist/ holds


def test_rayjob_manifest_is_the_dist_object(default_platform):
    import yaml

    _, job = default_platform.ray_job()
    dist = list(yaml.safe_load_all((default_platform.outdir.parent / "dist" / "ray-workload-job.k8s.yaml").read_text()))
    assert job == dist[-1]  # after the training code and the job's NetworkPolicies


def test_gpu_workers_publish_training_metrics_to_our_namespace_in_the_stacks_region(default_platform):
    _, job = default_platform.ray_job()
    env = {e["name"]: e.get("value") for e in job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["env"]}
    assert (env["RAY_TRAIN_EKS_METRICS_NAMESPACE"], env["AWS_REGION"]) == ("RayTrainEks/Training", "us-west-2")


def test_settings_configmap_carries_the_bucket_name(default_platform):
    (settings,) = [r for r in default_platform.resources("Custom::AWSCDK-EKS-KubernetesResource").values()
                   if isinstance(r["Properties"]["Manifest"], dict) and 'ray-train-eks-settings' in json.dumps(r["Properties"]["Manifest"])]
    bucket_id = next(iter(default_platform.resources("AWS::S3::Bucket")))
    assert {"Ref": bucket_id} in settings["Properties"]["Manifest"]["Fn::Join"][1]


def test_run_job_false_deploys_no_rayjob(tmp_path):
    from platform_synth import synth_platform

    platform = synth_platform(tmp_path, {"runJob": "false", "workload": "cluster", "shutdownAfterJobFinishes": "false",
                                         "ttlSecondsAfterFinished": "0"})
    kinds = [o["kind"] for objects in platform.manifests().values() for o in objects]
    assert "RayJob" not in kinds and "RayCluster" in kinds


# --------------------------------------------------------------------- outputs

def test_outputs_name_cluster_kubeconfig_bucket_and_cost(default_platform):
    outputs = default_platform.template["Outputs"]
    assert {"ClusterName", "UpdateKubeconfigCommand", "BucketName", "EstimatedCostUsdPerHour"} <= set(outputs)
    assert outputs["EstimatedCostUsdPerHour"]["Value"] == "9.64"  # 9.55 of instances, NAT, control plane; 0.09 Container Insights
    assert "aws eks update-kubeconfig --region us-west-2 --name" in str(outputs["UpdateKubeconfigCommand"]["Value"])


# --------------------------------------------------------------------- helpers

def _as_list(value):
    return value if isinstance(value, list) else [value]


def _nodegroup(platform, role: str) -> dict:
    (found,) = [n for n in platform.resources("AWS::EKS::Nodegroup").values() if n["Properties"]["Labels"].get("ray-train-eks/node-role") == role]
    return found


def _gpu_nodegroup(platform) -> dict:
    return _nodegroup(platform, "gpu")


def _system_nodegroup(platform) -> dict:
    return _nodegroup(platform, "system")


def _gpu_launch_template(platform) -> dict:
    ref = _gpu_nodegroup(platform)["Properties"]["LaunchTemplate"]["Id"]["Ref"]
    return platform.template["Resources"][ref]["Properties"]["LaunchTemplateData"]


def _cluster_id(platform) -> str:
    return next(iter(platform.resources("AWS::EKS::Cluster")))


def _efa_group_id(platform) -> str:
    (found,) = [k for k, v in platform.resources("AWS::EC2::SecurityGroup").items() if "EFA" in v["Properties"]["GroupDescription"]]
    return found


def _chart(platform, name: str) -> dict:
    (found,) = [c["Properties"] for c in platform.resources("Custom::AWSCDK-EKS-HelmChart").values() if c["Properties"]["Chart"] == name]
    return found


def _values(props: dict) -> dict:
    import json

    values = props["Values"]
    if isinstance(values, dict) and "Fn::Join" in values:
        values = "".join(part if isinstance(part, str) else "" for part in values["Fn::Join"][1])
    return json.loads(values)
