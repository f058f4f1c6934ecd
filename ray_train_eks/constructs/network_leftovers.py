"""A last step of ``cdk destroy``: the network interfaces the VPC CNI left in the GPU nodes'
security groups (ray_train_eks/handlers/network_leftovers.py), which would keep the groups and
the subnet from being deleted."""

from __future__ import annotations

from typing import Sequence

from aws_cdk import Duration, Stack, aws_ec2 as ec2, aws_iam as iam
from constructs import Construct, IConstruct

from ray_train_eks.constructs.custom_resource import PythonCustomResource
from ray_train_eks.nag import acknowledge, wildcard_rule


def _ec2_wildcards(scope: Construct, *kinds: str) -> list[str]:
    """cdk-nag's finding ids for ``arn:...:ec2:<region>:<account>:<kind>/*`` resources of ``scope``'s stack."""
    stack = Stack.of(scope)
    return [wildcard_rule(scope, stack.format_arn(service="ec2", resource=kind, resource_name="*")) for kind in kinds]


class NetworkLeftoverCleanup(Construct):
    """On delete, the ``available`` network interfaces of ``security_groups`` and of
    ``other_group_ids`` are deleted, and the delete waits until no interface of
    ``security_groups`` (groups only the GPU nodes use) is left in use.

    Deleted after whatever is passed to :meth:`goes_after` (the GPU capacity) and before the
    groups (and, by the caller's dependencies, the subnet and the VPC).

    :param other_group_ids: groups shared with the control plane (the cluster security group):
        their available interfaces are deleted, their in-use ones are left alone.
    :param wait_seconds: how long an interface may stay in use. Default - 5 minutes.
    """

    def __init__(self, scope: Construct, id: str, *, security_groups: Sequence[ec2.ISecurityGroup],
                 other_group_ids: Sequence[str] = (), wait_seconds: int = 300) -> None:
        super().__init__(scope, id)
        stack = Stack.of(self)
        groups = [group.security_group_id for group in security_groups]
        self.resource = PythonCustomResource(
            self, "Resource", handler="network_leftovers.on_event",
            description="ray-train-eks: on delete, the network interfaces left in the GPU nodes' security groups",
            properties={"Region": stack.region, "SecurityGroupIds": [*groups, *other_group_ids], "EmptyGroupIds": groups,
                        "WaitSeconds": wait_seconds},
            timeout=Duration.seconds(min(wait_seconds + 120, 14 * 60)),
            statements=[
                iam.PolicyStatement(actions=["ec2:DescribeNetworkInterfaces"], resources=["*"]),
                iam.PolicyStatement(actions=["ec2:DeleteNetworkInterface"], resources=[
                    stack.format_arn(service="ec2", resource="network-interface", resource_name="*")]),
            ],
        )
        acknowledge(self.resource,
                    "DescribeNetworkInterfaces cannot be scoped to resources; the handler deletes only available "
                    "interfaces of the security groups it is given, which no tag or condition key can name beforehand.",
                    "AwsSolutions-IAM5[Resource::*]", *_ec2_wildcards(self, "network-interface"))
        # Created after, so deleted before, the groups.
        self.resource.node.add_dependency(*security_groups)

    def goes_after(self, *resources: IConstruct) -> None:
        """On destroy, this runs once ``resources`` are deleted (they are created after it)."""
        for resource in resources:
            resource.node.add_dependency(self.resource)


class GuardDutyLeftoverCleanup(Construct):
    """On delete, the VPC endpoint and security group GuardDuty's automated agent created in ``vpc``
    (ray_train_eks/handlers/guardduty_leftovers.py), which would keep the subnets and the VPC from
    being deleted. Deleted after whatever is passed to :meth:`goes_after` (the cluster) and before the
    VPC and its subnets. Does nothing where GuardDuty created nothing.

    :param wait_seconds: how long the group may stay in use by the endpoint's interfaces. Default - 10 minutes.
    """

    def __init__(self, scope: Construct, id: str, *, vpc: ec2.IVpc, wait_seconds: int = 600) -> None:
        super().__init__(scope, id)
        stack = Stack.of(self)
        self.resource = PythonCustomResource(
            self, "Resource", handler="guardduty_leftovers.on_event",
            description="ray-train-eks: on delete, GuardDuty's VPC endpoint and security group in the stack's VPC",
            properties={"Region": stack.region, "VpcId": vpc.vpc_id, "WaitSeconds": wait_seconds},
            timeout=Duration.seconds(min(wait_seconds + 120, 14 * 60)),
            statements=[
                iam.PolicyStatement(actions=["ec2:DescribeVpcEndpoints", "ec2:DescribeSecurityGroups"], resources=["*"]),
                # Only what GuardDuty made: its tag on the endpoints, its group in this VPC.
                iam.PolicyStatement(actions=["ec2:DeleteVpcEndpoints"], resources=[
                    stack.format_arn(service="ec2", resource="vpc-endpoint", resource_name="*")],
                    conditions={"StringEquals": {"aws:ResourceTag/GuardDutyManaged": "true"}}),
                iam.PolicyStatement(actions=["ec2:DeleteSecurityGroup"], resources=[
                    stack.format_arn(service="ec2", resource="security-group", resource_name="*")],
                    conditions={"ArnEquals": {"ec2:Vpc": stack.format_arn(service="ec2", resource="vpc",
                                                                          resource_name=vpc.vpc_id)}}),
            ],
        )
        acknowledge(self.resource,
                    "Describe calls take no resource; the deletes are held to GuardDuty's tag and to this VPC by "
                    "condition keys, on resources GuardDuty names at run time.",
                    "AwsSolutions-IAM5[Resource::*]", *_ec2_wildcards(self, "vpc-endpoint", "security-group"))
        # Created after, so deleted before, the VPC and its subnets.
        self.resource.node.add_dependency(vpc)

    def goes_after(self, *resources: IConstruct) -> None:
        """On destroy, this runs once ``resources`` are deleted (they are created after it)."""
        for resource in resources:
            resource.node.add_dependency(self.resource.resource)  # the custom resource alone, not its function
