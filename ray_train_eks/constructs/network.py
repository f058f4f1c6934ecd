"""The VPC the platform runs in."""

from __future__ import annotations

from typing import Sequence

from aws_cdk import RemovalPolicy, aws_ec2 as ec2, aws_logs as logs
from constructs import Construct

from ray_train_eks.constructs.keys import allow_logs_to_use, customer_managed_key

#: The AZs a new VPC spans: EKS needs two for the control plane, and the GPU nodes use one.
VPC_AZS = 2


class TrainingNetwork(Construct):
    """A VPC over two AZs with public and private subnets, one NAT gateway and flow logs.

    EKS needs control-plane subnets in two AZs, so the VPC spans two; the GPU nodes use
    only :attr:`gpu_subnet`, the private subnet of the first AZ, so that a cluster
    placement group can hold them. Pass ``existing_vpc`` to use a VPC of your own (it
    must have private subnets with egress in at least two AZs).

    :param availability_zones: AZ names for a new VPC. Default - the stack's first two AZs.
    :param existing_vpc: a VPC to use instead of creating one. Default - a new VPC.
    :param cidr: the new VPC's IPv4 range. Default - 10.0.0.0/16.
    """

    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        availability_zones: Sequence[str] | None = None,
        existing_vpc: ec2.IVpc | None = None,
        cidr: str = "10.0.0.0/16",
    ) -> None:
        super().__init__(scope, id)
        if existing_vpc is not None and availability_zones:
            raise ValueError(
                "TrainingNetwork: pass availability_zones or existing_vpc, not both "
                "(an existing VPC already has its AZs)"
            )
        if existing_vpc is not None:
            self.vpc = existing_vpc
        else:
            self.vpc = ec2.Vpc(
                self,
                "Resource",
                ip_addresses=ec2.IpAddresses.cidr(cidr),
                availability_zones=list(availability_zones) if availability_zones else None,
                max_azs=None if availability_zones else VPC_AZS,
                nat_gateways=1,
                subnet_configuration=[
                    ec2.SubnetConfiguration(name="Public", subnet_type=ec2.SubnetType.PUBLIC, cidr_mask=24),
                    # /19: VPC CNI gives every pod a VPC address; GPU nodes alone take dozens.
                    ec2.SubnetConfiguration(name="Private", subnet_type=ec2.SubnetType.PRIVATE_WITH_EGRESS, cidr_mask=19),
                ],
            )
            # A customer-managed key, as for the cluster's secrets; it goes with the logs.
            self.flow_logs_key = customer_managed_key(self, "FlowLogsKey", description="Encryption of the VPC flow logs",
                                                      removal_policy=RemovalPolicy.DESTROY)
            allow_logs_to_use(self.flow_logs_key)
            flow_log_group = logs.LogGroup(
                self,
                "FlowLogs",
                retention=logs.RetentionDays.ONE_MONTH,
                removal_policy=RemovalPolicy.DESTROY,
                encryption_key=self.flow_logs_key,
            )
            self.vpc.add_flow_log(
                "FlowLog",
                destination=ec2.FlowLogDestination.to_cloud_watch_logs(flow_log_group),
                traffic_type=ec2.FlowLogTrafficType.ALL,
            )
        private = self.vpc.select_subnets(subnet_type=ec2.SubnetType.PRIVATE_WITH_EGRESS).subnets
        if not private:
            raise ValueError("TrainingNetwork: the VPC has no private subnets with egress; the nodes need them")
        #: The one private subnet (first AZ) that holds every GPU node.
        self.gpu_subnet: ec2.ISubnet = private[0]
