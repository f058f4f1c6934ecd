"""The platform's configuration: one frozen object built from CDK context and validated
once, at synth, so that bad input fails in seconds instead of twenty minutes into a deploy.

Context comes from ``cdk.json`` (defaults) and ``cdk synth -c key=value`` (overrides,
always strings). :func:`PlatformConfig.from_context` parses them; :meth:`validate` collects
every problem and raises them together in one :class:`ConfigError`.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shlex
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Mapping

from ray_train_eks.capacity import MIN_HEAD_CPU_M, SystemNodeBudget, system_node_budget
from ray_train_eks.charts.ray_workload import RayWorkloadSpec, head_sizing, workload_problems
from ray_train_eks.instances import INSTANCE_TYPES, cpu_instance_types, gpu_efa_instance_types
from ray_train_eks.observability import (
    ADDON_VERSION,
    LOG_RETENTION_DAYS,
    MIN_POD_IDENTITY_ADDON_VERSION,
    TRAINING_METRICS_NAMESPACE,
)
from ray_train_eks.regions import EKS_REGISTRY_ACCOUNTS
from ray_train_eks.scheduling import DO_NOT_DISRUPT, GPU_NODE_SELECTOR, SYSTEM_NODE_SELECTOR

#: Kubernetes versions this app can deploy: each needs a kubectl Lambda layer of the same
#: minor version (a mismatched layer fails late with "error retrieving RESTMappings to prune").
KUBECTL_LAYERS: dict[str, str] = {"1.36": "aws-cdk.lambda-layer-kubectl-v36"}
#: Versions EKS still creates on 2026-11-30 (standard or extended support).
EKS_SUPPORTED_VERSIONS = ("1.32", "1.33", "1.34", "1.35", "1.36")
#: Above this, a typo is likelier than a real order of GPU nodes in one placement group.
MAX_GPU_NODES = 64
#: The DLC image alone unpacks to tens of GB; below this a node cannot hold it.
MIN_GPU_ROOT_VOLUME_GIB = 100
#: How the GPU nodes come: a fixed managed node group, or Karpenter while Ray pods need them.
GPU_CAPACITY_MODES = ("nodegroup", "karpenter")
#: In karpenter mode, without preRunningDeadlineSeconds: time for both GPU nodes to launch,
#: join and pull the DLC image (tens of GB) before the job is declared stuck.
KARPENTER_PRE_RUNNING_DEADLINE_SECONDS = 1800
#: The system nodes pull the same image for the Ray head and the submitter.
MIN_SYSTEM_ROOT_VOLUME_GIB = 80

_ARN = re.compile(r"^arn:aws(?:-cn|-us-gov)?:iam::(\d{12}):(role|user)/[\w+=,.@/-]{1,512}$")
_ASSUMED_ROLE = re.compile(r"^arn:aws(?:-cn|-us-gov)?:sts::(\d{12}):assumed-role/([\w+=,.@-]+)/")
_ACCOUNT = re.compile(r"^\d{12}$")
_CAPACITY_RESERVATION = re.compile(r"^cr-[0-9a-f]{17}$")
_AMI_VERSION = re.compile(r"^v\d{8}$")
_STACK_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9-]{0,127}$")
_ADDON_VERSION = re.compile(r"^v(\d+)\.(\d+)\.(\d+)-eksbuild\.\d+$")
# Deliberately loose (SNS confirms the address): one @, a dot in the domain, no spaces.
_EMAIL = re.compile(r"^[^@\s]+@[^@\s]+\.[^@\s]+$")


class ConfigError(ValueError):
    """Raised with every configuration problem at once, one per line."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__(
            f"{len(problems)} problem(s) in the ray-train-eks configuration "
            "(cdk.json context, or -c key=value):\n" + "\n".join(f"  - {p}" for p in problems)
        )


@dataclass(frozen=True, kw_only=True)
class PlatformConfig:
    """Everything a deploy of the training platform depends on.

    Each field maps to the context key in its ``metadata``; the README's configuration
    table is this class.
    """

    #: AWS region. Default: ``AWS_REGION``, else us-west-2.
    region: str = "us-west-2"
    #: AWS account; None leaves the stack account-agnostic (no lookups at synth).
    account: str | None = None
    #: Two AZs of the region; empty means the region's first two (``Fn::GetAZs``).
    #: The GPU node group lives in the first.
    availability_zones: tuple[str, ...] = ()
    gpu_instance_type: str = "g6.12xlarge"
    gpu_node_count: int = 2
    #: GiB of encrypted gp3 root volume on GPU nodes: the DLC image (~35 GB unpacked,
    #: pulled compressed next to it), the Hugging Face cache and checkpoint staging.
    gpu_root_volume_gib: int = 200
    system_instance_type: str = "m7i.xlarge"
    system_node_count: int = 1
    #: GiB of encrypted gp3 root volume on system nodes: the Ray head and the submitter run
    #: the full CUDA DLC image there.
    system_root_volume_gib: int = 100
    kubernetes_version: str = "1.36"
    #: CIDRs allowed to reach the public API endpoint; 0.0.0.0/0 draws a synth warning.
    endpoint_access_cidrs: tuple[str, ...] = ("0.0.0.0/0",)
    #: IAM role (or user) that gets cluster-admin through an EKS access entry.
    admin_role_arn: str | None = None
    #: True deletes the data bucket and its objects on ``cdk destroy``.
    destroy_data: bool = False
    #: An EC2 On-Demand Capacity Reservation for the GPU nodes (``cr-...``).
    capacity_reservation_id: str | None = None
    #: ``nodegroup``: GPU nodes always up (a managed node group); ``karpenter``: Karpenter
    #: launches them while Ray pods need them and removes them once empty.
    gpu_capacity: str = "nodegroup"
    #: AL2023 EKS AMI release of Karpenter's GPU nodes (the ``al2023@<version>`` alias).
    gpu_ami_version: str = "v20260714"
    #: Seconds a RayJob may take to reach Running. Default: none with the node group,
    #: 1800 with Karpenter (nodes that never come fail the job and free what came).
    pre_running_deadline_seconds: int | None = None
    #: The amazon-cloudwatch-observability add-on (Container Insights, Fluent Bit, DCGM
    #: exporter), the dashboard and the idle-GPU alarm.
    observability: bool = True
    observability_addon_version: str = ADDON_VERSION
    #: Days CloudWatch Logs keeps the container logs (and Container Insights' performance events).
    log_retention_days: int = 30
    #: The idle-GPU alarm: GPU nodes up, and no GPU above this percent for this many minutes.
    idle_gpu_utilization_percent: int = 5
    idle_gpu_minutes: int = 30
    #: E-mail address the idle-GPU alarm notifies (SNS asks it to confirm first).
    alarm_email: str | None = None
    stack_name: str = "RayTrainEks"
    # ---- the Ray workload: defaults and meaning in ray_train_eks.charts.ray_workload.RayWorkloadSpec
    workload: str = RayWorkloadSpec.workload
    run_job: bool = RayWorkloadSpec.run_job
    ray_image: str = RayWorkloadSpec.ray_image
    ray_version: str = RayWorkloadSpec.ray_version
    ray_cluster_name: str = RayWorkloadSpec.ray_cluster_name
    ray_job_name_prefix: str = RayWorkloadSpec.ray_job_name_prefix
    training_args: tuple[str, ...] = RayWorkloadSpec.training_args
    nccl_debug: bool = RayWorkloadSpec.nccl_debug
    submission_mode: str = RayWorkloadSpec.submission_mode
    shutdown_after_job_finishes: bool = RayWorkloadSpec.shutdown_after_job_finishes
    suspend: bool = RayWorkloadSpec.suspend
    ttl_seconds_after_finished: int = RayWorkloadSpec.ttl_seconds_after_finished
    active_deadline_seconds: int = RayWorkloadSpec.active_deadline_seconds
    backoff_limit: int = RayWorkloadSpec.backoff_limit

    # ---------------------------------------------------------------- construction

    @classmethod
    def from_context(cls, get: Callable[[str], Any], environ: Mapping[str, str] | None = None) -> "PlatformConfig":
        """Build the config from a context getter (``node.try_get_context``) and the
        environment. Parsing problems are collected with the validation problems."""
        environ = os.environ if environ is None else environ
        problems: list[str] = []
        values: dict[str, Any] = {}

        def text(key: str) -> str | None:
            raw = get(key)
            if raw is None or raw == "":
                return None
            return str(raw).strip()

        def integer(key: str) -> int | None:
            raw = get(key)
            if raw is None or raw == "":
                return None
            if isinstance(raw, bool):
                problems.append(f"{key}={raw!r}: expected a whole number, e.g. -c {key}=2")
                return None
            try:
                return int(str(raw).strip())
            except ValueError:
                problems.append(f"{key}={raw!r}: expected a whole number, e.g. -c {key}=2")
                return None

        def boolean(key: str) -> bool | None:
            raw = get(key)
            if raw is None or raw == "":
                return None
            if isinstance(raw, bool):
                return raw
            lowered = str(raw).strip().lower()
            if lowered in ("true", "1", "yes"):
                return True
            if lowered in ("false", "0", "no"):
                return False
            problems.append(f"{key}={raw!r}: expected true or false")
            return None

        def string_list(key: str) -> tuple[str, ...] | None:
            raw = get(key)
            if raw is None:
                return None
            if isinstance(raw, str):
                stripped = raw.strip()
                if stripped.startswith("["):
                    try:
                        raw = json.loads(stripped)
                    except json.JSONDecodeError:
                        problems.append(f"{key}={raw!r}: not a JSON list; use a comma-separated list, e.g. -c {key}=a,b")
                        return None
                else:
                    raw = [part for part in stripped.split(",")]
            if not isinstance(raw, (list, tuple)):
                problems.append(f"{key}={raw!r}: expected a list, e.g. -c {key}=a,b")
                return None
            return tuple(str(item).strip() for item in raw if str(item).strip())

        def words(key: str) -> tuple[str, ...] | None:
            raw = get(key)
            if raw is None:
                return None
            return tuple(raw) if isinstance(raw, list) else tuple(shlex.split(str(raw)))

        region = text("region") or environ.get("AWS_REGION") or cls.region
        values["region"] = region
        values["account"] = text("account") or environ.get("CDK_DEFAULT_ACCOUNT") or None
        for key, name, reader in (
            ("availabilityZones", "availability_zones", string_list),
            ("gpuInstanceType", "gpu_instance_type", text),
            ("gpuNodeCount", "gpu_node_count", integer),
            ("gpuRootVolumeGiB", "gpu_root_volume_gib", integer),
            ("systemInstanceType", "system_instance_type", text),
            ("systemNodeCount", "system_node_count", integer),
            ("systemRootVolumeGiB", "system_root_volume_gib", integer),
            ("kubernetesVersion", "kubernetes_version", text),
            ("endpointAccessCidrs", "endpoint_access_cidrs", string_list),
            ("adminRoleArn", "admin_role_arn", text),
            ("destroyData", "destroy_data", boolean),
            ("capacityReservationId", "capacity_reservation_id", text),
            ("gpuCapacity", "gpu_capacity", text),
            ("gpuAmiVersion", "gpu_ami_version", text),
            ("preRunningDeadlineSeconds", "pre_running_deadline_seconds", integer),
            ("observability", "observability", boolean),
            ("observabilityAddonVersion", "observability_addon_version", text),
            ("logRetentionDays", "log_retention_days", integer),
            ("idleGpuUtilizationPercent", "idle_gpu_utilization_percent", integer),
            ("idleGpuMinutes", "idle_gpu_minutes", integer),
            ("alarmEmail", "alarm_email", text),
            ("stackName", "stack_name", text),
            ("workload", "workload", text),
            ("runJob", "run_job", boolean),
            ("rayImage", "ray_image", text),
            ("rayVersion", "ray_version", text),
            ("rayClusterName", "ray_cluster_name", text),
            ("rayJobNamePrefix", "ray_job_name_prefix", text),
            ("trainingArgs", "training_args", words),
            ("ncclDebug", "nccl_debug", boolean),
            ("submissionMode", "submission_mode", text),
            ("shutdownAfterJobFinishes", "shutdown_after_job_finishes", boolean),
            ("suspend", "suspend", boolean),
            ("ttlSecondsAfterFinished", "ttl_seconds_after_finished", integer),
            ("activeDeadlineSeconds", "active_deadline_seconds", integer),
            ("backoffLimit", "backoff_limit", integer),
        ):
            value = reader(key)
            if value is not None:
                values[name] = value
        config = cls(**values)
        return config.validate(parse_problems=problems)

    # ---------------------------------------------------------------- validation

    def problems(self) -> list[str]:
        """Every problem with this configuration, each naming the key, the value and the fix."""
        problems: list[str] = []
        add = problems.append

        if self.region not in EKS_REGISTRY_ACCOUNTS:
            add(
                f"region={self.region!r}: not a region this app supports (no known EKS add-on image registry); "
                f"use one of {', '.join(sorted(EKS_REGISTRY_ACCOUNTS))}"
            )
        if self.account is not None and not _ACCOUNT.match(self.account):
            add(f"account={self.account!r}: an AWS account id is 12 digits, e.g. -c account=123456789012")

        azs = self.availability_zones
        if azs:
            if len(azs) != 2:
                add(
                    f"availabilityZones={','.join(azs)!r}: give exactly two AZs (EKS needs two for the control plane; "
                    f"the GPU nodes use the first), e.g. -c availabilityZones={self.region}a,{self.region}b"
                )
            wrong = [az for az in azs if not re.fullmatch(re.escape(self.region) + r"[a-z]", az)]
            if wrong:
                add(
                    f"availabilityZones: {', '.join(wrong)} not of region {self.region}; "
                    f"use AZ names like {self.region}a, {self.region}b"
                )
            if len(set(azs)) != len(azs):
                add(f"availabilityZones={','.join(azs)!r}: the two AZs must differ")

        gpu = INSTANCE_TYPES.get(self.gpu_instance_type)
        if gpu is None:
            add(
                f"gpuInstanceType={self.gpu_instance_type!r}: unknown instance type; "
                f"use an EFA-capable GPU type: {', '.join(gpu_efa_instance_types())}"
            )
        elif not gpu.gpus:
            add(
                f"gpuInstanceType={self.gpu_instance_type!r}: has no GPU; "
                f"use an EFA-capable GPU type: {', '.join(gpu_efa_instance_types())}"
            )
        elif not gpu.efa:
            add(
                f"gpuInstanceType={self.gpu_instance_type!r}: does not support EFA (multi-node NCCL would fall back to TCP); "
                f"use an EFA-capable GPU type: {', '.join(gpu_efa_instance_types())}"
            )
        if self.gpu_node_count < 1:
            add(f"gpuNodeCount={self.gpu_node_count}: at least 1 GPU node is needed; e.g. -c gpuNodeCount=2")
        elif self.gpu_node_count > MAX_GPU_NODES:
            add(
                f"gpuNodeCount={self.gpu_node_count}: above {MAX_GPU_NODES}, the most this app places in one "
                f"cluster placement group; check for a typo, or split the run"
            )
        if self.gpu_root_volume_gib < MIN_GPU_ROOT_VOLUME_GIB:
            add(
                f"gpuRootVolumeGiB={self.gpu_root_volume_gib}: below {MIN_GPU_ROOT_VOLUME_GIB}, too small for the "
                f"Ray Train DLC image and the model cache; use 200"
            )

        system = INSTANCE_TYPES.get(self.system_instance_type)
        if system is None or system.gpus:
            add(
                f"systemInstanceType={self.system_instance_type!r}: not a known CPU instance type; "
                f"use one of {', '.join(cpu_instance_types())}"
            )
        elif system.vcpus < 4:
            add(
                f"systemInstanceType={self.system_instance_type!r}: {system.vcpus} vCPUs cannot hold the KubeRay operator, "
                f"the Ray head and the cluster add-ons; use m7i.xlarge or larger"
            )
        if self.system_root_volume_gib < MIN_SYSTEM_ROOT_VOLUME_GIB:
            add(
                f"systemRootVolumeGiB={self.system_root_volume_gib}: below {MIN_SYSTEM_ROOT_VOLUME_GIB}, too small for the Ray "
                f"head and the job submitter, which run the Ray Train DLC image; use 100"
            )
        if self.system_node_count < 1 or self.system_node_count > 10:
            add(f"systemNodeCount={self.system_node_count}: use 1 to 10 system nodes (default 1)")

        version = self.kubernetes_version
        if not re.fullmatch(r"1\.\d{2}", version):
            add(f"kubernetesVersion={version!r}: not a Kubernetes minor version; use 1.36")
        elif version not in EKS_SUPPORTED_VERSIONS:
            add(
                f"kubernetesVersion={version!r}: outside EKS support on 2026-11-30 (EKS cannot create it); "
                f"use 1.36"
            )
        elif version not in KUBECTL_LAYERS:
            add(
                f"kubernetesVersion={version!r}: no matching kubectl layer in this app "
                f"(pinned: {', '.join(f'{v} with {layer}' for v, layer in KUBECTL_LAYERS.items())}); use 1.36"
            )

        if not self.endpoint_access_cidrs:
            add("endpointAccessCidrs: empty; give at least one CIDR, e.g. -c endpointAccessCidrs=203.0.113.0/24")
        for cidr in self.endpoint_access_cidrs:
            try:
                network = ipaddress.ip_network(cidr, strict=True)
            except ValueError as error:
                fix = ""
                try:
                    fix = f"; did you mean {ipaddress.ip_network(cidr, strict=False)}?"
                except ValueError:
                    fix = "; use the form 203.0.113.0/24"
                add(f"endpointAccessCidrs: {cidr!r} is not a valid CIDR ({error}){fix}")
                continue
            if network.version != 4:
                add(f"endpointAccessCidrs: {cidr!r} is IPv6; the EKS public endpoint accepts IPv4 CIDRs only")

        if self.admin_role_arn is not None:
            assumed = _ASSUMED_ROLE.match(self.admin_role_arn)
            if assumed:
                add(
                    f"adminRoleArn={self.admin_role_arn!r}: an assumed-role session ARN; use the role's ARN, "
                    f"arn:aws:iam::{assumed.group(1)}:role/{assumed.group(2)}"
                )
            elif not _ARN.match(self.admin_role_arn):
                add(
                    f"adminRoleArn={self.admin_role_arn!r}: not an IAM role or user ARN; "
                    f"use the form arn:aws:iam::123456789012:role/NAME"
                )
            elif self.account and _ARN.match(self.admin_role_arn).group(1) != self.account:
                add(
                    f"adminRoleArn={self.admin_role_arn!r}: belongs to account {_ARN.match(self.admin_role_arn).group(1)}, "
                    f"not the stack's account {self.account}; use a principal of {self.account}"
                )

        if self.capacity_reservation_id is not None and not _CAPACITY_RESERVATION.match(self.capacity_reservation_id):
            add(
                f"capacityReservationId={self.capacity_reservation_id!r}: not a capacity reservation id; "
                f"use the form cr-0123456789abcdef0 (17 hex digits)"
            )
        if self.gpu_capacity not in GPU_CAPACITY_MODES:
            add(
                f"gpuCapacity={self.gpu_capacity!r}: use nodegroup (GPU nodes always up, the default) or karpenter "
                "(GPU nodes only while a job runs)"
            )
        elif self.gpu_capacity == "karpenter" and self.capacity_reservation_id is not None:
            add(
                f"capacityReservationId={self.capacity_reservation_id!r} with gpuCapacity=karpenter: this app launches "
                "into a capacity reservation only with the node group; use -c gpuCapacity=nodegroup, or drop "
                "capacityReservationId to let Karpenter launch on-demand nodes"
            )
        if not (_AMI_VERSION.match(self.gpu_ami_version) or self.gpu_ami_version == "latest"):
            add(
                f"gpuAmiVersion={self.gpu_ami_version!r}: an AL2023 EKS AMI release is v + 8 digits, e.g. "
                f"-c gpuAmiVersion=v20260714 (https://github.com/awslabs/amazon-eks-ami/releases)"
            )
        problems.extend(self._observability_problems())
        if system is not None and not system.gpus and system.vcpus >= 4:
            budget = self.system_budget
            if budget.head_room_m < MIN_HEAD_CPU_M:
                add(
                    f"systemInstanceType={self.system_instance_type!r} x systemNodeCount={self.system_node_count}: "
                    f"{budget.head_room_m}m CPU left for the Ray head, which needs {MIN_HEAD_CPU_M}m ({budget.describe()}); "
                    f"use -c systemInstanceType=m7i.2xlarge or -c systemNodeCount={self.system_node_count + 1}"
                )
        if self.gpu_instance_type in INSTANCE_TYPES and self.system_instance_type in INSTANCE_TYPES:
            problems.extend(workload_problems(self.workload_spec()))
        if not _STACK_NAME.match(self.stack_name):
            add(f"stackName={self.stack_name!r}: use letters, digits and hyphens, starting with a letter")
        return problems

    def _observability_problems(self) -> list[str]:
        problems: list[str] = []
        add = problems.append
        version = _ADDON_VERSION.match(self.observability_addon_version)
        minimum = ".".join(map(str, MIN_POD_IDENTITY_ADDON_VERSION))
        if not version:
            add(
                f"observabilityAddonVersion={self.observability_addon_version!r}: an EKS add-on version looks like "
                f"{ADDON_VERSION} (list them: aws eks describe-addon-versions --addon-name amazon-cloudwatch-observability)"
            )
        elif tuple(int(part) for part in version.groups()) < MIN_POD_IDENTITY_ADDON_VERSION:
            add(
                f"observabilityAddonVersion={self.observability_addon_version!r}: before v{minimum} the add-on cannot take "
                f"its credentials from EKS Pod Identity; use {ADDON_VERSION}"
            )
        if self.log_retention_days not in LOG_RETENTION_DAYS:
            add(
                f"logRetentionDays={self.log_retention_days}: not a CloudWatch Logs retention; use one of "
                f"{', '.join(map(str, LOG_RETENTION_DAYS))}"
            )
        if not 1 <= self.idle_gpu_utilization_percent <= 100:
            add(f"idleGpuUtilizationPercent={self.idle_gpu_utilization_percent}: a percentage from 1 to 100; e.g. 5")
        if not 5 <= self.idle_gpu_minutes <= 1440:
            add(
                f"idleGpuMinutes={self.idle_gpu_minutes}: use 5 to 1440 minutes (a day, CloudWatch's longest alarm "
                "window; under 5 the alarm fires between two steps of a job); e.g. 30"
            )
        if self.alarm_email is not None and not _EMAIL.match(self.alarm_email):
            add(f"alarmEmail={self.alarm_email!r}: not an e-mail address; e.g. -c alarmEmail=you@example.com")
        if not self.observability:
            given = [key for key, name in (
                ("alarmEmail", "alarm_email"),
                ("idleGpuUtilizationPercent", "idle_gpu_utilization_percent"),
                ("idleGpuMinutes", "idle_gpu_minutes"),
            ) if getattr(self, name) != getattr(PlatformConfig, name)]
            if given:
                add(
                    f"{', '.join(given)} with observability=false: the idle-GPU alarm reads Container Insights' GPU "
                    "metrics, which observability=false turns off; drop them, or use observability=true"
                )
        return problems

    def validate(self, *, parse_problems: list[str] | None = None) -> "PlatformConfig":
        """Return self, or raise :class:`ConfigError` listing every problem."""
        # Rules the workload shares with the platform (the GPU node count) are said once.
        problems = list(dict.fromkeys(list(parse_problems or []) + self.problems()))
        if problems:
            raise ConfigError(problems)
        return self

    # ---------------------------------------------------------------- derived facts

    def workload_spec(self, training_code: dict[str, str] | None = None) -> RayWorkloadSpec:
        """The Ray workload this configuration describes (the fields both classes share),
        on this platform's node roles: the head on the system nodes, workers on the GPU nodes."""
        shared = {f.name: getattr(self, f.name) for f in fields(RayWorkloadSpec) if f.name in _OWN_FIELDS}
        shared["metrics_namespace"] = TRAINING_METRICS_NAMESPACE
        if self.gpu_capacity == "karpenter":
            # No consolidation or drift replacement under a running pod.
            shared["pod_annotations"] = dict(DO_NOT_DISRUPT)
            if self.pre_running_deadline_seconds is None:
                shared["pre_running_deadline_seconds"] = KARPENTER_PRE_RUNNING_DEADLINE_SECONDS
        spec = RayWorkloadSpec(**shared, head_node_selector=SYSTEM_NODE_SELECTOR, worker_node_selector=GPU_NODE_SELECTOR,
                               training_code=training_code or {})
        if self.system_instance_type not in INSTANCE_TYPES:
            return spec
        # The head's CPU is what the system nodes' other pods leave (ray_train_eks.capacity); its memory as sized by default.
        return replace(spec, head_resources=(max(1, self.system_budget.head_cpu()), head_sizing(spec)[1]))

    @property
    def karpenter_replicas(self) -> int:
        """Karpenter controllers: one per system node, two at most (the chart's anti-affinity
        wants a node each); none with the node group."""
        return min(2, self.system_node_count) if self.gpu_capacity == "karpenter" else 0

    @property
    def system_budget(self) -> SystemNodeBudget:
        """The system nodes' CPU and what takes it before the Ray head."""
        return system_node_budget(
            vcpus=self.system_instance.vcpus, nodes=self.system_node_count, observability=self.observability,
            karpenter_replicas=self.karpenter_replicas,
            submitter=self.run_job and self.submission_mode == "K8sJobMode",
        )

    @property
    def gpu_instance(self):
        """The GPU node type's row in the instance table."""
        return INSTANCE_TYPES[self.gpu_instance_type]

    @property
    def system_instance(self):
        """The system node type's row in the instance table."""
        return INSTANCE_TYPES[self.system_instance_type]

    @property
    def endpoint_open_to_world(self) -> bool:
        """True when the public endpoint accepts any address."""
        return any(ipaddress.ip_network(c).prefixlen == 0 for c in self.endpoint_access_cidrs)


_OWN_FIELDS = {f.name for f in fields(PlatformConfig)}
