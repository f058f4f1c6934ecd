"""The last step of a Karpenter-mode destroy: whatever Karpenter launched for this cluster and a
failed delete left (instances, launch templates, instance profiles) is found by Karpenter's own
tags and path and removed, against botocore's Stubber (the calls, their filters, their order);
and in the template it runs after every Karpenter object and before what those instances use."""

from __future__ import annotations

import boto3
import pytest
from botocore.stub import Stubber

from ray_train_eks.handlers import karpenter_leftovers

CLUSTER, REGION = "ray-train-eks", "us-west-2"
INSTANCE_FILTERS = [{"Name": "tag:eks:eks-cluster-name", "Values": [CLUSTER]}, {"Name": "tag-key", "Values": ["karpenter.sh/nodepool"]},
                    {"Name": "instance-state-name", "Values": ["pending", "running", "stopping", "stopped", "shutting-down"]}]
TEMPLATE_FILTERS = [{"Name": "tag:eks:eks-cluster-name", "Values": [CLUSTER]},
                    {"Name": "tag-key", "Values": ["karpenter.k8s.aws/ec2nodeclass"]}]
PATH = f"/karpenter/{REGION}/{CLUSTER}/"


def _event(kind: str) -> dict:
    return {"RequestType": kind, "PhysicalResourceId": f"karpenter-leftovers:{CLUSTER}",
            "ResourceProperties": {"ClusterName": CLUSTER, "Region": REGION, "WaitSeconds": "30"}}


def _clients():
    ec2 = boto3.client("ec2", region_name=REGION, aws_access_key_id="x", aws_secret_access_key="x")
    iam = boto3.client("iam", region_name=REGION, aws_access_key_id="x", aws_secret_access_key="x")
    return ec2, iam


class FakeClock:
    """Time that passes only when the handler sleeps."""

    def __init__(self):
        self.now, self.sleeps = 0.0, []

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds


def _states(*pairs):
    return {"Reservations": [{"Instances": [{"InstanceId": i, "State": {"Name": state, "Code": 0}} for i, state in pairs]}]}


def _by_id(ids):
    return {"Filters": [{"Name": "instance-id", "Values": ids}]}


def test_a_delete_terminates_the_clusters_karpenter_instances_then_its_templates_and_profiles():
    clock = FakeClock()
    ec2, iam = _clients()
    with Stubber(ec2) as ec2_stub, Stubber(iam) as iam_stub:
        ec2_stub.add_response("describe_instances", {"Reservations": [{"Instances": [{"InstanceId": "i-2"}, {"InstanceId": "i-1"}]}]},
                              {"Filters": INSTANCE_FILTERS})
        ec2_stub.add_response("terminate_instances", {}, {"InstanceIds": ["i-1", "i-2"]})
        # A just-terminated instance can read pending or stopping for a moment: boto3's
        # instance_terminated waiter fails on those at once; the poll goes on.
        ec2_stub.add_response("describe_instances", _states(("i-1", "pending"), ("i-2", "stopping")), _by_id(["i-1", "i-2"]))
        ec2_stub.add_response("describe_instances", _states(("i-1", "shutting-down"), ("i-2", "terminated")),
                              _by_id(["i-1", "i-2"]))
        ec2_stub.add_response("describe_instances", _states(("i-2", "terminated")), _by_id(["i-1", "i-2"]))  # i-1 gone
        ec2_stub.add_response("describe_launch_templates", {"LaunchTemplates": [{"LaunchTemplateId": "lt-1"}]},
                              {"Filters": TEMPLATE_FILTERS})
        ec2_stub.add_response("delete_launch_template", {}, {"LaunchTemplateId": "lt-1"})
        profile = {"Path": PATH + "uid/", "InstanceProfileName": f"{CLUSTER}_123", "InstanceProfileId": "AIPA0000000000000000",
                   "Arn": "arn:aws:iam::111122223333:instance-profile/x", "CreateDate": "2026-12-01T00:00:00Z",
                   "Roles": [{"Path": "/", "RoleName": "KarpenterNodeRole", "RoleId": "AROA0000000000000000",
                              "Arn": "arn:aws:iam::111122223333:role/KarpenterNodeRole", "CreateDate": "2026-12-01T00:00:00Z"}]}
        iam_stub.add_response("list_instance_profiles", {"InstanceProfiles": [profile]}, {"PathPrefix": PATH})
        iam_stub.add_response("remove_role_from_instance_profile", {},
                              {"InstanceProfileName": f"{CLUSTER}_123", "RoleName": "KarpenterNodeRole"})
        iam_stub.add_response("delete_instance_profile", {}, {"InstanceProfileName": f"{CLUSTER}_123"})
        assert karpenter_leftovers.on_event(_event("Delete"), ec2=ec2, iam=iam, sleep=clock.sleep, clock=clock) == {
            "PhysicalResourceId": f"karpenter-leftovers:{CLUSTER}"}
        ec2_stub.assert_no_pending_responses()
        iam_stub.assert_no_pending_responses()
    assert clock.sleeps == [karpenter_leftovers.POLL_SECONDS] * 2


def test_nothing_left_is_nothing_to_do_and_create_touches_nothing():
    ec2, iam = _clients()
    with Stubber(ec2) as ec2_stub, Stubber(iam) as iam_stub:
        assert karpenter_leftovers.on_event(_event("Create"), ec2=ec2, iam=iam)["PhysicalResourceId"].endswith(CLUSTER)
        ec2_stub.add_response("describe_instances", {"Reservations": []}, {"Filters": INSTANCE_FILTERS})
        ec2_stub.add_response("describe_launch_templates", {"LaunchTemplates": []}, {"Filters": TEMPLATE_FILTERS})
        iam_stub.add_response("list_instance_profiles", {"InstanceProfiles": []}, {"PathPrefix": PATH})
        karpenter_leftovers.on_event(_event("Delete"), ec2=ec2, iam=iam)
        ec2_stub.assert_no_pending_responses()


def test_an_instance_that_will_not_terminate_fails_the_delete_naming_it():
    clock = FakeClock()
    ec2, iam = _clients()
    with Stubber(ec2) as ec2_stub, Stubber(iam):
        ec2_stub.add_response("describe_instances", {"Reservations": [{"Instances": [{"InstanceId": "i-1"}]}]},
                              {"Filters": INSTANCE_FILTERS})
        ec2_stub.add_response("terminate_instances", {}, {"InstanceIds": ["i-1"]})
        for _ in range(3):  # at 0, 15 and 30 s: the deadline is 30 s
            ec2_stub.add_response("describe_instances", _states(("i-1", "shutting-down")), _by_id(["i-1"]))
        with pytest.raises(RuntimeError, match=r"1 GPU instance\(s\) not terminated after 30 s: i-1 \(shutting-down\); "
                                               "terminate them in the EC2 console"):
            karpenter_leftovers.on_event(_event("Delete"), ec2=ec2, iam=iam, sleep=clock.sleep, clock=clock)
        ec2_stub.assert_no_pending_responses()


@pytest.mark.synth
def test_the_clean_up_runs_after_every_karpenter_object_and_before_what_its_instances_use(karpenter_platform):
    resources = karpenter_platform.template["Resources"]

    def depends(logical_id: str) -> set[str]:
        return set(resources[logical_id].get("DependsOn", []))

    (cleanup,) = [k for k, r in resources.items() if r["Type"] == "AWS::CloudFormation::CustomResource"
                  and "ClusterName" in r["Properties"] and "LeftoverCleanup" in k]
    (crds,) = [k for k, r in resources.items() if r["Type"] == "Custom::AWSCDK-EKS-HelmChart"
               and r["Properties"]["Chart"] == "karpenter-crd"]
    assert cleanup in depends(crds)  # the CRDs, the controller and the manifests go first
    kinds = {resources[k]["Type"] for k in depends(cleanup)}
    assert {"AWS::EC2::SecurityGroup", "AWS::EC2::PlacementGroup", "AWS::IAM::Role", "AWS::EC2::Subnet"} <= kinds


@pytest.mark.synth
@pytest.mark.parametrize("mode", ["default", "karpenter"])
def test_the_ray_namespace_goes_before_the_kuberay_operator(default_platform, karpenter_platform, mode):
    # A RayJob keeps ray.io/rayjob-finalizer until the operator removes it: without the operator
    # the namespace would never finish terminating, and the GPU capacity deleted after it would bill.
    resources = (default_platform if mode == "default" else karpenter_platform).template["Resources"]
    (namespace,) = [k for k, r in resources.items() if r["Type"] == "Custom::AWSCDK-EKS-KubernetesResource"
                    and '"kind":"Namespace"' in str(r["Properties"].get("Manifest", "")).replace(" ", "")
                    and "ray-train" in str(r["Properties"]["Manifest"])]
    (kuberay,) = [k for k, r in resources.items() if r["Type"] == "Custom::AWSCDK-EKS-HelmChart"
                  and r["Properties"]["Chart"] == "kuberay-operator"]
    assert kuberay in resources[namespace].get("DependsOn", [])


# --------------------------------------------------------------------- network interfaces left by the VPC CNI

EFA_GROUP, CLUSTER_GROUP = "sg-0efa", "sg-0c1uster"


def _eni(eni_id, status, group=EFA_GROUP, **attachment):
    eni = {"NetworkInterfaceId": eni_id, "Status": status, "Groups": [{"GroupId": group, "GroupName": group}],
           "Description": "aws-K8S-i-0abc"}
    if attachment:
        eni["Attachment"] = attachment
    return eni


def _enis(*enis):
    return {"NetworkInterfaces": list(enis)}


ENI_FILTERS = {"Filters": [{"Name": "group-id", "Values": sorted([EFA_GROUP, CLUSTER_GROUP])}]}
ENI_EVENT = {"RequestType": "Delete", "PhysicalResourceId": "network-leftovers",
             "ResourceProperties": {"Region": REGION, "SecurityGroupIds": [EFA_GROUP, CLUSTER_GROUP],
                                    "EmptyGroupIds": [EFA_GROUP], "WaitSeconds": "20"}}


def test_a_delete_removes_the_interfaces_left_available_and_waits_for_those_still_detaching():
    from ray_train_eks.handlers import network_leftovers

    clock = FakeClock()
    ec2, _ = _clients()
    control_plane = _eni("eni-cp", "in-use", CLUSTER_GROUP, InstanceOwnerId="amazon-aws")  # EKS's: left alone
    with Stubber(ec2) as stub:
        stub.add_response("describe_network_interfaces",
                          _enis(_eni("eni-1", "available"), _eni("eni-2", "in-use", InstanceId="i-gone"), control_plane),
                          ENI_FILTERS)
        stub.add_response("delete_network_interface", {}, {"NetworkInterfaceId": "eni-1"})
        stub.add_response("describe_network_interfaces", _enis(_eni("eni-2", "available"), control_plane), ENI_FILTERS)
        stub.add_response("delete_network_interface", {}, {"NetworkInterfaceId": "eni-2"})
        assert network_leftovers.on_event(ENI_EVENT, ec2=ec2, sleep=clock.sleep, clock=clock) == {
            "PhysicalResourceId": "network-leftovers"}
        stub.assert_no_pending_responses()
    assert clock.sleeps == [network_leftovers.POLL_SECONDS]


def test_an_interface_that_stays_in_use_fails_the_delete_naming_what_holds_it():
    from ray_train_eks.handlers import network_leftovers

    clock = FakeClock()
    ec2, _ = _clients()
    with Stubber(ec2) as stub:
        for _ in range(3):  # at 0, 10 and 20 s
            stub.add_response("describe_network_interfaces", _enis(_eni("eni-9", "in-use", InstanceId="i-0live")), ENI_FILTERS)
        with pytest.raises(RuntimeError, match=r"eni-9 \(in-use, attached to i-0live: aws-K8S-i-0abc\)\. Terminate or "
                                               "detach what holds them"):
            network_leftovers.on_event(ENI_EVENT, ec2=ec2, sleep=clock.sleep, clock=clock)


@pytest.mark.synth
@pytest.mark.parametrize("mode", ["default", "karpenter"])
def test_the_interfaces_go_after_the_gpu_capacity_and_before_its_group_and_subnet(default_platform, karpenter_platform, mode):
    platform = default_platform if mode == "default" else karpenter_platform
    resources = platform.template["Resources"]
    (cleanup,) = [k for k, r in resources.items() if r["Type"] == "AWS::CloudFormation::CustomResource"
                  and "EmptyGroupIds" in r["Properties"]]
    kinds = {resources[k]["Type"] for k in resources[cleanup].get("DependsOn", [])}
    assert {"AWS::EC2::SecurityGroup", "AWS::EC2::Subnet"} <= kinds  # deleted before them
    capacity = "AWS::EKS::Nodegroup" if mode == "default" else "AWS::CloudFormation::CustomResource"
    after = [k for k, r in resources.items() if cleanup in r.get("DependsOn", []) and r["Type"] == capacity]
    assert after  # the node group (or Karpenter's leftover clean-up) is deleted first
    group = resources[cleanup]["Properties"]["EmptyGroupIds"]
    assert len(group) == 1 and "EfaSecurityGroup" in group[0]["Fn::GetAtt"][0]


# --------------------------------------------------------------------- what GuardDuty's automated agent leaves in the VPC

VPC = "vpc-0abc"
GD_EVENT = {"RequestType": "Delete", "PhysicalResourceId": "guardduty-leftovers",
            "ResourceProperties": {"Region": REGION, "VpcId": VPC, "WaitSeconds": "30"}}
GD_ENDPOINTS = {"Filters": [{"Name": "vpc-id", "Values": [VPC]}, {"Name": "tag:GuardDutyManaged", "Values": ["true"]}]}
GD_GROUPS = {"Filters": [{"Name": "vpc-id", "Values": [VPC]}]}


def test_a_destroy_deletes_guarddutys_endpoint_then_its_group_once_its_interfaces_detach():
    """As GuardDuty's automated agent leaves them (its tag on the endpoint, its group's name): the
    endpoint is deleted, the group's delete meets DependencyViolation while the endpoint's interfaces
    detach, and goes through on a later try."""
    from ray_train_eks.handlers import guardduty_leftovers

    clock = FakeClock()
    ec2, _ = _clients()
    with Stubber(ec2) as stub:
        stub.add_response("describe_vpc_endpoints", {"VpcEndpoints": [
            {"VpcEndpointId": "vpce-0gd", "State": "available", "ServiceName": f"com.amazonaws.{REGION}.guardduty-data"}]},
            GD_ENDPOINTS)
        stub.add_response("delete_vpc_endpoints", {"Unsuccessful": []}, {"VpcEndpointIds": ["vpce-0gd"]})
        stub.add_response("describe_security_groups", {"SecurityGroups": [
            {"GroupId": "sg-0efa", "GroupName": "RayTrainEks-EfaSecurityGroup"},  # ours: CloudFormation deletes it
            {"GroupId": "sg-0gd", "GroupName": f"GuardDutyManagedSecurityGroup-{VPC}",
             "Tags": [{"Key": "GuardDutyManaged", "Value": "true"}]}]}, GD_GROUPS)
        stub.add_client_error("delete_security_group", "DependencyViolation", "resource sg-0gd has a dependent object",
                              expected_params={"GroupId": "sg-0gd"})
        stub.add_response("delete_security_group", {}, {"GroupId": "sg-0gd"})
        assert guardduty_leftovers.on_event(GD_EVENT, ec2=ec2, sleep=clock.sleep, clock=clock) == {
            "PhysicalResourceId": "guardduty-leftovers"}
        stub.assert_no_pending_responses()
    assert clock.sleeps == [guardduty_leftovers.POLL_SECONDS]


def test_without_guardduty_the_cleanup_finds_nothing_and_a_stuck_group_is_named():
    from ray_train_eks.handlers import guardduty_leftovers

    clock = FakeClock()
    ec2, _ = _clients()
    with Stubber(ec2) as stub:
        stub.add_response("describe_vpc_endpoints", {"VpcEndpoints": []}, GD_ENDPOINTS)
        stub.add_response("describe_security_groups", {"SecurityGroups": []}, GD_GROUPS)
        assert guardduty_leftovers.on_event(GD_EVENT, ec2=ec2, sleep=clock.sleep, clock=clock)["PhysicalResourceId"]
    with Stubber(ec2) as stub:
        stub.add_response("describe_vpc_endpoints", {"VpcEndpoints": []}, GD_ENDPOINTS)
        stub.add_response("describe_security_groups", {"SecurityGroups": [
            {"GroupId": "sg-0gd", "GroupName": "x", "Tags": [{"Key": "GuardDutyManaged", "Value": "true"}]}]}, GD_GROUPS)
        for _ in range(4):  # at 0, 10, 20 and 30 s
            stub.add_client_error("delete_security_group", "DependencyViolation", "has a dependent object")
        with pytest.raises(RuntimeError, match="GuardDuty's security group sg-0gd .* could not be deleted"):
            guardduty_leftovers.on_event(GD_EVENT, ec2=ec2, sleep=clock.sleep, clock=clock)


@pytest.mark.synth
def test_guarddutys_leftovers_go_after_the_cluster_and_before_the_vpc(default_platform):
    resources = default_platform.template["Resources"]
    (cleanup,) = [k for k, r in resources.items() if r["Type"] == "AWS::CloudFormation::CustomResource"
                  and "VpcId" in r["Properties"] and "WaitSeconds" in r["Properties"]]
    kinds = {resources[k]["Type"] for k in resources[cleanup].get("DependsOn", [])}
    assert {"AWS::EC2::VPC", "AWS::EC2::Subnet"} <= kinds  # deleted before them
    assert [k for k, r in resources.items() if r["Type"] == "AWS::EKS::Cluster" and cleanup in r.get("DependsOn", [])]
