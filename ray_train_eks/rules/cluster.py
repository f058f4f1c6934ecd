"""The rules of the EKS cluster and its CPU system node group (ray_train_eks/constructs/cluster.py)."""

from __future__ import annotations

import ipaddress
import re
from typing import Sequence

from ray_train_eks.rules.disks import root_volume_problem
from ray_train_eks.validation import Prop

#: Kubernetes versions TrainingCluster can deploy: each needs a kubectl Lambda layer of the same
#: minor version (a mismatched layer fails late with "error retrieving RESTMappings to prune").
KUBECTL_LAYERS: dict[str, str] = {"1.36": "aws-cdk.lambda-layer-kubectl-v36"}
#: Versions EKS still creates on 2026-11-30 (standard or extended support).
EKS_SUPPORTED_VERSIONS = ("1.32", "1.33", "1.34", "1.35", "1.36")
#: The system nodes pull the Ray Train DLC image for the Ray head and the submitter.
MIN_SYSTEM_ROOT_VOLUME_GIB = 80
#: A system node's root volume without instance storage: the DLC image the head and the
#: submitter run (tens of GB unpacked, plus the compressed layers while pulling).
SYSTEM_ROOT_GIB_WITHOUT_INSTANCE_STORE = 100
MAX_SYSTEM_NODES = 10
_ARN = re.compile(r"^arn:aws(?:-cn|-us-gov)?:iam::(\d{12}):(role|user)/[\w+=,.@/-]{1,512}$")
_ASSUMED_ROLE = re.compile(r"^arn:aws(?:-cn|-us-gov)?:sts::(\d{12}):assumed-role/([\w+=,.@-]+)/")


def kubernetes_version_problem(version: str, prop: Prop = Prop("kubernetes_version")) -> str | None:
    """Why the cluster cannot run Kubernetes ``version``, or None."""
    if not re.fullmatch(r"1\.\d{2}", version):
        return f"{prop(version)}: not a Kubernetes minor version; use 1.36"
    if version not in EKS_SUPPORTED_VERSIONS:
        return f"{prop(version)}: outside EKS support on 2026-11-30 (EKS cannot create it); use 1.36"
    if version not in KUBECTL_LAYERS:
        pinned = ", ".join(f"{v} with {layer}" for v, layer in KUBECTL_LAYERS.items())
        return f"{prop(version)}: no matching kubectl layer in this app (pinned: {pinned}); use 1.36"
    return None


def endpoint_cidrs_problems(cidrs: Sequence[str], prop: Prop = Prop("endpoint_access_cidrs")) -> list[str]:
    """What is wrong with the public endpoint's CIDRs (IPv4 networks, at least one)."""
    if not cidrs:
        return [f"{prop.name}: empty; give at least one CIDR, e.g. {prop.example('203.0.113.0/24')}"]
    problems = []
    for cidr in cidrs:
        try:
            network = ipaddress.ip_network(cidr, strict=True)
        except ValueError as error:
            try:
                fix = f"; did you mean {ipaddress.ip_network(cidr, strict=False)}?"
            except ValueError:
                fix = "; use the form 203.0.113.0/24"
            problems.append(f"{prop.name}: {cidr!r} is not a valid CIDR ({error}){fix}")
            continue
        if network.version != 4:
            problems.append(f"{prop.name}: {cidr!r} is IPv6; the EKS public endpoint accepts IPv4 CIDRs only")
    return problems


def admin_principal_problem(arn: str | None, prop: Prop = Prop("admin_role_arn"), *, account: str | None = None) -> str | None:
    """Why ``arn`` cannot get cluster-admin through an access entry (of ``account``, when known), or None."""
    if arn is None:
        return None
    assumed = _ASSUMED_ROLE.match(arn)
    if assumed:
        return (f"{prop(arn)}: an assumed-role session ARN; use the role's ARN, "
                f"arn:aws:iam::{assumed.group(1)}:role/{assumed.group(2)}")
    match = _ARN.match(arn)
    if not match:
        return f"{prop(arn)}: not an IAM role or user ARN; use the form arn:aws:iam::123456789012:role/NAME"
    if account and match.group(1) != account:
        return (f"{prop(arn)}: belongs to account {match.group(1)}, not the stack's account {account}; "
                f"use a principal of {account}")
    return None


def system_root_volume_problem(size_gib: int | None, prop: Prop = Prop("system_root_volume_gib"), *,
                               instance_type: str = "m7i.xlarge") -> str | None:
    """Why a system node's root volume of ``size_gib`` is too small for ``instance_type``, or None."""
    return root_volume_problem(size_gib, instance_type, minimum_without_instance_store=MIN_SYSTEM_ROOT_VOLUME_GIB,
                               default_without_instance_store=SYSTEM_ROOT_GIB_WITHOUT_INSTANCE_STORE, prop=prop,
                               what="the Ray head and the job submitter, which run the Ray Train DLC image")


def system_node_count_problem(count: int, prop: Prop = Prop("system_node_count")) -> str | None:
    """Why ``count`` system nodes cannot be, or None."""
    if not 1 <= count <= MAX_SYSTEM_NODES:
        return f"{prop(count)}: use 1 to {MAX_SYSTEM_NODES} system nodes (default 1)"
    return None
