"""The account checks in the template: the resource runs first (the VPC, and so the cluster,
depend on it), with the GPU node facts, and its function may read only what it needs."""

from __future__ import annotations

import json

import pytest

from ray_train_eks.instances import INSTANCE_TYPES

pytestmark = pytest.mark.synth


def _checks(platform) -> tuple[str, dict]:
    ((key, resource),) = [(k, r) for k, r in platform.resources("AWS::CloudFormation::CustomResource").items()
                          if "Quotas" in r["Properties"]]
    return key, resource


def test_the_checks_get_the_gpu_nodes_facts(default_platform, karpenter_platform, p4d_platform):
    _, resource = _checks(default_platform)
    props = resource["Properties"]
    assert {k: v for k, v in props.items() if k not in ("ServiceToken", "AvailabilityZone", "Quotas")} == {
        "InstanceType": "g6.12xlarge", "KubernetesVersion": "1.36", "AmiRelease": ""}
    # A create launches the nodes; the system node group's rolling update launches more first (twice
    # its AZs, the stack's two), told, not required of a create. The GPU node group updates with the
    # minimal strategy (terminate, then launch): no surge.
    assert json.loads(props["Quotas"]) == [
        {"Code": "L-DB2E81BA", "Name": "Running On-Demand G and VT instances", "Vcpus": 2 * 48, "Why": "2 x g6.12xlarge",
         "UpdateVcpus": 2 * 48, "UpdateWhy": "2 x g6.12xlarge"},
        {"Code": "L-1216C47A", "Name": "Running On-Demand Standard (A, C, D, H, I, M, R, T, Z) instances",
         "Vcpus": 1 * 4, "Why": "1 x m7i.xlarge system node(s)", "UpdateVcpus": (1 + 4) * 4,
         "UpdateWhy": "1 x m7i.xlarge system node(s) and the 4 a node-group update launches first"}]
    assert len(default_platform.stack.account_checks.update_notes) == 1  # the system nodes' surge: a warning at synth
    (nodegroup,) = [r for r in default_platform.resources("AWS::EKS::Nodegroup").values()
                    if r["Properties"].get("Taints")]  # the GPU node group
    assert nodegroup["Properties"]["UpdateConfig"] == {"MaxUnavailable": 1, "UpdateStrategy": "MINIMAL"}
    outputs = default_platform.template["Outputs"]
    assert outputs["QuotaForUpdates"]["Value"]["Fn::GetAtt"][1] == "UpdateNeeds"
    # The stack's first AZ, the GPU subnet's, known without the VPC.
    assert props["AvailabilityZone"] == {"Fn::Select": [0, {"Fn::GetAZs": ""}]}
    karpenter = _checks(karpenter_platform)[1]["Properties"]
    assert karpenter["AmiRelease"] == "v20260714"  # Karpenter boots the pinned release
    # No rolling update (drift replaces no running node); room for one replacement while a node a
    # training worker took out of the run (a broken GPU) still stands.
    assert [json.loads(karpenter["Quotas"])[0][key] for key in ("Vcpus", "UpdateVcpus")] == [(2 + 1) * 48] * 2
    # The system node group's update surge: 2 nodes in each of the VPC's two AZs, though the lookup of a
    # deploy with credentials gives the region's four (conftest.as_deployed).
    assert json.loads(karpenter["Quotas"])[1]["UpdateVcpus"] == (1 + 4) * 4 and karpenter["AvailabilityZone"] == "us-west-2a"
    p4d = _checks(p4d_platform)[1]["Properties"]
    assert (json.loads(p4d["Quotas"])[0]["Code"], json.loads(p4d["Quotas"])[0]["UpdateVcpus"], p4d["AvailabilityZone"]) == (
        "L-417A185B", 3 * 96, "us-east-1b")


@pytest.mark.parametrize(("instance_type", "code"), [("p5.48xlarge", "L-C4BD4855"), ("p5en.48xlarge", "L-C4BD4855"),
                                                     ("p4d.24xlarge", "L-7212CCBC"), ("g6.12xlarge", "L-3819A6DF")])
def test_spot_nodes_count_against_their_familys_spot_quota_and_karpenter_against_on_demand_too(instance_type, code):
    from ray_train_eks.constructs.account_checks import required_quotas

    quotas = required_quotas(instance_type=instance_type, node_count=2, capacity_type="spot", node_group=False, spare_nodes=1)
    assert quotas[0]["Code"] == code
    assert quotas[1]["Code"] in ("L-417A185B", "L-DB2E81BA") and "Karpenter's fallback" in quotas[1]["Why"]
    # The spare node Karpenter may launch counts in both quotas it can use.
    assert quotas[0]["Vcpus"] == quotas[1]["Vcpus"] == 3 * INSTANCE_TYPES[instance_type].vcpus


def test_nodes_in_an_odcr_count_against_on_demand_and_nodes_only_in_blocks_against_no_gpu_quota():
    """EC2 User Guide: On-Demand Capacity Reservations count toward the On-Demand quota, used or not;
    Capacity Blocks have limits of their own (constructs/account_checks.py ODCR_WHY)."""
    from ray_train_eks.constructs.account_checks import required_quotas
    from ray_train_eks.handlers.reservation_checks import ReservationRequest

    cr = "cr-0123456789abcdef0"

    odcr = required_quotas(instance_type="g6.12xlarge", node_count=2, reservations=ReservationRequest(ids=(cr,)))
    assert [(q["Code"], q["Vcpus"]) for q in odcr] == [("L-DB2E81BA", 96)] and "On-Demand Capacity Reservations" in odcr[0]["Why"]
    block = ReservationRequest(ids=(cr,), reservation_type="capacity-block")
    assert required_quotas(instance_type="p5.48xlarge", node_count=2, reservations=block) == []
    fallback = ReservationRequest(ids=(cr,), reservation_type="capacity-block", reserved_only=False, node_group=False)
    spot = required_quotas(instance_type="p5.48xlarge", node_count=2, capacity_type="spot", node_group=False, spare_nodes=1,
                           reservations=fallback)
    assert [(q["Code"], q["Vcpus"]) for q in spot] == [("L-C4BD4855", 3 * 192), ("L-417A185B", 3 * 192)]



def test_nothing_slow_is_built_before_the_checks_pass(default_platform):
    key, _ = _checks(default_platform)
    template = default_platform.template["Resources"]
    network = {k: r for k, r in template.items() if k.startswith("Network")}
    assert len(network) > 10 and all(key in r["DependsOn"] for r in network.values())
    # The cluster is built on the VPC's subnets, so after the checks too.
    cluster = template[default_platform.logical_id(default_platform.stack.training_cluster.cluster)]
    assert all(s["Ref"].startswith("NetworkPrivateSubnet") for s in cluster["Properties"]["ResourcesVpcConfig"]["SubnetIds"])


def test_the_checks_function_reads_its_quotas_the_offerings_and_the_eks_ami_parameters(default_platform):
    policies = [p for k, p in default_platform.resources("AWS::IAM::Policy").items() if k.startswith("AccountChecksFunction")]
    (policy,) = policies
    statements = policy["Properties"]["PolicyDocument"]["Statement"]
    by_action = {json.dumps(s["Action"]): s["Resource"] for s in statements}
    quotas = by_action['"servicequotas:GetServiceQuota"']
    assert [q["Fn::Join"][1][-1] for q in quotas] == [":ec2/L-DB2E81BA", ":ec2/L-1216C47A"]
    assert by_action['["servicequotas:GetAWSDefaultServiceQuota", "ec2:DescribeInstanceTypeOfferings"]'] == "*"
    ssm = by_action['["ssm:GetParameter", "ssm:GetParametersByPath"]']
    path = "::parameter/aws/service/eks/optimized-ami/1.36/amazon-linux-2023/x86_64/nvidia"
    assert [r["Fn::Join"][1][-1] for r in ssm] == [f":ssm:us-west-2{path}", f":ssm:us-west-2{path}/*"]
    assert all(not a.startswith(("ec2:Run", "ec2:Create", "iam:")) for s in statements for a in
               ([s["Action"]] if isinstance(s["Action"], str) else s["Action"]))


def test_skip_account_checks_builds_none(queued_platform):
    platform = queued_platform  # -c skipAccountChecks=true among its settings
    assert not [r for r in platform.resources("AWS::CloudFormation::CustomResource").values() if "Quotas" in r["Properties"]]
    assert platform.stack.account_checks is None


def _checks_stack(**kwargs) -> tuple[object, dict]:
    """An AccountChecks alone in a stack of us-west-2, and its template."""
    from aws_cdk import App, Environment, Stack
    from aws_cdk.assertions import Template

    from ray_train_eks.constructs.account_checks import AccountChecks

    stack = Stack(App(), "Checks", env=Environment(account="123456789012", region="us-west-2"))
    checks = AccountChecks(stack, "AccountChecks", instance_type="g6.12xlarge", node_count=2, availability_zone="us-west-2a",
                           **kwargs)
    return checks, Template.from_stack(stack).to_json()


def _star_actions(template: dict) -> list[str]:
    (policy,) = [r for r in template["Resources"].values()
                 if r["Type"] == "AWS::IAM::Policy" and "AccountChecksFunction" in json.dumps(r["Properties"]["Roles"])]
    (star,) = [s for s in policy["Properties"]["PolicyDocument"]["Statement"] if s["Resource"] == "*"]
    return star["Action"]


def test_reservations_are_the_checks_property_and_permission_and_without_them_nothing_changes():
    from ray_train_eks.handlers.reservation_checks import ReservationRequest

    plain, template = _checks_stack()
    (resource,) = [r for r in template["Resources"].values() if r["Type"] == "AWS::CloudFormation::CustomResource"]
    assert set(resource["Properties"]) == {"ServiceToken", "InstanceType", "Quotas", "AvailabilityZone", "KubernetesVersion",
                                           "AmiRelease"}
    assert _star_actions(template) == ["servicequotas:GetAWSDefaultServiceQuota", "ec2:DescribeInstanceTypeOfferings"]
    assert plain.reservation_ends is None

    request = ReservationRequest(tags={"team": "ml"}, reservation_type="capacity-block", reserved_only=False, node_group=False,
                                 deadline_seconds=36000)
    reserved, template = _checks_stack(node_group=False, spare_nodes=1, reservations=request)
    (resource,) = [r for r in template["Resources"].values() if r["Type"] == "AWS::CloudFormation::CustomResource"]
    assert json.loads(resource["Properties"]["Reservations"]) == {
        "Ids": [], "Tags": {"team": "ml"}, "Type": "capacity-block", "ReservedOnly": False, "NodeGroup": False,
        "DeadlineSeconds": 36000, "Nodes": 2, "Spare": 1}
    assert _star_actions(template) == ["servicequotas:GetAWSDefaultServiceQuota", "ec2:DescribeInstanceTypeOfferings",
                                       "ec2:DescribeCapacityReservations"]
    from aws_cdk import Stack

    assert Stack.of(reserved).resolve(reserved.reservation_ends)["Fn::GetAtt"][1] == "ReservationEnds"


def test_reservations_the_checks_cannot_read_fail_at_synth():
    from ray_train_eks.handlers.reservation_checks import ReservationRequest

    with pytest.raises(ValueError, match=r"reservations node_group=True with node_group=False: give both the same value"):
        _checks_stack(node_group=False, reservations=ReservationRequest(ids=("cr-0123456789abcdef0",)))


def test_nodes_only_in_a_capacity_block_read_no_quota():
    """Capacity Blocks count against no GPU quota (constructs/account_checks.py ODCR_WHY): with no
    system nodes either, the function reads no quota, and has no GetServiceQuota statement."""
    from ray_train_eks.handlers.reservation_checks import ReservationRequest

    checks, template = _checks_stack(reservations=ReservationRequest(ids=("cr-0123456789abcdef0",),
                                                                     reservation_type="capacity-block"))
    assert checks.quotas == []
    assert "servicequotas:GetServiceQuota" not in json.dumps(template)
