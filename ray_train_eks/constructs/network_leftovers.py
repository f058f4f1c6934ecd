"""A last step of ``cdk destroy``: the network interfaces the VPC CNI left in the GPU nodes'
security groups (ray_train_eks/handlers/network_leftovers.py), which would keep the groups and
the subnet from being deleted."""

from __future__ import annotations

from typing import Sequence

from aws_cdk import Duration, Stack, Token, aws_ec2 as ec2, aws_iam as iam
from constructs import Construct, IConstruct

from ray_train_eks.constructs.custom_resource import PythonCustomResource
from ray_train_eks.nag import acknowledge


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
        region = "<AWS::Region>" if Token.is_unresolved(stack.region) else stack.region
        account = "<AWS::AccountId>" if Token.is_unresolved(stack.account) else stack.account
        acknowledge(self.resource,
                    "DescribeNetworkInterfaces cannot be scoped to resources; the handler deletes only available "
                    "interfaces of the security groups it is given, which no tag or condition key can name beforehand.",
                    "AwsSolutions-IAM5[Resource::*]",
                    f"AwsSolutions-IAM5[Resource::arn:<AWS::Partition>:ec2:{region}:{account}:network-interface/*]")
        # Created after, so deleted before, the groups.
        self.resource.node.add_dependency(*security_groups)

    def goes_after(self, *resources: IConstruct) -> None:
        """On destroy, this runs once ``resources`` are deleted (they are created after it)."""
        for resource in resources:
            resource.node.add_dependency(self.resource)
