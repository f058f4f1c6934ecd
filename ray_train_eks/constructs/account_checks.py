"""Checks of the account the GPU nodes need, run at the start of a deploy."""

from __future__ import annotations

from aws_cdk import Annotations, Stack, aws_iam as iam
from constructs import Construct

from ray_train_eks.constructs.custom_resource import PythonCustomResource
from ray_train_eks.handlers.account_checks import AMI_PATH
from ray_train_eks.handlers.reservation_checks import ReservationRequest
from ray_train_eks.instances import INSTANCE_TYPES
from ray_train_eks.nag import acknowledge, wildcard_rule
from ray_train_eks.validation import raise_problems

#: EC2's regional vCPU quotas of the GPU families, by (family, capacity type): Service Quotas'
#: codes and names (EC2 instance type quotas page; the Spot quotas of the EC2 User Guide, "Spot
#: Instance quotas": P5, P5e and P5en have a Spot quota of their own, and so does P6 there).
GPU_QUOTAS: dict[tuple[str, str], tuple[str, str]] = {
    ("G", "on-demand"): ("L-DB2E81BA", "Running On-Demand G and VT instances"),
    ("P", "on-demand"): ("L-417A185B", "Running On-Demand P instances"),
    ("G", "spot"): ("L-3819A6DF", "All G and VT Spot Instance Requests"),
    ("P", "spot"): ("L-7212CCBC", "All P4, P3 and P2 Spot Instance Requests"),
    ("P5", "spot"): ("L-C4BD4855", "All P5 Spot Instance Requests"),
}
#: The system nodes' family (m, c, r, t...): Running On-Demand Standard instances.
STANDARD_QUOTA = ("L-1216C47A", "Running On-Demand Standard (A, C, D, H, I, M, R, T, Z) instances")
#: On-Demand Capacity Reservations count toward the On-Demand Instance quota, used or not, in the
#: assessing, scheduled, pending, active and delayed states (EC2 User Guide, "Reserve compute
#: capacity with EC2 On-Demand Capacity Reservations", Quotas and Limitations:
#: https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/ec2-capacity-reservations.html#capacity-reservations-limits):
#: the nodes in them need the same On-Demand vCPUs as without them. Capacity Blocks have limits of
#: their own (up to 64 instances a block, 256 across blocks: "Find and purchase Capacity Blocks",
#: https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/capacity-blocks-purchase.html) and no page
#: counts them toward the On-Demand quota: nodes only in Capacity Blocks need none of it; a fallback
#: from them needs the fallback's quotas for every node (the blocks may be full, or ended).
ODCR_WHY = " (in On-Demand Capacity Reservations, which count toward this quota)"


def gpu_quota(instance_type: str, capacity_type: str = "on-demand") -> tuple[str, str]:
    """The quota (code, name) that ``instance_type`` nodes count against."""
    family = "P" if instance_type.startswith("p") else "G"
    if capacity_type == "spot" and instance_type.startswith(("p5", "p6")):
        family = "P5"
    return GPU_QUOTAS[(family, capacity_type)]


def update_surge(availability_zones: int, max_unavailable: int = 1) -> int:
    """Nodes a managed node group's rolling update launches before it drains the old ones: the
    larger of twice its AZs and its maxUnavailable (EKS User Guide, "Managed node update
    behavior", scale-up phase)."""
    return max(2 * availability_zones, max_unavailable)


def required_quotas(*, instance_type: str, node_count: int, capacity_type: str = "on-demand", node_group: bool = True,
                    system_instance_type: str | None = None, system_node_count: int = 0,
                    system_availability_zones: int = 0, spare_nodes: int = 0,
                    reservations: ReservationRequest | None = None) -> list[dict]:
    """Every vCPU quota the nodes count against, and how much of it they need:
    ``{"Code", "Name", "Vcpus", "Why", "UpdateVcpus", "UpdateWhy"}``. ``Vcpus``: what a create
    launches (the nodes, and with Karpenter the ``spare_nodes`` a replacement may take while a node
    taken out of a run still stands); ``UpdateVcpus``: what a managed node group's rolling update
    launches too, before it drains the old nodes (the system node group's; the GPU node group updates
    with the minimal strategy, terminating before it launches, so it needs none). Karpenter with
    Spot falls back to On-Demand, so both quotas must hold its nodes and its spare. With
    ``reservations`` (see :data:`ODCR_WHY`): nodes in On-Demand Capacity Reservations count as
    before; nodes only in Capacity Blocks count against no GPU quota."""
    gpu = INSTANCE_TYPES[instance_type]
    quotas: dict[str, dict] = {}

    def need(code_name: tuple[str, str], nodes: int, surge: int, vcpus: int, what: str, spare: str = "") -> None:
        code, name = code_name
        entry = quotas.setdefault(code, {"Code": code, "Name": name, "Vcpus": 0, "Why": [], "UpdateVcpus": 0,
                                         "UpdateWhy": []})
        entry["Vcpus"] += nodes * vcpus
        entry["Why"].append(what + spare)
        entry["UpdateVcpus"] += (nodes + surge) * vcpus
        entry["UpdateWhy"].append(what + spare + (f" and the {surge} a node-group update launches first" if surge else ""))

    gpu_nodes = node_count if node_group else node_count + spare_nodes
    spare = (f" and {spare_nodes} replacement(s) launched while a node taken out of the run still stands"
             if spare_nodes and not node_group else "")
    surge = 0  # the GPU node group updates with the minimal strategy (efa_node_group.py GPU_UPDATE_CONFIG): no surge
    blocks = reservations is not None and reservations.reservation_type == "capacity-block"
    what = f"{node_count} x {instance_type}" + (ODCR_WHY if reservations is not None and not blocks else
                                                 " (the fallback when the Capacity Blocks are full or ended)" if blocks else "")
    if not (blocks and reservations.reserved_only):
        need(gpu_quota(instance_type, capacity_type), gpu_nodes, surge, gpu.vcpus, what, spare)
    if capacity_type == "spot" and not node_group and not (blocks and reservations.reserved_only):
        need(gpu_quota(instance_type, "on-demand"), gpu_nodes, 0, gpu.vcpus,
             f"{node_count} x {instance_type} on-demand (Karpenter's fallback when Spot has no capacity)", spare)
    if system_instance_type in INSTANCE_TYPES and system_node_count:
        need(STANDARD_QUOTA, system_node_count, update_surge(system_availability_zones),
             INSTANCE_TYPES[system_instance_type].vcpus, f"{system_node_count} x {system_instance_type} system node(s)")
    return [{**q, "Why": " and ".join(q["Why"]), "UpdateWhy": " and ".join(q["UpdateWhy"])} for q in quotas.values()]


def update_notes(quotas: list[dict]) -> list[str]:
    """What an update of the node groups will need beyond what the create needs, per quota."""
    return [f"an update of the node groups needs {q['UpdateVcpus']} vCPUs of '{q['Name']}' ({q['Code']}): {q['UpdateWhy']}; "
            f"a create needs {q['Vcpus']}. Request {q['UpdateVcpus']} in Service Quotas before the first update "
            "(a create does not need it)" for q in quotas if q["UpdateVcpus"] > q["Vcpus"]]


class AccountChecks(Construct):
    """Fails the deploy in its first minute, with every problem and its fix, when the account
    cannot run the nodes: a vCPU quota is too low for what a create launches
    (:func:`required_quotas`), the GPU type is not offered in the GPU AZ, or the AMI release does
    not exist for the Kubernetes version in the region (``ray_train_eks/handlers/account_checks.py``).
    What a node group's update will need beyond that is a warning at synth and, against the
    account's quotas, in the resource's ``UpdateNeeds`` attribute; an update fails only when it
    asks for more than before. Put what is slow to build after it (``node.add_dependency``).

    Its function may read those quotas, the offerings, and the EKS AMIs' public parameters:
    nothing else.

    :param instance_type: the GPU type (a row of the instance table).
    :param node_count: GPU nodes at most.
    :param availability_zone: the GPU nodes' AZ (a name, or the token of the stack's first AZ).
    :param kubernetes_version: Default - 1.36.
    :param ami_release: the AL2023 release the nodes boot (``v20260714`` or ``latest``). Default -
        none: EKS picks it (a managed node group); the recommended one must exist.
    :param capacity_type: ``on-demand`` or ``spot`` (another quota). Default - on-demand.
    :param node_group: the GPU nodes are a managed node group (its updates launch new nodes
        first), not Karpenter's (whose Spot falls back to On-Demand). Default - True.
    :param system_instance_type: the system node group's type, checked against the Standard
        quota with ``system_node_count`` nodes in ``system_availability_zones`` AZs. Default - none.
    :param spare_nodes: Karpenter's room for replacements (KarpenterGpuCapacity ``spare_nodes``). Default - 0.
    :param reservations: the capacity reservations the GPU nodes launch into, checked too (they
        exist, are active or scheduled, hold the type in the AZ and room for the nodes and the
        spare); a Capacity Block's end is the ``reservation_ends`` attribute. Default - none.
    """

    def __init__(self, scope: Construct, id: str, *, instance_type: str, node_count: int, availability_zone: str,
                 kubernetes_version: str = "1.36", ami_release: str = "", capacity_type: str = "on-demand",
                 node_group: bool = True, system_instance_type: str | None = None, system_node_count: int = 0,
                 system_availability_zones: int = 0, spare_nodes: int = 0,
                 reservations: ReservationRequest | None = None) -> None:
        super().__init__(scope, id)
        spec = INSTANCE_TYPES.get(instance_type)
        raise_problems("AccountChecks", [
            None if spec and spec.gpus else f"instance_type={instance_type!r}: not a GPU type of the instance table",
            None if capacity_type in ("on-demand", "spot") else f"capacity_type={capacity_type!r}; use on-demand or spot",
            *(reservations.problems() if reservations else []),
            None if reservations is None or reservations.node_group == node_group else
            f"reservations node_group={reservations.node_group} with node_group={node_group}: give both the same value",
        ])
        quotas = required_quotas(instance_type=instance_type, node_count=node_count, capacity_type=capacity_type,
                                 node_group=node_group, system_instance_type=system_instance_type,
                                 system_node_count=system_node_count, system_availability_zones=system_availability_zones,
                                 spare_nodes=spare_nodes, reservations=reservations)
        self.quotas = quotas
        #: What an update will need beyond a create: a warning at synth, and the stack's output.
        self.update_notes = update_notes(quotas)
        for number, note in enumerate(self.update_notes):
            Annotations.of(self).add_warning_v2(f"ray-train-eks:update-quota-{number}", note)
        stack = Stack.of(self)
        ami_path = AMI_PATH.format(k8s=kubernetes_version)
        properties = {"InstanceType": instance_type, "Quotas": PythonCustomResource.json(quotas),
                      "AvailabilityZone": availability_zone, "KubernetesVersion": kubernetes_version,
                      "AmiRelease": ami_release}
        # ec2:DescribeCapacityReservations, like the other EC2 Describe calls, has no resource type.
        describe = ["servicequotas:GetAWSDefaultServiceQuota", "ec2:DescribeInstanceTypeOfferings"]
        if reservations is not None:
            properties["Reservations"] = PythonCustomResource.json(reservations.property(
                nodes=node_count, spare=0 if node_group else spare_nodes))
            properties["Account"] = stack.account  # against a shared reservation's owner
            describe.append("ec2:DescribeCapacityReservations")
        self.resource = PythonCustomResource(
            self,
            "Resource",
            handler="account_checks.on_event",
            description="Checks the GPU quota, the GPU type's AZs and the AMI release before anything is built",
            properties=properties,
            statements=[
                # (none to read where nothing counts against a quota: nodes only in Capacity Blocks, no system nodes)
                *([iam.PolicyStatement(actions=["servicequotas:GetServiceQuota"],
                                       resources=[stack.format_arn(service="servicequotas", resource="ec2",
                                                                   resource_name=q["Code"]) for q in quotas])] if quotas else []),
                # GetAWSDefaultServiceQuota and the EC2 Describe calls have no resource type.
                iam.PolicyStatement(actions=describe, resources=["*"]),
                iam.PolicyStatement(
                    actions=["ssm:GetParameter", "ssm:GetParametersByPath"],
                    resources=[f"arn:{stack.partition}:ssm:{stack.region}::parameter{ami_path}",
                               f"arn:{stack.partition}:ssm:{stack.region}::parameter{ami_path}/*"],
                ),
            ],
        )
        #: The account's quotas against what an update will need: "none short", or each one short.
        self.update_needs = self.resource.resource.get_att_string("UpdateNeeds")
        #: The earliest end of a Capacity Block the nodes use (ISO-8601 UTC), or "none"; None without reservations.
        self.reservation_ends = self.resource.resource.get_att_string("ReservationEnds") if reservations else None
        acknowledge(
            self.resource,
            f"GetAWSDefaultServiceQuota and {' and '.join(describe[1:])} support no resource-level permissions "
            "(Service Authorization Reference), and the EKS AMIs' public parameters are one path of releases.",
            "AwsSolutions-IAM5[Resource::*]",
            wildcard_rule(self, f"arn:{stack.partition}:ssm:{stack.region}::parameter{ami_path}/*"),
        )
