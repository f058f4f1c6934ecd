"""The platform settings' checks that read other settings too (the region's AZs, a reservation
with Karpenter, the trainers and the admin, ...), and :func:`_rule`, which makes a setting's check
of a construct's rule (``ray_train_eks.rules.*``). No CDK here."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

from ray_train_eks.helm_charts import DEFAULT_PACKAGES_DIR as DEFAULT_CHART_PACKAGES, packages_dir
from ray_train_eks.instances import INSTANCE_TYPES, cpu_instance_types
from ray_train_eks.regions import EKS_REGISTRY_ACCOUNTS
from ray_train_eks.rules.cluster import admin_principal_problem
from ray_train_eks.rules.reservations import (capacity_order_problem, named_reservations, parse_tags,
                                             reservation_selection_problem)
from ray_train_eks.settings import Check, ConfigView
from ray_train_eks.tracking import tracking_choice_problem
from ray_train_eks.validation import context_key

#: How the GPU nodes come: a fixed managed node group, or Karpenter while Ray pods need them.
GPU_CAPACITY_MODES = ("nodegroup", "karpenter")
_ACCOUNT = re.compile(r"^\d{12}$")
_AMI_VERSION = re.compile(r"^v\d{8}$")
_STACK_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9-]{0,127}$")


def _region(value: str, config: ConfigView) -> str | None:
    if value not in EKS_REGISTRY_ACCOUNTS:
        return (f"region={value!r}: not a region this app supports (no known EKS add-on image registry); "
                f"use one of {', '.join(sorted(EKS_REGISTRY_ACCOUNTS))}")
    return None


def _account(value: str | None, config: ConfigView) -> str | None:
    if value is not None and not _ACCOUNT.match(value):
        return f"account={value!r}: an AWS account id is 12 digits, e.g. -c account=123456789012"
    return None


def _availability_zones(azs: tuple[str, ...], config: ConfigView) -> list[str]:
    if not azs:
        return []
    region, problems = config.region, []
    if len(azs) != 2:
        problems.append(
            f"availabilityZones={','.join(azs)!r}: give exactly two AZs (EKS needs two for the control plane; "
            f"the GPU nodes use the first), e.g. -c availabilityZones={region}a,{region}b"
        )
    wrong = [az for az in azs if not re.fullmatch(re.escape(region) + r"[a-z]", az)]
    if wrong:
        problems.append(f"availabilityZones: {', '.join(wrong)} not of region {region}; use AZ names like {region}a, {region}b")
    if len(set(azs)) != len(azs):
        problems.append(f"availabilityZones={','.join(azs)!r}: the two AZs must differ")
    return problems


def _system_instance_type(value: str, config: ConfigView) -> str | None:
    system = INSTANCE_TYPES.get(value)
    if system is None or system.gpus:
        return f"systemInstanceType={value!r}: not a known CPU instance type; use one of {', '.join(cpu_instance_types())}"
    if system.vcpus < 4:
        return (f"systemInstanceType={value!r}: {system.vcpus} vCPUs cannot hold the KubeRay operator, the Ray head and "
                "the cluster add-ons; use m7i.xlarge or larger")
    return None


def _queueing(value: str, config: ConfigView) -> str | None:
    if value not in ("none", "kueue"):
        return f"queueing={value!r}: use none (the default) or kueue (queue the Ray jobs with Kueue)"
    if value == "kueue" and config.workload == "cluster":
        return ("queueing=kueue with workload=cluster: Kueue does not queue a RayJob that runs on a standing RayCluster; "
                "use -c workload=job, or -c queueing=none")
    return None


def _gpu_capacity(value: str, config: ConfigView) -> str | None:
    if value not in GPU_CAPACITY_MODES:
        return (f"gpuCapacity={value!r}: use nodegroup (GPU nodes always up, the default) or karpenter "
                "(GPU nodes only while a job runs)")
    return None


def _capacity_type(value: str, config: ConfigView) -> list[str]:
    """The order of capacity types against the reservations and the mode (ray_train_eks/rules/reservations.py)."""
    karpenter = config.gpu_capacity == "karpenter"
    ids = named_reservations(config.capacity_reservation_ids, config.capacity_reservation_id)
    tags = parse_tags(config.capacity_reservation_tags)
    found = []
    if config.capacity_reservation_ids and config.capacity_reservation_id:
        found.append(f"capacityReservationId={config.capacity_reservation_id!r} and capacityReservationIds: name the "
                     "reservations in capacityReservationIds only")
    found.append(reservation_selection_problem(
        ids, tags, karpenter=karpenter, reservation_type=config.capacity_reservation_type,
        ids_prop=context_key("capacityReservationIds"), tags_prop=context_key("capacityReservationTags")))
    order = value or ("reserved" if ids or tags else "on-demand")
    found.append(capacity_order_problem(order, context_key("gpuCapacityType"), reserved=bool(ids or tags), karpenter=karpenter,
                                        reservation_prop=context_key("capacityReservationIds")))
    return [problem for problem in found if problem]


#: AL2023 releases where nodeadm's FastImagePull is wrong for these nodes (awslabs/amazon-eks-ami
#: CHANGELOG): before v20251217 the RAID0 layout left SOCI's store on the root volume (PR #2548, "mount
#: soci directory to instance store"), where the DLC image's layers would fill the 50 GiB root;
#: v20260505's containerd 2.2.3 deadlocks pod sandboxes with the gate on (issues #2710, #2712; fixed in
#: v20260512).
FAST_PULL_ON_INSTANCE_STORE = "v20251217"
FAST_PULL_DEADLOCK = "v20260505"


def _ami_version(value: str, config: ConfigView) -> str | None:
    if not (_AMI_VERSION.match(value) or value == "latest"):
        return (f"gpuAmiVersion={value!r}: an AL2023 EKS AMI release is v + 8 digits, e.g. -c gpuAmiVersion=v20260714 "
                "(https://github.com/awslabs/amazon-eks-ami/releases)")
    if config.gpu_capacity != "karpenter" or not config.fast_image_pull or value == "latest":
        return None
    if value < FAST_PULL_ON_INSTANCE_STORE:
        return (f"gpuAmiVersion={value!r} with fastImagePull=true: before {FAST_PULL_ON_INSTANCE_STORE} the RAID0 of the "
                "instance store leaves SOCI's image store on the root volume, which the DLC image would fill; use "
                "-c gpuAmiVersion=v20260714, or -c fastImagePull=false")
    if value == FAST_PULL_DEADLOCK:
        return (f"gpuAmiVersion={value!r} with fastImagePull=true: its containerd deadlocks pod sandboxes with SOCI "
                "(awslabs/amazon-eks-ami#2710, fixed in v20260512); use -c gpuAmiVersion=v20260714, or -c fastImagePull=false")
    return None


def _serving_gpu_nodes(value: int, config: ConfigView) -> str | None:
    """Serving's GPU nodes: with the node group they are taken from its nodes, so at most its size."""
    if value < 0:
        return f"servingGpuNodes={value}: give the GPU nodes serving may take (0 turns serving off), e.g. -c servingGpuNodes=1"
    if config.gpu_capacity == "nodegroup" and value > config.gpu_node_count >= 1:  # fewer than 1: its own problem
        return (f"servingGpuNodes={value} with gpuNodeCount={config.gpu_node_count}: serving's replicas run on the node "
                f"group's nodes, so at most {config.gpu_node_count}; or -c gpuCapacity=karpenter for nodes of its own")
    return None


def _serving_idle_minutes(value: int, config: ConfigView) -> str | None:
    if value < 1:
        return f"servingIdleMinutes={value}: a replica needs at least a minute without requests before it goes, e.g. 15"
    return None


def _mlflow_tracking(value: str, config: ConfigView) -> str | None:
    """``auto``, ``app`` (where the region has MLflow Apps) or ``none`` (without a URI): ray_train_eks/tracking.py."""
    return tracking_choice_problem(value, region=config.region, uri=config.mlflow_tracking_uri)


def _stack_name(value: str, config: ConfigView) -> str | None:
    if not _STACK_NAME.match(value):
        return f"stackName={value!r}: use letters, digits and hyphens, starting with a letter"
    return None


def _chart_packages(value: str, config: ConfigView) -> list[str]:
    from ray_train_eks.helm_charts import INSTALLED_CHARTS, verified_package

    if value in ("auto", "none"):
        folder = packages_dir(value)
    else:
        folder = Path(value)
        if not folder.is_dir():
            return [f"chartPackages={value!r}: no such folder; use auto (the `make upstream` cache when it is there), none "
                    "(every chart from its repository), or a folder that `make upstream` filled"]
    problems = []
    for pin in INSTALLED_CHARTS:
        try:
            found = verified_package(pin, folder)
        except ValueError as error:
            problems.append(f"chartPackages={value!r}: {error}")
            continue
        if found is None and pin.sha256 is not None and value not in ("auto", "none"):
            problems.append(f"chartPackages={value!r}: {pin.package} is not there; run `make upstream` (it fills "
                            f"{DEFAULT_CHART_PACKAGES}), or use -c chartPackages=auto")
    return problems


def trainer_roles_problems(arns: tuple[str, ...], config: ConfigView) -> list[str]:
    """Each trainer must be an IAM role or user ARN, once, and not the admin: EKS takes one access
    entry per principal ("An IAM principal can't be included in more than one access entry")."""
    problems = [p for arn in arns if (p := admin_principal_problem(arn, context_key("trainerRoleArns"), account=config.account))]
    repeated = sorted({arn for arn in arns if arns.count(arn) > 1})
    if repeated:
        problems.append(f"trainerRoleArns lists {', '.join(repeated)} more than once; EKS takes one access entry per principal")
    if config.admin_role_arn and config.admin_role_arn in arns:
        problems.append(f"trainerRoleArns={config.admin_role_arn!r} is the adminRoleArn too; EKS takes one access entry per "
                        "principal, and the admin can already do what a trainer does: drop it from trainerRoleArns")
    return problems


def _rule(problem: Callable[..., Any], key: str, **extra: Callable[[ConfigView], Any]) -> Check:
    """A check that calls a construct's rule for the context key ``key`` (extra keyword
    arguments are read from the config)."""
    return lambda value, config: problem(value, context_key(key), **{k: get(config) for k, get in extra.items()})
