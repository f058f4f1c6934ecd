"""Checks of the account the GPU nodes need, run at the start of a deploy."""

from __future__ import annotations

from aws_cdk import Stack, aws_iam as iam
from constructs import Construct

from ray_train_eks.constructs.custom_resource import PythonCustomResource
from ray_train_eks.handlers.account_checks import AMI_PATH
from ray_train_eks.instances import INSTANCE_TYPES
from ray_train_eks.nag import acknowledge, rendered
from ray_train_eks.validation import raise_problems

#: EC2's regional vCPU quotas of the GPU families, by (family, capacity type): Service Quotas'
#: codes and names (the handler reports the name it is given).
GPU_QUOTAS: dict[tuple[str, str], tuple[str, str]] = {
    ("G", "on-demand"): ("L-DB2E81BA", "Running On-Demand G and VT instances"),
    ("P", "on-demand"): ("L-417A185B", "Running On-Demand P instances"),
    ("G", "spot"): ("L-3819A6DF", "All G and VT Spot Instance Requests"),
    ("P", "spot"): ("L-7212CCBC", "All P Spot Instance Requests"),
}


def gpu_quota(instance_type: str, capacity_type: str = "on-demand") -> tuple[str, str]:
    """The quota (code, name) that ``instance_type`` nodes count against."""
    family = "P" if instance_type.startswith("p") else "G"
    return GPU_QUOTAS[(family, capacity_type)]


class AccountChecks(Construct):
    """Fails the deploy in its first minute, with every problem and its fix, when the account
    cannot run the GPU nodes: the family's vCPU quota is too low, the type is not offered in
    the GPU AZ, or the AMI release does not exist for the Kubernetes version in the region
    (``ray_train_eks/handlers/account_checks.py``). Put what is slow to build after it
    (``node.add_dependency``).

    Its function may read the one quota, the offerings, and the EKS AMIs' public parameters:
    nothing else.

    :param instance_type: the GPU type (a row of the instance table).
    :param node_count: GPU nodes at most.
    :param availability_zone: the GPU nodes' AZ (a name, or the token of the stack's first AZ).
    :param kubernetes_version: Default - 1.36.
    :param ami_release: the AL2023 release the nodes boot (``v20260714`` or ``latest``). Default -
        none: EKS picks it (a managed node group); the recommended one must exist.
    :param capacity_type: ``on-demand`` or ``spot`` (another quota). Default - on-demand.
    """

    def __init__(self, scope: Construct, id: str, *, instance_type: str, node_count: int, availability_zone: str,
                 kubernetes_version: str = "1.36", ami_release: str = "", capacity_type: str = "on-demand") -> None:
        super().__init__(scope, id)
        spec = INSTANCE_TYPES.get(instance_type)
        raise_problems("AccountChecks", [
            None if spec and spec.gpus else f"instance_type={instance_type!r}: not a GPU type of the instance table",
            None if capacity_type in ("on-demand", "spot") else f"capacity_type={capacity_type!r}; use on-demand or spot",
        ])
        code, name = gpu_quota(instance_type, capacity_type)
        stack = Stack.of(self)
        ami_path = AMI_PATH.format(k8s=kubernetes_version)
        self.resource = PythonCustomResource(
            self,
            "Resource",
            handler="account_checks.on_event",
            description="Checks the GPU quota, the GPU type's AZs and the AMI release before anything is built",
            properties={
                "InstanceType": instance_type,
                "InstanceCount": str(node_count),
                "VcpusPerInstance": str(spec.vcpus),
                "QuotaCode": code,
                "QuotaName": name,
                "AvailabilityZone": availability_zone,
                "KubernetesVersion": kubernetes_version,
                "AmiRelease": ami_release,
            },
            statements=[
                iam.PolicyStatement(actions=["servicequotas:GetServiceQuota"],
                                    resources=[stack.format_arn(service="servicequotas", resource="ec2", resource_name=code)]),
                # GetAWSDefaultServiceQuota and the EC2 Describe calls have no resource type.
                iam.PolicyStatement(actions=["servicequotas:GetAWSDefaultServiceQuota", "ec2:DescribeInstanceTypeOfferings"],
                                    resources=["*"]),
                iam.PolicyStatement(
                    actions=["ssm:GetParameter", "ssm:GetParametersByPath"],
                    resources=[f"arn:{stack.partition}:ssm:{stack.region}::parameter{ami_path}",
                               f"arn:{stack.partition}:ssm:{stack.region}::parameter{ami_path}/*"],
                ),
            ],
        )
        acknowledge(
            self.resource,
            "GetAWSDefaultServiceQuota and ec2:DescribeInstanceTypeOfferings support no resource-level permissions "
            "(Service Authorization Reference), and the EKS AMIs' public parameters are one path of releases.",
            "AwsSolutions-IAM5[Resource::*]",
            f"AwsSolutions-IAM5[Resource::{rendered(self, f'arn:{stack.partition}:ssm:{stack.region}::parameter{ami_path}/*')}]",
        )
