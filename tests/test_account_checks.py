"""The account checks in the template: the resource runs first (the VPC, and so the cluster,
depend on it), with the GPU node facts, and its function may read only what it needs."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.synth


def _checks(platform) -> tuple[str, dict]:
    ((key, resource),) = [(k, r) for k, r in platform.resources("AWS::CloudFormation::CustomResource").items()
                          if "QuotaCode" in r["Properties"]]
    return key, resource


def test_the_checks_get_the_gpu_nodes_facts(default_platform, karpenter_platform, p4d_platform):
    _, resource = _checks(default_platform)
    props = resource["Properties"]
    assert {k: v for k, v in props.items() if k not in ("ServiceToken", "AvailabilityZone")} == {
        "InstanceType": "g6.12xlarge", "InstanceCount": "2", "VcpusPerInstance": "48", "QuotaCode": "L-DB2E81BA",
        "QuotaName": "Running On-Demand G and VT instances", "KubernetesVersion": "1.36", "AmiRelease": ""}
    # The stack's first AZ, the GPU subnet's, known without the VPC.
    assert props["AvailabilityZone"] == {"Fn::Select": [0, {"Fn::GetAZs": ""}]}
    assert _checks(karpenter_platform)[1]["Properties"]["AmiRelease"] == "v20260714"  # Karpenter boots the pinned release
    p4d = _checks(p4d_platform)[1]["Properties"]
    assert (p4d["QuotaCode"], p4d["InstanceCount"], p4d["VcpusPerInstance"], p4d["AvailabilityZone"]) == (
        "L-417A185B", "3", "96", "us-east-1b")


def test_nothing_slow_is_built_before_the_checks_pass(default_platform):
    key, _ = _checks(default_platform)
    template = default_platform.template["Resources"]
    network = {k: r for k, r in template.items() if k.startswith("Network")}
    assert len(network) > 10 and all(key in r["DependsOn"] for r in network.values())
    # The cluster is built on the VPC's subnets, so after the checks too.
    cluster = template[default_platform.logical_id(default_platform.stack.training_cluster.cluster)]
    assert all(s["Ref"].startswith("NetworkPrivateSubnet") for s in cluster["Properties"]["ResourcesVpcConfig"]["SubnetIds"])


def test_the_checks_function_reads_one_quota_the_offerings_and_the_eks_ami_parameters(default_platform):
    policies = [p for k, p in default_platform.resources("AWS::IAM::Policy").items() if k.startswith("AccountChecksFunction")]
    (policy,) = policies
    statements = policy["Properties"]["PolicyDocument"]["Statement"]
    by_action = {json.dumps(s["Action"]): s["Resource"] for s in statements}
    quota = by_action['"servicequotas:GetServiceQuota"']
    assert quota["Fn::Join"][1][-1] == ":ec2/L-DB2E81BA"
    assert by_action['["servicequotas:GetAWSDefaultServiceQuota", "ec2:DescribeInstanceTypeOfferings"]'] == "*"
    ssm = by_action['["ssm:GetParameter", "ssm:GetParametersByPath"]']
    path = "::parameter/aws/service/eks/optimized-ami/1.36/amazon-linux-2023/x86_64/nvidia"
    assert [r["Fn::Join"][1][-1] for r in ssm] == [f":ssm:us-west-2{path}", f":ssm:us-west-2{path}/*"]
    assert all(not a.startswith(("ec2:Run", "ec2:Create", "iam:")) for s in statements for a in
               ([s["Action"]] if isinstance(s["Action"], str) else s["Action"]))


def test_skip_account_checks_builds_none(tmp_path):
    from platform_synth import synth_platform

    platform = synth_platform(tmp_path, {"skipAccountChecks": "true"})
    assert not [r for r in platform.resources("AWS::CloudFormation::CustomResource").values() if "QuotaCode" in r["Properties"]]
    assert platform.stack.account_checks is None
