"""KarpenterGpuCapacity's rules (ray_train_eks/constructs/karpenter.py): its controller replicas, the
Kubernetes name of its EC2NodeClass and NodePool, and its AMI alias. No CDK here."""

from __future__ import annotations

import re

from ray_train_eks.validation import Prop

#: The AMI alias KarpenterGpuCapacity pins by default: an AL2023 EKS AMI release with Kubernetes 1.36
#: NVIDIA images (awslabs/amazon-eks-ami CHANGELOG, "AMI Release v20260714"; ``latest`` would drift
#: every node at each release). Newer: https://github.com/awslabs/amazon-eks-ami/releases
DEFAULT_AMI_ALIAS = "al2023@v20260714"
_K8S_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def replicas_problem(replicas: int, prop: Prop = Prop("replicas")) -> str | None:
    """Why ``replicas`` controllers cannot be, or None."""
    return f"{prop(replicas)}; the controller needs at least 1 replica" if replicas < 1 else None


def kubernetes_name_problem(name: str, prop: Prop = Prop("name")) -> str | None:
    """Why ``name`` cannot name the EC2NodeClass and NodePool, or None."""
    if not _K8S_NAME.match(name):
        return f"{prop(name)} is not a Kubernetes name (lower-case letters, digits, '-')"
    return None


def ami_alias_problem(alias: str, prop: Prop = Prop("ami_alias")) -> str | None:
    """Why ``alias`` is not an AL2023 AMI alias, or None."""
    if "@" not in alias or alias.split("@")[0] != "al2023":
        return (f"{prop(alias)}; use an AL2023 alias such as {DEFAULT_AMI_ALIAS} (Karpenter picks its NVIDIA variant "
                "for GPU types)")
    return None
