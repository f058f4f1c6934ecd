"""GPU nodes connected by EFA: what eksctl's ``efaEnabled`` builds, as CDK."""

from __future__ import annotations

import hashlib
import json
from typing import Mapping, Sequence

from aws_cdk import Annotations, Stack, aws_ec2 as ec2, aws_eks_v2 as eks, aws_resourcegroups as resourcegroups
from constructs import Construct

from ray_train_eks.constructs.launch_templates import (
    gp3_iops_problem,
    gp3_throughput_problem,
    PULL_IOPS,
    PULL_THROUGHPUT_MIBPS,
    launch_template_storage,
    node_disks,
    node_metadata_options,
)
from ray_train_eks.constructs.node_health import node_group_repair_config
from ray_train_eks.nag import acknowledge_node_role
# The GPU nodes' rules and defaults live in ray_train_eks/rules/gpu_nodes.py (no CDK import);
# imported back so that they stay importable from here.
from ray_train_eks.rules.gpu_nodes import (
    MAX_GPU_NODES,
    MIN_GPU_ROOT_VOLUME_GIB,
    capacity_reservation_problem,
    capacity_type_problem,
    efa_gpu_instance,
    efa_gpu_type_problem,
    gpu_node_count_problem,
    gpu_root_volume_problem,
    spot_reservation_problem,
)
from ray_train_eks.rules.reservations import (
    capacity_order_problem,
    placement_group_problem,
    reservation_ids_problem,
    reservation_selection_problem,
    reservation_type_problem,
)
from ray_train_eks.scheduling import GPU_TAINT_KEY
from ray_train_eks.validation import Prop, raise_problems

GPU_TAINT = eks.TaintSpec(key=GPU_TAINT_KEY, value="true", effect=eks.TaintEffect.NO_SCHEDULE)
#: The NVIDIA device plugin's node affinity selects on nvidia.com/gpu.present; the AL2023
#: NVIDIA AMI does not set it and we run no node-feature-discovery.
NVIDIA_PRESENT_LABEL = {"nvidia.com/gpu.present": "true"}
#: The GPU node group's ``UpdateConfig``: one node at a time, terminated before its successor launches.
GPU_UPDATE_CONFIG = {"MaxUnavailable": 1, "UpdateStrategy": "MINIMAL"}


def efa_network_interfaces(*, network_cards: int, security_group_ids: list[str]) -> list[ec2.CfnLaunchTemplate.NetworkInterfaceProperty]:
    """One EFA interface per network card. The primary interface is device 0 on card 0;
    the others are device 1 on their own card (the layout AWS documents for p4d/p5)."""
    return [
        ec2.CfnLaunchTemplate.NetworkInterfaceProperty(
            device_index=0 if card == 0 else 1,
            network_card_index=card,
            interface_type="efa",
            groups=security_group_ids,
            delete_on_termination=True,
        )
        for card in range(network_cards)
    ]


def efa_security_group(scope: Construct, id: str, vpc: ec2.IVpc) -> ec2.SecurityGroup:
    """The security group EFA needs: every protocol to and from its own members, nothing else.

    EFA's OS-bypass traffic is not TCP/UDP, so the rules are all-traffic, self-referencing.
    Egress: a rule to another group is a separate AWS::EC2::SecurityGroupEgress resource, so
    CDK drops its "no traffic" placeholder and the group would keep EC2's default allow-all
    egress. An inline rule that matches nothing (CDK's own placeholder) removes that default.
    The nodes' other egress comes from the cluster security group on the same interfaces
    (groups add up)."""
    group = ec2.SecurityGroup(
        scope, id, vpc=vpc, description="EFA: all traffic between the GPU nodes", allow_all_outbound=False
    )
    group.add_ingress_rule(group, ec2.Port.all_traffic(), "EFA from members")
    group.add_egress_rule(group, ec2.Port.all_traffic(), "EFA to members")
    group.node.default_child.security_group_egress = [
        ec2.CfnSecurityGroup.EgressProperty(
            ip_protocol="icmp", from_port=252, to_port=86, cidr_ip="255.255.255.255/32", description="Disallow all traffic"
        )
    ]
    return group


class EfaNodeGroup(Construct):
    """A managed node group of EFA-connected GPU nodes in one subnet and placement group.

    It creates: a security group that allows all traffic from and to itself (EFA's
    requirement); a ``cluster`` placement group; a launch template with one EFA interface
    per network card of the instance type (carrying the cluster security group and the
    EFA group: groups on an interface stop EKS adding the cluster group), IMDSv2 only and
    an encrypted gp3 root volume; and the node group on the AL2023 NVIDIA AMI, labelled
    ``nvidia.com/gpu.present=true`` and tainted ``nvidia.com/gpu=true:NoSchedule``.

    :param cluster: the EKS cluster.
    :param subnet: the one subnet (one AZ) all GPU nodes go to.
    :param instance_type: an EFA-capable GPU type of :data:`ray_train_eks.instances.INSTANCE_TYPES`. Default - g6.12xlarge.
    :param node_count: nodes (fixed size: min = desired = max). Default - 2.
    :param root_volume_gib: root volume size. Default - 50 on a type with local NVMe (every EFA GPU
        type: nodeadm puts containerd, kubelet and the pods' emptyDirs on a RAID0 of it, so the image
        pull and the checkpoints' staging run at NVMe speed), else 200 for the DLC image and the model cache.
    :param root_volume_throughput_mibps: gp3 throughput of a root volume that holds containerd (a
        type without NVMe). Default - 400.
    :param root_volume_iops: likewise. Default - 4000.
    :param labels: node labels. Default - ``nvidia.com/gpu.present=true`` (what the NVIDIA
        device plugin selects); pass more to add your own, that one is always set.
    :param taints: Default - ``nvidia.com/gpu=true:NoSchedule`` (the device plugins and
        RayWorkload's GPU workers tolerate it by default).
    :param capacity_type: ``on-demand``, ``spot``, or ``reserved`` (the reservations below; ``on-demand``
        with them means the same: a reservation holds On-Demand capacity). Default - on-demand, or
        reserved with reservations.
    :param capacity_reservation_ids: On-Demand Capacity Reservations to launch into (several: a capacity
        reservation group of them, which the launch template targets), or one Capacity Block. Default - none.
    :param capacity_reservation_id: one reservation (the earlier prop): the same as ``capacity_reservation_ids``.
    :param reservation_type: ``default`` (On-Demand Capacity Reservations) or ``capacity-block`` (EC2
        Capacity Blocks for ML: capacity type ``CAPACITY_BLOCK``, the launch template's market type
        ``capacity-block``, a minimum size of 0 so that EKS's scale-down 40 minutes before the block
        ends can take the nodes, and a group named after its block and launch template, so that the next
        block gets a new group whose nodes launch when it starts). Default - default.
    :param placement_group_name: an existing cluster placement group (the one the reservations were
        made in) instead of a new one. Default - a new one without reservations; with reservations
        none (a launch into a reservation made outside a placement group cannot go into one; a Capacity
        Block is in one UltraCluster already and AWS advises no placement group with it).
    :param fast_image_pull: nodeadm's ``FastImagePull`` feature gate in the NodeConfig the nodes boot
        with (SOCI's parallel pull and unpack; ray_train_eks/constructs/launch_templates.py). Default - on.
    :param node_repair: EKS node repair: a node whose ``AcceleratedHardwareReady`` stays false 10 minutes
        (``Ready`` and the node monitoring agent's other conditions: 30) is rebooted or replaced, up to
        half the group unhealthy (ray_train_eks.constructs.node_health ``node_group_repair_config``). Default - on.
    """

    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        cluster: eks.ICluster,
        subnet: ec2.ISubnet,
        instance_type: str = "g6.12xlarge",
        node_count: int = 2,
        root_volume_gib: int | None = None,
        root_volume_throughput_mibps: int = PULL_THROUGHPUT_MIBPS,
        root_volume_iops: int = PULL_IOPS,
        labels: Mapping[str, str] | None = None,
        taints: Sequence[eks.TaintSpec] = (GPU_TAINT,),
        capacity_reservation_id: str | None = None,
        capacity_type: str = "on-demand",
        node_repair: bool = True,
        capacity_reservation_ids: Sequence[str] = (),
        reservation_type: str = "default",
        placement_group_name: str | None = None,
        fast_image_pull: bool = True,
    ) -> None:
        super().__init__(scope, id)
        spec = self.instance = efa_gpu_instance("EfaNodeGroup", instance_type, node_count, root_volume_gib)
        #: NVMe for containerd and kubelet when the type has it, else a root volume with pull throughput.
        self.disks = node_disks(instance_type, root_volume_gib=root_volume_gib, throughput_mibps=root_volume_throughput_mibps,
                                iops=root_volume_iops)
        reservations = tuple(capacity_reservation_ids) + ((capacity_reservation_id,) if capacity_reservation_id else ())
        if reservations and capacity_type == "on-demand":
            capacity_type = "reserved"  # the earlier way to say it: a reservation holds On-Demand capacity
        raise_problems("EfaNodeGroup", [
            capacity_reservation_problem(capacity_reservation_id), reservation_ids_problem(capacity_reservation_ids),
            None if not (capacity_reservation_id and capacity_reservation_ids) else
            "capacity_reservation_id and capacity_reservation_ids: name the reservations in capacity_reservation_ids only",
            capacity_order_problem(capacity_type, Prop("capacity_type"), reserved=bool(reservations), karpenter=False),
            reservation_type_problem(reservation_type),
            reservation_selection_problem(reservations, {}, karpenter=False, reservation_type=reservation_type),
            placement_group_problem(placement_group_name, reservation_type=reservation_type if reservations else "default"),
            gp3_throughput_problem(root_volume_throughput_mibps, iops=root_volume_iops), gp3_iops_problem(root_volume_iops),
        ])
        #: The reservations the nodes launch into, and whether they are Capacity Blocks.
        self.reservation_ids, self.capacity_block = reservations, bool(reservations) and reservation_type == "capacity-block"
        self.fast_image_pull = fast_image_pull

        self.security_group = efa_security_group(self, "EfaSecurityGroup", cluster.vpc)
        placement, capacity = self._placement(reservations, placement_group_name)
        self.launch_template = self._launch_template(cluster, instance_type, spec.network_cards, placement, capacity)
        self.nodegroup = self._nodegroup(cluster, subnet, node_count, capacity_type, labels, taints)
        acknowledge_node_role(self.nodegroup)
        # An update (a launch template or AMI change) replaces the nodes one at a time, terminating
        # each before launching its successor: no surge of GPU instances, which the vCPU quota, the
        # placement group or a reservation often cannot hold (EKS API NodegroupUpdateConfig: the minimal
        # strategy "terminates the old instances before launching the new instances ... useful ... with
        # hardware accelerators such as GPUs"). The run is paused by an update either way.
        self.nodegroup.node.default_child.add_property_override("UpdateConfig", GPU_UPDATE_CONFIG)
        if node_repair:
            # aws_eks_v2's enable_node_auto_repair sets Enabled only; the thresholds go in as well.
            self.nodegroup.node.default_child.add_property_override("NodeRepairConfig", node_group_repair_config(node_count))

    def _placement(self, reservations: Sequence[str], placement_group_name: str | None) -> tuple[
        ec2.CfnLaunchTemplate.PlacementProperty | None, ec2.CfnLaunchTemplate.CapacityReservationSpecificationProperty | None
    ]:
        """The launch template's placement and capacity reservation: the reservation (several: a
        capacity reservation group of them) in the given placement group or none, else a ``cluster``
        placement group (``placement_group``: ours, or the one given)."""
        self.placement_group: ec2.PlacementGroup | None = None
        if placement_group_name:
            placement = ec2.CfnLaunchTemplate.PlacementProperty(group_name=placement_group_name)
        elif not reservations:
            self.placement_group = ec2.PlacementGroup(self, "PlacementGroup", strategy=ec2.PlacementGroupStrategy.CLUSTER)
            placement = ec2.CfnLaunchTemplate.PlacementProperty(group_name=self.placement_group.placement_group_name)
        else:
            placement = None
        if not reservations:
            return placement, None
        if len(reservations) == 1:
            target = ec2.CfnLaunchTemplate.CapacityReservationTargetProperty(capacity_reservation_id=reservations[0])
        else:
            target = ec2.CfnLaunchTemplate.CapacityReservationTargetProperty(
                capacity_reservation_resource_group_arn=self._reservation_group(reservations).attr_arn)
        Annotations.of(self).add_info(
            f"GPU nodes launch into {', '.join(reservations)} "
            + (f"in placement group {placement_group_name}" if placement_group_name else "without a placement group")
            + "; the reservations must be in the GPU subnet's AZ (the deploy's account checks read them)")
        # Reservations only: without the preference a launch that finds no room in a capacity reservation
        # group runs On-Demand (EC2 User Guide, "Capacity Reservation groups"), billing beside the
        # reservation; Karpenter's reserved launches say the same (launchtemplate/types.go).
        return placement, ec2.CfnLaunchTemplate.CapacityReservationSpecificationProperty(
            capacity_reservation_preference="capacity-reservations-only", capacity_reservation_target=target)

    def _reservation_group(self, reservations: Sequence[str]) -> resourcegroups.CfnGroup:
        """A capacity reservation group of ``reservations`` (EC2 User Guide, "Capacity Reservation
        groups"): a launch template targets one reservation or one such group, and EC2 launches into
        any member with room."""
        stack = Stack.of(self)
        self.reservation_group = resourcegroups.CfnGroup(
            self, "ReservationGroup", name=f"{stack.stack_name}-gpu-reservations",
            description="ray-train-eks GPU nodes capacity reservations",
            configuration=[
                resourcegroups.CfnGroup.ConfigurationItemProperty(type="AWS::EC2::CapacityReservationPool"),
                resourcegroups.CfnGroup.ConfigurationItemProperty(
                    type="AWS::ResourceGroups::Generic",
                    parameters=[resourcegroups.CfnGroup.ConfigurationParameterProperty(
                        name="allowed-resource-types", values=["AWS::EC2::CapacityReservation"])]),
            ],
            resources=[stack.format_arn(service="ec2", resource="capacity-reservation", resource_name=r) for r in reservations],
        )
        return self.reservation_group

    def _launch_template(
        self,
        cluster: eks.ICluster,
        instance_type: str,
        network_cards: int,
        placement: ec2.CfnLaunchTemplate.PlacementProperty | None,
        capacity: ec2.CfnLaunchTemplate.CapacityReservationSpecificationProperty | None,
    ) -> ec2.CfnLaunchTemplate:
        """The type, one EFA interface per network card, placement, IMDSv2 only and the disks."""
        return ec2.CfnLaunchTemplate(
            self,
            "LaunchTemplate",
            launch_template_data=ec2.CfnLaunchTemplate.LaunchTemplateDataProperty(
                # The type goes in the launch template, not the node group: aws_eks_v2's own GPU
                # list predates p5, p5en and gr6 and rejects the NVIDIA AMI for them.
                instance_type=instance_type,
                network_interfaces=efa_network_interfaces(
                    network_cards=network_cards,
                    security_group_ids=[cluster.cluster_security_group_id, self.security_group.security_group_id],
                ),
                placement=placement,
                capacity_reservation_specification=capacity,
                # EKS's "Capacity Blocks for ML" page: the market type, the reservation and the type in the template.
                instance_market_options=ec2.CfnLaunchTemplate.InstanceMarketOptionsProperty(market_type="capacity-block")
                if self.capacity_block else None,
                metadata_options=node_metadata_options(),
                **launch_template_storage(self.disks, fast_image_pull=self.fast_image_pull),
            ),
        )

    def _capacity_block_group_name(self, subnet: ec2.ISubnet) -> str:
        """The name of a node group on a Capacity Block: its block's id and a digest of its launch template
        and AZ, so that a new block (or any change of the template) makes a new group, never an update of
        this one (EKS user guide, "Create a managed node group with Capacity Blocks for ML"):

        - EKS scales the group to 0 forty minutes before its block ends (its own scheduled action) and never
          back; an update that changes only the launch template (the next block's id) applies no size, and
          the group would stay at 0. A new name makes CloudFormation replace the group: a create, whose
          desired size EKS honours, launching "whenever the reservation becomes active" (a scheduled block
          too), with EKS's scale-down set for the new block's end. CloudFormation deletes the old group in
          the update's clean-up, at once: the account checks refuse the next block while the current one
          still runs the nodes (handlers/reservation_checks.py ``handover_problems``).
        - The guide asks for desired size 0 while a Capacity Block group is upgraded; a group whose template
          changed is replaced instead, so none is upgraded (its nodes were replaced either way). The new group
          launches into the block as the old one's nodes leave it.

        The AZ and the subnet's CIDR block are in the digest because CloudFormation replaces a node group
        whose subnet changes (a new VPC CIDR makes new subnets in the same AZ), and a replacement of a named
        group needs a new name. A subnet imported without its CIDR block counts by its id."""
        stack = Stack.of(self)
        try:
            where = subnet.ipv4_cidr_block
        except Exception:  # noqa: BLE001 - jsii: an imported subnet given without its CIDR block
            where = subnet.subnet_id
        digest = hashlib.sha256(json.dumps([stack.resolve(self.launch_template.launch_template_data),
                                            stack.resolve(subnet.availability_zone), stack.resolve(where)],
                                           sort_keys=True).encode()).hexdigest()
        return f"gpu-{self.reservation_ids[0]}-{digest[:8]}"

    def _nodegroup(self, cluster: eks.ICluster, subnet: ec2.ISubnet, node_count: int, capacity_type: str,
                   labels: Mapping[str, str] | None, taints: Sequence[eks.TaintSpec]) -> eks.Nodegroup:
        """The fixed-size managed node group on the AL2023 NVIDIA AMI, from the launch template (on a
        Capacity Block, named after it: :meth:`_capacity_block_group_name`)."""
        return eks.Nodegroup(
            self,
            "Resource",
            cluster=cluster,
            nodegroup_name=self._capacity_block_group_name(subnet) if self.capacity_block else None,
            ami_type=eks.NodegroupAmiType.AL2023_X86_64_NVIDIA,
            # Spot: EKS enables capacity rebalancing and drains a node once its replacement is up
            # (best effort before the two-minute notice); a Capacity Block: EKS scales the group to 0
            # 40 minutes before the block ends (its own scheduled action); on-demand otherwise.
            capacity_type=(eks.CapacityType.SPOT if capacity_type == "spot" else
                           eks.CapacityType.CAPACITY_BLOCK if self.capacity_block else eks.CapacityType.ON_DEMAND),
            subnets=ec2.SubnetSelection(subnets=[subnet]),
            min_size=0 if self.capacity_block else node_count,
            desired_size=node_count,
            max_size=node_count,
            labels={**NVIDIA_PRESENT_LABEL, **(labels or {})},
            taints=list(taints),
            launch_template_spec=eks.LaunchTemplateSpec(
                id=self.launch_template.ref, version=self.launch_template.attr_latest_version_number
            ),
        )
