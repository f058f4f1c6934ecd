"""Reserved GPU capacity in both modes (issue 59): On-Demand Capacity Reservations and Capacity
Blocks for ML, for the managed node group (its launch template, its capacity type) and for
Karpenter (the EC2NodeClass's reservation terms, the NodePool's order of capacity types), each
combination checked against what AWS and Karpenter accept: the node groups' templates through
cfn-lint, the EC2NodeClass and NodePool against Karpenter 1.14.1's CRDs, the full platform with
reservations through cdk-nag and cfn-lint (tests/test_quality_gates.py, ``reserved_platform``).
The rules of the settings and props, with their messages, and the NodeConfig with nodeadm's
fast image pull the GPU nodes boot with."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ray_train_eks.config import ConfigError, PlatformConfig

pytestmark = pytest.mark.synth

CR = "cr-0123456789abcdef0"
CR2 = "cr-0123456789abcdef1"


def _problems(context: dict) -> list[str]:
    try:
        PlatformConfig.from_context(context, environ={})
    except ConfigError as error:
        return error.problems
    return []


# --------------------------------------------------------------------- the settings

def test_capacity_defaults_to_the_reservations_when_there_are_some():
    config = PlatformConfig.from_context({"capacityReservationIds": f"{CR},{CR2}"}, environ={})
    assert config.capacity.order == ("reserved",) and config.capacity.reserved_only
    assert config.capacity.reservation_ids == (CR, CR2)
    # The earlier key is the same as one id.
    assert PlatformConfig.from_context({"capacityReservationId": CR}, environ={}).capacity.reservation_ids == (CR,)
    # Karpenter's order, as written; `spot` alone keeps its fallback to On-Demand.
    karpenter = {"gpuCapacity": "karpenter", "capacityReservationTags": "team=ml,purpose=training",
                 "gpuCapacityType": "reserved,spot,on-demand", "capacityReservationType": "capacity-block"}
    choice = PlatformConfig.from_context(karpenter, environ={}).capacity
    assert (choice.order, dict(choice.reservation_tags), choice.capacity_block) == (
        ("reserved", "spot", "on-demand"), {"team": "ml", "purpose": "training"}, True)
    assert PlatformConfig.from_context({"gpuCapacity": "karpenter", "gpuCapacityType": "spot"},
                                       environ={}).capacity.order == ("spot", "on-demand")
    assert PlatformConfig.from_context({}, environ={}).capacity.order == ("on-demand",)


@pytest.mark.parametrize("context, expected", [
    ({"gpuCapacity": "karpenter", "capacityReservationIds": CR, "gpuCapacityType": "on-demand,reserved"},
     "gpuCapacityType='on-demand,reserved': Karpenter takes reserved capacity first, then Spot, then On-Demand, whatever "
     "the order written; write them in that order, e.g. -c gpuCapacityType=reserved,on-demand"),
    ({"capacityReservationIds": CR, "gpuCapacityType": "reserved,on-demand"},
     "gpuCapacityType='reserved,on-demand': a managed node group has one capacity type, so no fallback; use "
     "-c gpuCapacityType=reserved, or -c gpuCapacity=karpenter for reserved,on-demand in that order"),
    ({"gpuCapacityType": "reserved"},
     "gpuCapacityType='reserved': reserved needs capacity reservations; name them with "
     "-c capacityReservationIds=cr-0123456789abcdef0, or drop reserved"),
    ({"gpuCapacity": "karpenter", "capacityReservationIds": CR, "gpuCapacityType": "spot,on-demand"},
     "gpuCapacityType='spot,on-demand' leaves the named capacity reservations out (a reservation holds On-Demand "
     "capacity); use -c gpuCapacityType=reserved,spot,on-demand, or name no reservation"),
    ({"capacityReservationTags": "team=ml"},
     "capacityReservationTags with gpuCapacity=nodegroup: a node group's launch template names its reservations; use "
     "-c capacityReservationIds=cr-0123456789abcdef0, or -c gpuCapacity=karpenter to select by tags"),
    ({"capacityReservationIds": f"{CR},{CR2}", "capacityReservationType": "capacity-block"},
     f"capacityReservationIds='{CR},{CR2}' with capacity-block: a node group launches into one Capacity Block (its "
     "launch template targets one reservation); name one, or use -c gpuCapacity=karpenter for several"),
    ({"gpuCapacity": "karpenter", "capacityReservationIds": CR, "capacityReservationTags": "team=ml"},
     f"capacityReservationIds='{CR}' and capacityReservationTags: select the reservations one way; drop "
     "capacityReservationTags or capacityReservationIds"),
    ({"capacityReservationIds": f"{CR},cr-12"},
     f"capacityReservationIds='{CR},cr-12': 'cr-12' is not a capacity reservation id; use the form "
     "cr-0123456789abcdef0 (17 hex digits)"),
    ({"gpuCapacity": "karpenter", "capacityReservationTags": "team"},
     "capacityReservationTags='team': 'team' is not key=value with both set (Karpenter refuses an empty key or value); "
     "e.g. -c capacityReservationTags=team=ml,purpose=training"),
    ({"gpuCapacity": "karpenter", "capacityReservationTags": "team="},
     "capacityReservationTags='team=': 'team=' is not key=value with both set (Karpenter refuses an empty key or value); "
     "e.g. -c capacityReservationTags=team=ml,purpose=training"),
    ({"gpuCapacity": "karpenter", "capacityReservationIds": CR, "capacityReservationType": "capacity-block",
      "gpuPlacementGroup": "ml-cluster-pg"},
     "gpuPlacementGroup='ml-cluster-pg' with capacity-block: a Capacity Block's instances sit in one EC2 UltraCluster "
     "already, and a placement group makes its launches fail for capacity with room left in it; drop the placement group"),
    ({"capacityReservationIds": CR, "capacityReservationType": "block"},
     "capacityReservationType='block': use default (On-Demand Capacity Reservations) or capacity-block (EC2 Capacity "
     "Blocks for ML)"),
    ({"capacityReservationIds": CR, "capacityReservationId": CR2},
     f"capacityReservationId='{CR2}' and capacityReservationIds: name the reservations in capacityReservationIds only"),
    ({"gpuCapacity": "karpenter", "capacityReservationIds": ",".join(f"cr-{n:017x}" for n in range(31))},
     "capacityReservationIds names 31 reservations; Karpenter's EC2NodeClass takes at most 30 (one selector term each): "
     "name at most 30, or tag them and select them with -c capacityReservationTags=team=ml"),
])
def test_a_capacity_that_cannot_be_had_fails_at_synth_naming_the_fix(context, expected):
    assert expected in _problems(context)


# --------------------------------------------------------------------- Karpenter's objects

def _karpenter_objects(**props) -> tuple[dict, dict, object]:
    from aws_cdk import App, Stack, aws_ec2 as ec2, aws_eks_v2 as eks

    from ray_train_eks.constructs import KarpenterGpuCapacity

    stack = Stack(App(), "S", env={"region": "us-west-2", "account": "123456789012"})
    provider = eks.KubectlProvider.from_kubectl_provider_attributes(
        stack, "P", service_token="arn:aws:lambda:us-west-2:123456789012:function:kubectl")
    cluster = eks.Cluster.from_cluster_attributes(stack, "C", cluster_name="c", vpc=ec2.Vpc(stack, "V"),
                                                  cluster_security_group_id="sg-0123456789abcdef2", kubectl_provider=provider)
    capacity = KarpenterGpuCapacity(stack, "K", cluster=cluster, subnet=cluster.vpc.private_subnets[0],
                                    instance_type="p5.48xlarge", node_count=2, **props)
    return capacity.node_class, capacity.node_pool, capacity


@pytest.fixture(scope="module")
def crd_schemas():
    from crd_schema import load_schemas
    from upstream import KARPENTER_CRDS, upstream_file

    return load_schemas({
        "EC2NodeClass": upstream_file(f"{KARPENTER_CRDS}/karpenter.k8s.aws_ec2nodeclasses.yaml"),
        "NodePool": upstream_file(f"{KARPENTER_CRDS}/karpenter.sh_nodepools.yaml"),
    })


def test_karpenters_limit_of_selector_terms_is_its_crds(crd_schemas):
    """The EC2NodeClass's capacityReservationSelectorTerms hold at most the CRD's maxItems (one term per id)."""
    from upstream import KARPENTER_CRDS, load_yaml, upstream_file

    from ray_train_eks.rules.reservations import MAX_SELECTOR_TERMS

    crd = load_yaml(upstream_file(f"{KARPENTER_CRDS}/karpenter.k8s.aws_ec2nodeclasses.yaml"))
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    terms = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["capacityReservationSelectorTerms"]
    assert terms["maxItems"] == MAX_SELECTOR_TERMS


def _concrete(obj, stack) -> dict:
    """The object with CloudFormation tokens replaced by values of their shape."""
    text = json.dumps(stack.resolve(obj))
    resolved = json.loads(text)

    def walk(value):
        if isinstance(value, dict):
            if "Fn::GetAtt" in value and value["Fn::GetAtt"][1] == "GroupId":
                return "sg-0123456789abcdef1"
            if "Ref" in value and "Subnet" in value["Ref"]:
                return "subnet-0123456789abcdef0"
            if set(value) <= {"Ref", "Fn::GetAtt", "Fn::Select", "Fn::Join", "Fn::GetAZs"}:
                return "resolved-0123"
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        return value

    return walk(resolved)


@pytest.mark.parametrize("props, terms, capacity_types, placement", [
    ({"capacity_reservation_ids": (CR, CR2)}, [{"id": CR}, {"id": CR2}], ["reserved"], False),
    ({"capacity_reservation_tags": {"team": "ml"}, "capacity_types": ("reserved", "on-demand")},
     [{"tags": {"team": "ml"}}], ["reserved", "on-demand"], False),
    ({"capacity_reservation_ids": (CR,), "reservation_type": "capacity-block", "capacity_types": ("reserved", "spot", "on-demand")},
     [{"id": CR}], ["reserved", "spot", "on-demand"], False),
    ({"capacity_reservation_ids": (CR,), "placement_group_name": "their-group", "capacity_types": ("reserved", "on-demand")},
     [{"id": CR}], ["reserved", "on-demand"], "their-group"),
    ({"capacity_type": "spot"}, None, ["spot", "on-demand"], True),
])
def test_karpenter_takes_the_reservations_then_the_fallback_the_user_chose(props, terms, capacity_types, placement, crd_schemas):
    from crd_schema import validate

    node_class, pool, capacity = _karpenter_objects(**props)
    stack = capacity.node.scope
    validate(_concrete(node_class, stack), crd_schemas)
    validate(_concrete(pool, stack), crd_schemas)
    assert node_class["spec"].get("capacityReservationSelectorTerms") == terms
    (types,) = [r["values"] for r in pool["spec"]["template"]["spec"]["requirements"] if r["key"] == "karpenter.sh/capacity-type"]
    assert types == capacity_types
    # Never an interruptible reservation (one tagged or made so after the deploy's check): where reservations are used.
    interruptible = [r for r in pool["spec"]["template"]["spec"]["requirements"]
                     if r["key"] == "karpenter.k8s.aws/capacity-reservation-interruptible"]
    assert interruptible == ([{"key": "karpenter.k8s.aws/capacity-reservation-interruptible", "operator": "NotIn",
                               "values": ["true"]}] if "reserved" in types else [])
    # A fallback node goes back to the cheaper capacity, one node at a time; reserved only: emptiness only.
    disruption = pool["spec"]["disruption"]
    assert disruption["consolidationPolicy"] == ("WhenEmptyOrUnderutilized" if len(types) > 1 else "WhenEmpty")
    # Every node in the one AZ, and in one placement group: ours, theirs, or none with reservations.
    (zone,) = [r for r in pool["spec"]["template"]["spec"]["requirements"] if r["key"] == "topology.kubernetes.io/zone"]
    assert len(zone["values"]) == 1
    selector = node_class["spec"].get("placementGroupSelector")
    if placement is True:
        assert selector is not None and capacity.placement_group is not None
    else:
        assert selector == ({"name": placement} if placement else None) and capacity.placement_group is None
    # The reserved capacity type is a Karpenter feature gate (beta, on by default in 1.14.1): said where it is used.
    assert capacity.chart_values["settings"]["featureGates"].get("reservedCapacity") is ("reserved" in types or None)
    # The nodes boot with nodeadm's fast image pull; Karpenter's own NodeConfig brings the RAID0.
    assert "FastImagePull: true" in node_class["spec"]["userData"] and "localStorage" not in node_class["spec"]["userData"]
    assert node_class["spec"]["instanceStorePolicy"] == "RAID0"


# --------------------------------------------------------------------- the node group's launch templates

def _node_group_stacks(tmp_path: Path):
    """One stack per node-group combination: one ODCR, several (a capacity reservation group), a
    Capacity Block, a reservation in the user's placement group, and the fast image pull off."""
    from aws_cdk import App, Stack, aws_ec2 as ec2, aws_eks_v2 as eks

    from ray_train_eks.constructs import EfaNodeGroup

    app = App(outdir=str(tmp_path))
    combos = {
        "OneReservation": {"capacity_reservation_ids": (CR,)},
        "ReservationGroup": {"capacity_reservation_ids": (CR, CR2)},
        "CapacityBlock": {"capacity_reservation_ids": (CR,), "reservation_type": "capacity-block"},
        "TheirPlacementGroup": {"capacity_reservation_id": CR, "placement_group_name": "their-group", "fast_image_pull": False},
        # The next block; the same block again; the same block with another launch template.
        "NextBlock": {"capacity_reservation_ids": (CR2,), "reservation_type": "capacity-block"},
        "SameBlock": {"capacity_reservation_ids": (CR,), "reservation_type": "capacity-block"},
        "BlockNewTemplate": {"capacity_reservation_ids": (CR,), "reservation_type": "capacity-block", "fast_image_pull": False},
        # The same block in a VPC of another CIDR: new subnets in the same AZ.
        "BlockNewSubnet": {"capacity_reservation_ids": (CR,), "reservation_type": "capacity-block"},
    }
    groups = {}
    for name, props in combos.items():
        stack = Stack(app, name, env={"region": "us-west-2", "account": "123456789012"})
        vpc = ec2.Vpc(stack, "V", **({"ip_addresses": ec2.IpAddresses.cidr("10.1.0.0/16")} if name == "BlockNewSubnet" else {}))
        cluster = eks.Cluster.from_cluster_attributes(stack, "C", cluster_name="c", vpc=vpc,
                                                      cluster_security_group_id="sg-0123456789abcdef2")
        groups[name] = EfaNodeGroup(stack, "Gpu", cluster=cluster, subnet=cluster.vpc.private_subnets[0],
                                    instance_type="p5.48xlarge", **props)
    app.synth()
    return {name: json.loads((tmp_path / f"{name}.template.json").read_text()) for name in combos}, groups


def _one(template: dict, kind: str) -> dict:
    (resource,) = [r["Properties"] for r in template["Resources"].values() if r["Type"] == kind]
    return resource


def test_node_group_launches_into_reservations_and_capacity_blocks_as_aws_documents(tmp_path):
    templates, groups = _node_group_stacks(tmp_path)
    one = _one(templates["OneReservation"], "AWS::EC2::LaunchTemplate")["LaunchTemplateData"]
    # Reservations only: no launch runs On-Demand beside them when they are full.
    assert one["CapacityReservationSpecification"] == {"CapacityReservationPreference": "capacity-reservations-only",
                                                       "CapacityReservationTarget": {"CapacityReservationId": CR}}
    assert "Placement" not in one and "InstanceMarketOptions" not in one
    assert _one(templates["OneReservation"], "AWS::EKS::Nodegroup")["CapacityType"] == "ON_DEMAND"
    # Several ODCRs: a capacity reservation group of them, which the template targets.
    group = _one(templates["ReservationGroup"], "AWS::ResourceGroups::Group")
    assert group["Configuration"][0] == {"Type": "AWS::EC2::CapacityReservationPool"}
    assert [r["Fn::Join"][1][-1].split(":")[-1] for r in group["Resources"]] == [f"capacity-reservation/{CR}", f"capacity-reservation/{CR2}"]
    target = _one(templates["ReservationGroup"], "AWS::EC2::LaunchTemplate")["LaunchTemplateData"][
        "CapacityReservationSpecification"]["CapacityReservationTarget"]
    assert set(target) == {"CapacityReservationResourceGroupArn"}
    # A Capacity Block: capacity type CAPACITY_BLOCK, market type capacity-block, the reservation and
    # the type in the template (EKS rejects the node group otherwise), no placement group, and a
    # minimum of 0 so that EKS's scale-down 40 minutes before the end can take the nodes.
    block = _one(templates["CapacityBlock"], "AWS::EC2::LaunchTemplate")["LaunchTemplateData"]
    assert block["InstanceMarketOptions"] == {"MarketType": "capacity-block"}
    assert block["CapacityReservationSpecification"]["CapacityReservationTarget"] == {"CapacityReservationId": CR}
    assert block["InstanceType"] == "p5.48xlarge" and "Placement" not in block
    nodegroup = _one(templates["CapacityBlock"], "AWS::EKS::Nodegroup")
    assert nodegroup["CapacityType"] == "CAPACITY_BLOCK" and "InstanceTypes" not in nodegroup
    assert nodegroup["ScalingConfig"] == {"MinSize": 0, "DesiredSize": 2, "MaxSize": 2}
    assert groups["CapacityBlock"].capacity_block and not groups["OneReservation"].capacity_block
    # Named after its block and its launch template: the next block, or a new template, is a new group
    # (CloudFormation replaces a node group whose name changes: EKS creates it and launches its nodes when
    # the block starts), never an update of the group EKS scaled to 0 before the last block ended.
    names = {name: _one(templates[name], "AWS::EKS::Nodegroup").get("NodegroupName") for name in templates}
    assert names["CapacityBlock"].startswith(f"gpu-{CR}-") and names["NextBlock"].startswith(f"gpu-{CR2}-")
    assert names["SameBlock"] == names["CapacityBlock"] != names["BlockNewTemplate"]
    # A subnet replaced in the same AZ (NodegroupName and Subnets are create-only): a new name, or
    # CloudFormation refuses to replace a custom-named resource.
    assert names["BlockNewSubnet"] not in (names["CapacityBlock"], names["BlockNewTemplate"])
    assert names["OneReservation"] is None  # other node groups keep the name CloudFormation gives them
    # The user's placement group (the one the reservation was made in), and the fast pull off: RAID0 only.
    theirs = _one(templates["TheirPlacementGroup"], "AWS::EC2::LaunchTemplate")["LaunchTemplateData"]
    assert theirs["Placement"] == {"GroupName": "their-group"}
    assert not [r for r in templates["TheirPlacementGroup"]["Resources"].values() if r["Type"] == "AWS::EC2::PlacementGroup"]
    assert "FastImagePull" not in json.dumps(theirs["UserData"]) and "FastImagePull" in json.dumps(block["UserData"])
    # What CloudFormation's schemas accept (cfn-lint's exit code is a bit mask; 0: nothing found).
    result = subprocess.run([str(Path(sys.executable).parent / "cfn-lint"), "--format", "json",
                             *[str(tmp_path / f"{name}.template.json") for name in templates]],
                            capture_output=True, text=True, check=False)
    findings = [f"{f['Rule']['Id']}: {f['Message']}" for f in json.loads(result.stdout or "[]")
                if f["Rule"]["Id"] not in ("W3005", "W3010")]  # W3010: the dummy AZs of a stack with an account
    assert result.returncode in (0, 4, 8, 12) and findings == [], (result.stderr, findings)


# --------------------------------------------------------------------- the platform on a Capacity Block

def test_a_run_on_a_capacity_block_knows_its_blocks_and_where_to_say_it_ends(reserved_platform):
    capacity = reserved_platform.stack.gpu_capacity
    assert capacity.capacity.order == ("reserved",) and capacity.capacity.capacity_block
    assert "placementGroupSelector" not in capacity.node_class["spec"]
    assert capacity.placement_group is None and not reserved_platform.resources("AWS::EC2::PlacementGroup")
    # The pods read the blocks (to stop before their end) and the topic (to say so) from the settings ConfigMap.
    (settings,) = [r["Properties"]["Manifest"] for r in reserved_platform.resources("Custom::AWSCDK-EKS-KubernetesResource").values()
                   if isinstance(r["Properties"]["Manifest"], dict) and "ray-train-eks-settings" in json.dumps(r["Properties"]["Manifest"])]
    (topic_id,) = reserved_platform.resources("AWS::SNS::Topic")
    text = json.dumps(settings)
    assert '\\"capacity_block_ids\\":\\"cr-0123456789abcdef0\\"' in text
    assert '\\"notify_topic_arn\\":\\"' in text and {"Ref": topic_id} in settings["Fn::Join"][1]
    statements = json.dumps([p["Properties"]["PolicyDocument"] for p in reserved_platform.resources("AWS::IAM::Policy").values()])
    assert '"Action": "ec2:DescribeCapacityReservations"' in statements


def test_the_cost_line_says_what_a_reservation_bills():
    from ray_train_eks.instances import estimate_cost

    kwargs = dict(gpu_instance_type="p5.48xlarge", gpu_node_count=2, system_instance_type="m7i.xlarge", system_node_count=1)
    assert "paid up front when booked" in estimate_cost(**kwargs, gpu_reserved="capacity-block").describe()
    assert "bills at the On-Demand rate while it stands, used or not" in estimate_cost(**kwargs, gpu_reserved="default").describe()
    assert "reservation" not in estimate_cost(**kwargs).describe().lower()


def test_the_deploy_checks_the_block_first_and_says_when_it_ends(reserved_platform):
    (props,) = [r["Properties"] for r in reserved_platform.template["Resources"].values() if "Reservations" in r.get("Properties", {})]
    request = json.loads(props["Reservations"])
    assert (request["Ids"], request["Type"], request["ReservedOnly"], request["NodeGroup"], request["Nodes"], request["Spare"]) == (
        ["cr-0123456789abcdef0"], "capacity-block", True, False, 2, 1)
    output = reserved_platform.template["Outputs"]["GpuReservationEnds"]
    assert output["Value"]["Fn::GetAtt"][1] == "ReservationEnds"
    # Nodes on the block alone are held to no GPU quota (constructs/account_checks.py); the system nodes' Standard one stays.
    assert {q["Code"] for q in json.loads(props["Quotas"])} == {"L-1216C47A"}


@pytest.mark.parametrize("version, expected", [
    ("v20251209", "gpuAmiVersion='v20251209' with fastImagePull=true: before v20251217 the RAID0 of the instance store "
                  "leaves SOCI's image store on the root volume, which the DLC image would fill; use "
                  "-c gpuAmiVersion=v20260714, or -c fastImagePull=false"),
    ("v20260505", "gpuAmiVersion='v20260505' with fastImagePull=true: its containerd deadlocks pod sandboxes with SOCI "
                  "(awslabs/amazon-eks-ami#2710, fixed in v20260512); use -c gpuAmiVersion=v20260714, or -c fastImagePull=false"),
])
def test_an_ami_release_where_the_fast_pull_would_hurt_is_refused_at_synth(version, expected):
    context = {"gpuCapacity": "karpenter", "gpuAmiVersion": version}
    assert _problems(context) == [expected]
    assert _problems({**context, "fastImagePull": "false"}) == []
