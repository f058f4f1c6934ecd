"""The last step of a Karpenter-mode destroy: whatever Karpenter launched for this cluster and a
failed delete left (instances, launch templates, instance profiles) is found by Karpenter's own
tags and path and removed, against botocore's Stubber (the calls, their filters, their order);
and in the template it runs after every Karpenter object and before what those instances use."""

from __future__ import annotations

import boto3
import pytest
from botocore.stub import ANY, Stubber

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


def test_a_delete_terminates_the_clusters_karpenter_instances_then_its_templates_and_profiles(monkeypatch):
    monkeypatch.setattr(karpenter_leftovers, "POLL_SECONDS", 0)
    ec2, iam = _clients()
    with Stubber(ec2) as ec2_stub, Stubber(iam) as iam_stub:
        ec2_stub.add_response("describe_instances", {"Reservations": [{"Instances": [{"InstanceId": "i-2"}, {"InstanceId": "i-1"}]}]},
                              {"Filters": INSTANCE_FILTERS})
        ec2_stub.add_response("terminate_instances", {}, {"InstanceIds": ["i-1", "i-2"]})
        shutting = {"Reservations": [{"Instances": [{"InstanceId": i, "State": {"Name": "shutting-down", "Code": 32}}
                                                    for i in ("i-1", "i-2")]}]}
        gone = {"Reservations": [{"Instances": [{"InstanceId": i, "State": {"Name": "terminated", "Code": 48}}
                                                for i in ("i-1", "i-2")]}]}
        ec2_stub.add_response("describe_instances", shutting, {"InstanceIds": ["i-1", "i-2"]})
        ec2_stub.add_response("describe_instances", gone, {"InstanceIds": ["i-1", "i-2"]})
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
        assert karpenter_leftovers.on_event(_event("Delete"), ec2=ec2, iam=iam) == {
            "PhysicalResourceId": f"karpenter-leftovers:{CLUSTER}"}
        ec2_stub.assert_no_pending_responses()
        iam_stub.assert_no_pending_responses()


def test_nothing_left_is_nothing_to_do_and_create_touches_nothing():
    ec2, iam = _clients()
    with Stubber(ec2) as ec2_stub, Stubber(iam) as iam_stub:
        assert karpenter_leftovers.on_event(_event("Create"), ec2=ec2, iam=iam)["PhysicalResourceId"].endswith(CLUSTER)
        ec2_stub.add_response("describe_instances", {"Reservations": []}, {"Filters": INSTANCE_FILTERS})
        ec2_stub.add_response("describe_launch_templates", {"LaunchTemplates": []}, {"Filters": TEMPLATE_FILTERS})
        iam_stub.add_response("list_instance_profiles", {"InstanceProfiles": []}, {"PathPrefix": PATH})
        karpenter_leftovers.on_event(_event("Delete"), ec2=ec2, iam=iam)
        ec2_stub.assert_no_pending_responses()


def test_an_instance_that_will_not_terminate_fails_the_delete_naming_it(monkeypatch):
    from botocore.exceptions import WaiterError

    monkeypatch.setattr(karpenter_leftovers, "POLL_SECONDS", 0)
    ec2, iam = _clients()
    with Stubber(ec2) as ec2_stub, Stubber(iam):
        ec2_stub.add_response("describe_instances", {"Reservations": [{"Instances": [{"InstanceId": "i-1"}]}]},
                              {"Filters": INSTANCE_FILTERS})
        ec2_stub.add_response("terminate_instances", {}, {"InstanceIds": ["i-1"]})
        stuck = {"Reservations": [{"Instances": [{"InstanceId": "i-1", "State": {"Name": "shutting-down", "Code": 32}}]}]}
        for _ in range(2):
            ec2_stub.add_response("describe_instances", stuck, {"InstanceIds": ANY})
        with pytest.raises(WaiterError, match="i-1|Max attempts"):
            karpenter_leftovers.on_event({**_event("Delete"), "ResourceProperties": {
                "ClusterName": CLUSTER, "Region": REGION, "WaitSeconds": "1"}}, ec2=ec2, iam=iam)


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
