"""cdk-nag acknowledgments, each with its reason, next to the resource it concerns."""

from __future__ import annotations

from aws_cdk import Acknowledgment, Validations
from constructs import IConstruct

#: Managed policies EKS itself requires on every node role.
EKS_NODE_MANAGED_POLICIES = ("AmazonEKSWorkerNodePolicy", "AmazonEKS_CNI_Policy", "AmazonEC2ContainerRegistryReadOnly")


def managed_policy_rule(policy: str, *, service_role: bool = False) -> str:
    """The AwsSolutions-IAM4 finding id of one AWS managed policy."""
    prefix = "service-role/" if service_role else ""
    return f"AwsSolutions-IAM4[Policy::arn:<AWS::Partition>:iam::aws:policy/{prefix}{policy}]"


def acknowledge(scope: IConstruct, reason: str, *rules: str) -> None:
    """Acknowledge cdk-nag findings ``rules`` on ``scope`` and its children, for ``reason``."""
    Validations.of(scope).acknowledge(*(Acknowledgment(id=f"AwsSolutions::{rule}", reason=reason) for rule in rules))


def acknowledge_node_role(nodegroup: IConstruct) -> None:
    """The managed policies of an EKS managed node group's role."""
    acknowledge(
        nodegroup,
        "EKS requires these AWS managed policies on node roles (kubelet registration, VPC CNI, image pulls); "
        "AWS keeps them in step with EKS.",
        *(managed_policy_rule(p) for p in EKS_NODE_MANAGED_POLICIES),
    )


def rendered(scope: IConstruct, value: str) -> str:
    """``value`` (a string that may hold tokens) as cdk-nag writes it in a finding id: a
    reference as ``<LogicalId>``, an attribute as ``<LogicalId.Attr>``, a pseudo parameter as
    ``<AWS::Region>``, joins joined; so an acknowledgment can name exactly one finding."""
    from aws_cdk import Stack

    def render(part) -> str:
        if isinstance(part, str):
            return part
        if "Ref" in part:
            return f"<{part['Ref']}>"
        if "Fn::GetAtt" in part:
            return f"<{'.'.join(part['Fn::GetAtt'])}>"
        if "Fn::Join" in part:
            separator, parts = part["Fn::Join"]
            return separator.join(render(p) for p in parts)
        raise ValueError(f"cannot render {part!r} as cdk-nag does")

    return render(Stack.of(scope).resolve(value))
