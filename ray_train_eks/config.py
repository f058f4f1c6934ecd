"""The platform's configuration: one frozen object built from CDK context and validated
once, at synth, so that bad input fails in seconds instead of twenty minutes into a deploy.

Each setting is declared once, as a field of :class:`PlatformConfig` made by :func:`setting`:
its context key, parser, default, one-line doc and check. Parsing (:meth:`from_context`),
the error messages (:meth:`problems`) and the README's configuration table
(:func:`configuration_table`) are derived from those declarations. A check that concerns a
construct's prop calls the rule that construct raises (``ray_train_eks.rules.*``, which imports
no CDK), so a consumer of the construct gets the message ``cdk synth`` gives. Context comes from
``cdk.json`` (defaults) and ``cdk synth -c key=value`` (overrides, always strings); a key no
setting declares is an error naming the closest declared key.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from dataclasses import MISSING, dataclass, fields, replace
from typing import Any, Callable, Iterable, Mapping

from ray_train_eks.capacity import MIN_HEAD_CPU_M, SystemNodeBudget, memory_beside_head_mib, system_node_budget
from ray_train_eks.workload import SPOT_DRAIN_DEADLINE_SECONDS, RayWorkloadSpec, head_sizing, workload_problems
from ray_train_eks.workload.queueing import LOCAL_QUEUE
from ray_train_eks.helm_charts import DEFAULT_PACKAGES_DIR as DEFAULT_CHART_PACKAGES, packages_dir
from ray_train_eks.instances import INSTANCE_TYPES
from ray_train_eks.observability import ADDON_VERSION, TRAINING_METRICS_NAMESPACE
from ray_train_eks.rules.cluster import (
    admin_principal_problem,
    endpoint_cidrs_problems,
    kubernetes_version_problem,
    system_node_count_problem,
    system_root_volume_problem,
)
from ray_train_eks.rules.disks import PULL_IOPS, PULL_THROUGHPUT_MIBPS, gp3_iops_problem, gp3_throughput_problem
from ray_train_eks.rules.gpu_nodes import (
    capacity_reservation_problem,
    efa_gpu_type_problem,
    gpu_node_count_problem,
    gpu_root_volume_problem,
)
from ray_train_eks.rules.reservations import (
    GpuCapacityChoice,
    capacity_choice,
    named_reservations,
    placement_group_problem,
    reservation_ids_problem,
    reservation_tags_problem,
    reservation_type_problem,
)
from ray_train_eks.rules.observability import (
    addon_version_problem,
    alarm_email_problem,
    idle_minutes_problem,
    idle_threshold_problem,
    log_retention_problem,
)
from ray_train_eks.scheduling import GPU_NODE_SELECTOR, SERVING_NODE_SELECTOR, SYSTEM_NODE_SELECTOR
from ray_train_eks.tracking import mlflow_app_made, tracking_uri_problem
from ray_train_eks.validation import context_key
# The declaration and parsers, and the checks across settings, live beside this module; importable from here too.
from ray_train_eks.settings import (Check, ParseError, Setting, _empty_is_none, boolean, integer,  # noqa: F401
                                    setting, string_list, text, words)
from ray_train_eks.config_checks import (GPU_CAPACITY_MODES, _account, _ami_version, _availability_zones,  # noqa: F401
                                         _capacity_type,
                                         _chart_packages, _gpu_capacity, _queueing, _region, _rule, _serving_gpu_nodes,
                                         _serving_idle_minutes, _stack_name, _mlflow_tracking,
                                         _system_instance_type, trainer_roles_problems)

#: In karpenter mode, without preRunningDeadlineSeconds: time for both GPU nodes to launch,
#: join and pull the DLC image (tens of GB) before the job is declared stuck.
KARPENTER_PRE_RUNNING_DEADLINE_SECONDS = 1800
#: In nodegroup mode: how long after the run lost a node (any kind: training/resilience/replacement.py) it
#: waits for a worker group before it stops with what to do: node repair's 10 minutes and a replacement's
#: start (10), and a margin. Checked at each of Ray Train's 15-minute worker-group start timeouts
#: (training/train.py), so a run nothing repairs stops at the second timeout: 30 minutes after the
#: restart began, about 31 after the fault.
NODEGROUP_REPLACEMENT_TIMEOUT_SECONDS = 1500
#: In karpenter mode: a new node's launch, join and image pull take 5 to 15 minutes; one that has not
#: come in 25 (no capacity in the AZ, the quota spent) stops the run the same way, with the reasons
#: Karpenter's NodeClaims give, instead of idle GPUs until the job's deadline.
KARPENTER_REPLACEMENT_TIMEOUT_SECONDS = 1500



class ConfigError(ValueError):
    """Raised with every configuration problem at once, one per line."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__(
            f"{len(problems)} problem(s) in the ray-train-eks configuration "
            "(cdk.json context, or -c key=value):\n" + "\n".join(f"  - {p}" for p in problems)
        )


_SPEC = RayWorkloadSpec


@dataclass(frozen=True, kw_only=True)
class PlatformConfig:
    """Everything a deploy of the training platform depends on: one field per context setting
    (:func:`setting`), each with its key, parser, default, doc and check."""

    region: str = setting("region", text, "us-west-2", "region of the stack (read from context or `AWS_REGION`: the CLI "
                          "overwrites `CDK_DEFAULT_REGION`)", shown="`AWS_REGION`, else `us-west-2`", check=_region,
                          env="AWS_REGION")
    account: str | None = setting("account", text, None, "12-digit account; without one the stack is account-agnostic and "
                                  "synth makes no AWS calls", shown="`CDK_DEFAULT_ACCOUNT`, else none", check=_account,
                                  env="CDK_DEFAULT_ACCOUNT")
    availability_zones: tuple[str, ...] = setting(
        "availabilityZones", string_list, (), "exactly two AZs of the region, e.g. `us-west-2a,us-west-2b`; the GPU nodes "
        "use the first (pick one with your GPU capacity)", shown="the region's first two (`Fn::GetAZs`)",
        check=_availability_zones)
    gpu_instance_type: str = setting(
        "gpuInstanceType", text, "g6.12xlarge", "EFA-capable GPU type: g6.8xlarge/12xlarge/16xlarge/24xlarge/48xlarge, "
        "gr6.8xlarge, g5.48xlarge, p4d.24xlarge, p5.48xlarge, p5en.48xlarge", check=_rule(efa_gpu_type_problem, "gpuInstanceType"))
    gpu_node_count: int = setting("gpuNodeCount", integer, 2, "GPU nodes, 1 to 64",
                                  check=_rule(gpu_node_count_problem, "gpuNodeCount"))
    gpu_root_volume_gib: int | None = setting(
        "gpuRootVolumeGiB", integer, None, "encrypted gp3 root volume of each GPU node. On a type with local NVMe (every "
        "EFA GPU type) nodeadm puts containerd, kubelet and the pods' emptyDirs (the DLC image, checkpoint staging) on a "
        "RAID0 of it, and the root holds the OS and its logs; on a type without, the root holds them all",
        shown="`50` with NVMe instance storage, else `200`",
        check=_rule(gpu_root_volume_problem, "gpuRootVolumeGiB", instance_type=lambda c: c.gpu_instance_type))
    system_instance_type: str = setting("systemInstanceType", text, "m7i.xlarge", "CPU nodes for the KubeRay operator, the "
                                        "Ray head and add-ons (4+ vCPUs)", check=_system_instance_type)
    system_node_count: int = setting("systemNodeCount", integer, 1, "system nodes, 1 to 10",
                                     check=_rule(system_node_count_problem, "systemNodeCount"))
    system_root_volume_gib: int | None = setting(
        "systemRootVolumeGiB", integer, None, "encrypted gp3 root volume of each system node (80 at least without NVMe): "
        "the Ray head and the job submitter run the full CUDA DLC image there", shown="`100` (`50` with NVMe, e.g. m6id)",
        check=_rule(system_root_volume_problem, "systemRootVolumeGiB", instance_type=lambda c: c.system_instance_type))
    root_volume_throughput_mibps: int = setting(
        "rootVolumeThroughputMiBps", integer, PULL_THROUGHPUT_MIBPS, "gp3 throughput (MiB/s) of a root volume that holds "
        "containerd (nodes without NVMe: the system nodes by default), for the DLC image's pull; gp3's baseline is 125",
        check=_rule(gp3_throughput_problem, "rootVolumeThroughputMiBps", iops=lambda c: c.root_volume_iops,
                    iops_prop=lambda c: context_key("rootVolumeIops")))
    root_volume_iops: int = setting("rootVolumeIops", integer, PULL_IOPS, "gp3 IOPS of such a root volume (3000 to 80000)",
                                    check=_rule(gp3_iops_problem, "rootVolumeIops"))
    kubernetes_version: str = setting("kubernetesVersion", text, "1.36", "only versions with a matching kubectl layer "
                                      "pinned here (1.36)", check=_rule(kubernetes_version_problem, "kubernetesVersion"))
    endpoint_access_cidrs: tuple[str, ...] = setting(
        "endpointAccessCidrs", string_list, ("0.0.0.0/0",), "IPv4 CIDRs allowed on the public API endpoint; CDK's kubectl "
        "handler uses the private endpoint", shown="`0.0.0.0/0` (synth warns)",
        check=_rule(endpoint_cidrs_problems, "endpointAccessCidrs"))
    admin_role_arn: str | None = setting(
        "adminRoleArn", text, None, "IAM role or user given cluster-admin through an EKS access entry, so you can use kubectl",
        shown="none (synth warns)", check=_rule(admin_principal_problem, "adminRoleArn", account=lambda c: c.account))
    trainer_role_arns: tuple[str, ...] = setting(
        "trainerRoleArns", string_list, (), "IAM roles that run `ray-train-eks` (submit, list, status, logs, stop) and "
        "nothing else: an EKS access entry each, in a group bound to a Role with exactly the command's verbs in the Ray "
        "namespace (docs/security.md)", shown="none",
        check=lambda value, config: trainer_roles_problems(value, config))
    destroy_data: bool = setting("destroyData", boolean, False, "`true` lets `cdk destroy` delete the bucket and its "
                                 "objects (and the log groups)")
    gpu_capacity: str = setting(
        "gpuCapacity", text, "nodegroup", "`nodegroup`: a managed node group, GPU nodes always up; `karpenter`: Karpenter "
        "launches the GPU nodes while Ray pods need them and removes them once empty", check=_gpu_capacity)
    gpu_capacity_type: str = setting(
        "gpuCapacityType", text, "", "what the GPU nodes are bought as: `on-demand`; `spot` (a fraction of the price, "
        "two minutes' notice: the training checkpoints at the notice and resumes; with `karpenter`, On-Demand when Spot "
        "has none); `reserved` (the capacity reservations below, only). With `karpenter` an order to fall back in, "
        "Karpenter's: `reserved,on-demand`, `reserved,spot,on-demand`, `spot,on-demand` (docs/capacity.md)",
        shown="`reserved` with a reservation, else `on-demand`", check=_capacity_type)
    capacity_reservation_ids: tuple[str, ...] = setting(
        "capacityReservationIds", string_list, (), "`cr-...,cr-...`: On-Demand Capacity Reservations or Capacity Blocks "
        "for the GPU nodes, in the GPU AZ (at most 30 with `karpenter`); the deploy's first minute checks each (type, AZ, "
        "state, size, end, owner)",
        shown="none", check=_rule(reservation_ids_problem, "capacityReservationIds"))
    capacity_reservation_id: str | None = setting(
        "capacityReservationId", text, None, "one reservation: the same as `capacityReservationIds` (the earlier key)",
        check=_rule(capacity_reservation_problem, "capacityReservationId"))
    capacity_reservation_tags: tuple[str, ...] = setting(
        "capacityReservationTags", string_list, (), "`karpenter`: the reservations by tag instead, `key=value,...` "
        "(every tag must match)", shown="none", check=_rule(reservation_tags_problem, "capacityReservationTags"))
    capacity_reservation_type: str = setting(
        "capacityReservationType", text, "default", "`default`: On-Demand Capacity Reservations; `capacity-block`: "
        "EC2 Capacity Blocks for ML (a run checkpoints and stops before the block ends)",
        check=_rule(reservation_type_problem, "capacityReservationType"))
    gpu_placement_group: str | None = setting(
        "gpuPlacementGroup", text, None, "an existing cluster placement group for the GPU nodes instead of a new one: "
        "the one your reservations were made in, so that reserved and fallback nodes share it", shown="a new one "
        "(none with a reservation)", check=_rule(placement_group_problem, "gpuPlacementGroup", reservation_type=lambda c: c.capacity_reservation_type
                    if c.capacity.reserved else "default"))
    fast_image_pull: bool = setting(
        "fastImagePull", boolean, True, "nodeadm's `FastImagePull` on the GPU nodes: SOCI pulls and unpacks the DLC "
        "image's layers in parallel (docs/capacity.md)")
    gpu_ami_version: str = setting(
        "gpuAmiVersion", text, "v20260714", "`karpenter` mode: the AL2023 EKS AMI release of the GPU nodes "
        "(`al2023@<version>`; [releases](https://github.com/awslabs/amazon-eks-ami/releases)); `latest` works but drifts "
        "the nodes at every release", check=_ami_version)
    pre_running_deadline_seconds: int | None = setting(
        "preRunningDeadlineSeconds", integer, None, "a RayJob that is not Running by then fails, and its RayCluster (and "
        "the nodes it holds) goes", shown="none; `1800` with `karpenter`")
    queueing: str = setting(
        "queueing", text, "none", "`kueue`: Kueue queues the Ray jobs (the deployed one and `ray-train-eks submit`'s), each "
        "admitted whole when the GPU nodes are free, the others waiting oldest first; a queued job keeps its cluster "
        "`ttlSecondsAfterFinished` after it ends (KubeRay's rule for a suspended job). `none`: no queue, "
        "`ray-train-eks submit` refuses while a job runs", check=_queueing)
    observability: bool = setting(
        "observability", boolean, True, "the `amazon-cloudwatch-observability` EKS add-on (Container Insights with GPU and "
        "EFA metrics, Fluent Bit container logs), the dashboard and the idle-GPU alarm; `false`: none of them (the "
        "training metrics still go to CloudWatch)")
    mlflow_tracking: str = setting(
        "mlflowTracking", text, "auto", "`app`: a SageMaker MLflow App (serverless, no hourly charge; artifacts under "
        "`mlflow/` of the training bucket; kept by `cdk destroy` unless `destroyData`) that every run logs to, one "
        "experiment per stack; `none`: no tracking (metrics.jsonl, the curves and CloudWatch stay); `auto`: `app` in the "
        "regions CloudFormation has MLflow Apps in, `none` elsewhere (synth says so)",
        check=_mlflow_tracking)
    mlflow_tracking_uri: str | None = setting(
        "mlflowTrackingUri", text, None, "an MLflow of yours instead of a new App: an http(s):// server the Ray pods "
        "reach, or the ARN of a SageMaker MLflow App or tracking server (the Ray pods' role may then log to it)",
        check=_rule(tracking_uri_problem, "mlflowTrackingUri"))
    observability_addon_version: str = setting(
        "observabilityAddonVersion", text, ADDON_VERSION, "the add-on release (v3.1.0 or later: Pod Identity); newer "
        "ones: `aws eks describe-addon-versions --addon-name amazon-cloudwatch-observability --kubernetes-version 1.36`",
        check=_rule(addon_version_problem, "observabilityAddonVersion"))
    log_retention_days: int = setting(
        "logRetentionDays", integer, 30, "days CloudWatch Logs keeps the container logs and Container Insights' "
        "performance events (a CloudWatch retention: 1, 3, 5, 7, 14, 30, 60, 90, ...)",
        check=_rule(log_retention_problem, "logRetentionDays"))
    idle_gpu_utilization_percent: int = setting(
        "idleGpuUtilizationPercent", integer, 5, "the idle-GPU alarm's threshold: GPU nodes up and no GPU above this "
        "percent for `idleGpuMinutes`", check=_rule(idle_threshold_problem, "idleGpuUtilizationPercent"))
    idle_gpu_minutes: int = setting("idleGpuMinutes", integer, 30, "the idle-GPU alarm's window: idle minutes among the last this many + 3 (5 to 1437)",
                                    check=_rule(idle_minutes_problem, "idleGpuMinutes"))
    alarm_email: str | None = setting(
        "alarmEmail", text, None, "e-mail address the idle-GPU alarm notifies (SNS sends a confirmation first); or "
        "subscribe to the `IdleGpuAlarmTopicArn` output", check=_rule(alarm_email_problem, "alarmEmail"))
    node_monitoring: bool = setting(
        "nodeMonitoring", boolean, True, "the `eks-node-monitoring-agent` EKS add-on: node conditions for GPU (NVIDIA XID, "
        "DCGM), network, disk, kernel and container-runtime faults, which node repair acts on; `false`: none")
    node_repair: bool = setting(
        "nodeRepair", boolean, True, "automatic repair of the GPU nodes: the node group's `nodeRepairConfig`, or "
        "Karpenter's `NodeRepair` feature; a node whose `AcceleratedHardwareReady` stays false 10 minutes (other "
        "conditions: 30) is replaced; `false`: a person replaces broken nodes")
    skip_account_checks: bool = setting(
        "skipAccountChecks", boolean, False, "`true` skips the checks at the start of the deploy (the GPU family's vCPU "
        "quota, the GPU type in the GPU AZ, the AMI release), for accounts where Service Quotas is not reachable")
    stack_name: str = setting("stackName", text, "RayTrainEks", "CloudFormation stack name", check=_stack_name)
    chart_packages: str = setting(
        "chartPackages", text, "auto", "where `cdk deploy` takes the Helm charts from: `auto` installs each chart whose "
        f"package `make upstream` put in `{DEFAULT_CHART_PACKAGES}` with its pinned sha256 as a CDK asset (what the tests "
        "rendered; no chart repository reached at deploy time), the others from their repositories; `none`: every chart "
        "from its repository; or a folder holding the pinned packages", check=_chart_packages)
    # ---- the Ray workload: defaults from RayWorkloadSpec; its rules are workload_problems (workload/objects.py)
    workload: str = setting("workload", text, _SPEC.workload, "`job`: the RayJob brings its own RayCluster; `cluster`: a "
                            "standing RayCluster that the RayJob runs on")
    run_job: bool = setting("runJob", boolean, _SPEC.run_job, "`false` deploys everything but the RayJob")
    ray_image: str = setting("rayImage", text, _SPEC.ray_image, "image of the Ray pods (its Ray must equal `rayVersion`)",
                             shown="the Ray Train DLC")
    ray_version: str = setting("rayVersion", text, _SPEC.ray_version, "the Ray version of `rayImage`")
    ray_cluster_name: str = setting("rayClusterName", text, _SPEC.ray_cluster_name, "DNS-1035 name, at most 53 characters")
    ray_job_name_prefix: str = setting("rayJobNamePrefix", text, _SPEC.ray_job_name_prefix, "DNS-1035 name, at most 38 "
                                       "characters (a spec hash follows it)")
    training_args: tuple[str, ...] = setting(
        "trainingArgs", words, _SPEC.training_args, "extra `python -m training.train` options, e.g. `--max-steps 60 "
        "--learning-rate 1e-5`")
    nccl_debug: bool = setting(
        "ncclDebug", boolean, _SPEC.nccl_debug, "`true`: `NCCL_DEBUG=INFO` in the GPU workers, NCCL's whole log in the job "
        "log; `false`: `NCCL_DEBUG=WARN` (overriding the DLC image's own INFO), and the preflight logs only NCCL's "
        "INIT/NET lines, to a file whose warnings still reach the job log as they are written")
    submission_mode: str = setting("submissionMode", text, _SPEC.submission_mode, "`K8sJobMode`, `HTTPMode`, "
                                   "`InteractiveMode` or `SidecarMode`")
    shutdown_after_job_finishes: bool = setting("shutdownAfterJobFinishes", boolean, _SPEC.shutdown_after_job_finishes,
                                                "when the job ends: delete its GPU workers at once, its head `ttlSecondsAfterFinished` later")
    suspend: bool = setting("suspend", boolean, _SPEC.suspend, "create the RayJob suspended")
    ttl_seconds_after_finished: int = setting("ttlSecondsAfterFinished", integer, _SPEC.ttl_seconds_after_finished,
                                              "seconds the job's head (and its logs) stays after the job ends (a suspended job's whole RayCluster)")
    active_deadline_seconds: int = setting("activeDeadlineSeconds", integer, _SPEC.active_deadline_seconds, "job deadline")
    auth_mode: str = setting(
        "rayAuthMode", text, _SPEC.auth_mode, "`token`: Ray's token authentication on every Ray cluster (KubeRay keeps "
        "the token in a Secret named after the cluster, key `auth_token`, for the Ray pods, the submitter and itself); "
        "`disabled`: anyone who reaches the head can run code there with the pods' role")
    network_policies: bool = setting(
        "networkPolicies", boolean, _SPEC.network_policies, "`true`: the VPC CNI enforces NetworkPolicies, the Ray "
        "namespace denies all ingress, then allows each Ray cluster's pods to each other and the KubeRay operator and "
        "the job's submitter to the head's job API (8265)")
    serving_gpu_nodes: int = setting(
        "servingGpuNodes", integer, _SPEC.serving_gpu_nodes, "GPU nodes `ray-train-eks serve`'s replicas may take (with "
        "Karpenter a NodePool of their own; with the node group, its nodes while a replica runs); `0`: no serving",
        check=_serving_gpu_nodes)
    serving_idle_minutes: int = setting(
        "servingIdleMinutes", integer, _SPEC.serving_idle_seconds // 60, "minutes a served model's replica (and then its "
        "GPU node) stays without a request before it goes", check=_serving_idle_minutes)
    backoff_limit: int = setting(
        "backoffLimit", integer, _SPEC.backoff_limit, "KubeRay retries, each a new RayCluster (worker failures are retried "
        "inside the run, from the last checkpoint, by Ray Train's `--max-failures`; KubeRay retries every failed job, a "
        "deliberate stop such as a failed preflight too, so the default is none; rejected at synth with "
        "`workload=cluster` or `InteractiveMode`, as KubeRay would)")

    # ---------------------------------------------------------------- construction

    @classmethod
    def from_context(cls, context: Mapping[str, Any] | Callable[[str], Any],
                     environ: Mapping[str, str] | None = None) -> "PlatformConfig":
        """Build the config from the CDK context (a mapping of every key, as
        ``app.node.get_all_context()`` gives, or a getter) and the environment. Problems of
        parsing, of keys no setting declares (with a mapping) and of values are raised together."""
        environ = os.environ if environ is None else environ
        get = context.get if isinstance(context, Mapping) else context
        problems: list[str] = []
        if isinstance(context, Mapping):
            problems.extend(undeclared_key_problems(context.keys()))
        values: dict[str, Any] = {}
        for f in fields(cls):
            declared: Setting = f.metadata["setting"]
            raw = get(declared.key)
            if _empty_is_none(raw) and declared.env:
                raw = environ.get(declared.env)
            if _empty_is_none(raw) and declared.parse is not string_list:
                continue
            if raw is None:
                continue
            try:
                values[f.name] = declared.parse(raw, declared.key)
            except ParseError as error:
                problems.append(str(error))
        return cls(**values).validate(parse_problems=problems)

    # ---------------------------------------------------------------- validation

    def problems(self) -> list[str]:
        """Every problem with this configuration, each naming the key, the value and the fix:
        each setting's check in declaration order, then the rules across settings."""
        problems: list[str] = []
        for f in fields(self):
            check = f.metadata["setting"].check
            found = check(getattr(self, f.name), self) if check else None
            problems.extend([found] if isinstance(found, str) else found or [])
        problems.extend(self._alarm_problems())
        problems.extend(self._capacity_problems())
        if self.gpu_instance_type in INSTANCE_TYPES and self.system_instance_type in INSTANCE_TYPES:
            problems.extend(workload_problems(self.workload_spec()))
        return problems

    def _alarm_problems(self) -> list[str]:
        """Alarm keys need the observability they read."""
        if self.observability:
            return []
        by_name = {f.name: f for f in fields(self)}
        given = [by_name[name].metadata["setting"].key for name in ("alarm_email", "idle_gpu_utilization_percent", "idle_gpu_minutes")
                 if getattr(self, name) != by_name[name].default]
        if not given:
            return []
        return [f"{', '.join(given)} with observability=false: the idle-GPU alarm reads Container Insights' GPU metrics, "
                "which observability=false turns off; drop them, or use observability=true"]

    def _capacity_problems(self) -> list[str]:
        """The Ray head must fit on the system nodes beside everything else there."""
        system = INSTANCE_TYPES.get(self.system_instance_type)
        if system is None or system.gpus or system.vcpus < 4:
            return []
        budget = self.system_budget
        if budget.head_room_m >= MIN_HEAD_CPU_M:
            return []
        return [f"systemInstanceType={self.system_instance_type!r} x systemNodeCount={self.system_node_count}: "
                f"{budget.head_room_m}m CPU left for the Ray head, which needs {MIN_HEAD_CPU_M}m ({budget.describe()}); "
                f"use -c systemInstanceType=m7i.2xlarge or -c systemNodeCount={self.system_node_count + 1}"]

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
        shared["tracking"] = mlflow_app_made(self.mlflow_tracking, self.region) or bool(self.mlflow_tracking_uri)
        shared["tracking_experiment"] = self.stack_name if shared["tracking"] else None
        if self.capacity.spot:
            # EC2 takes a Spot instance two minutes after its notice, whatever the pod's grace.
            shared["drain_deadline_seconds"] = SPOT_DRAIN_DEADLINE_SECONDS
        if self.gpu_capacity == "karpenter":
            # No do-not-disrupt on the Ray pods: the NodePool's budgets keep voluntary
            # disruption off a running node (ray_train_eks.constructs.karpenter.node_pool_disruption).
            if self.pre_running_deadline_seconds is None:
                shared["pre_running_deadline_seconds"] = KARPENTER_PRE_RUNNING_DEADLINE_SECONDS
            shared["replacement_timeout_s"] = KARPENTER_REPLACEMENT_TIMEOUT_SECONDS
            shared["node_claims_readable"] = True
        else:
            # A fixed-size node group: a node taken out comes back only by repair (never for a straggler).
            shared["replacement_timeout_s"] = NODEGROUP_REPLACEMENT_TIMEOUT_SECONDS
        if self.queueing == "kueue":
            shared["queue_name"] = LOCAL_QUEUE
        shared.update(self._serving())
        spec = RayWorkloadSpec(**shared, head_node_selector=SYSTEM_NODE_SELECTOR, worker_node_selector=GPU_NODE_SELECTOR,
                               training_code=training_code or {})
        if self.system_instance_type not in INSTANCE_TYPES:
            return spec
        # The head's CPU is what the system nodes' other pods leave (ray_train_eks.capacity); its memory as sized by default.
        head, memory = max(1, self.system_budget.head_cpu()), head_sizing(spec)[1]
        return replace(spec, head_resources=(head, memory), system_room_m=self.system_budget.room_beside_head_m(head),
                       system_memory_room_mib=memory_beside_head_mib(self.system_instance.memory_gib, self.system_node_count, memory))

    def _serving(self) -> dict:
        """The spec's serving fields; with Karpenter, the serving NodePool's nodes (scheduling.py)."""
        pool = {"serving_node_selector": SERVING_NODE_SELECTOR} if self.gpu_capacity == "karpenter" else {}
        return {"gpu_capacity": self.gpu_capacity, "serving_idle_seconds": 60 * self.serving_idle_minutes, **pool}

    @property
    def reservation_ids(self) -> tuple[str, ...]:
        """The reservations named by id (``capacityReservationIds``, or the earlier ``capacityReservationId``)."""
        return named_reservations(self.capacity_reservation_ids, self.capacity_reservation_id)

    @property
    def capacity(self) -> GpuCapacityChoice:
        """What the GPU nodes are bought as, in order, and the reservations (ray_train_eks/rules/reservations.py)."""
        return capacity_choice(self.gpu_capacity_type, ids=self.reservation_ids, tags=self.capacity_reservation_tags,
                               reservation_type=self.capacity_reservation_type, karpenter=self.gpu_capacity == "karpenter")

    @property
    def chart_packages_dir(self) -> Path | None:
        """The folder whose verified chart packages the deploy installs as assets (ray_train_eks/helm_charts.py
        ``packages_dir``; None: every chart from its repository)."""
        return packages_dir(self.chart_packages)

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
            submitter=self.run_job and self.submission_mode == "K8sJobMode", node_monitoring=self.node_monitoring,
            kueue=self.queueing == "kueue",
            # the watch beside a RayJob's head (workload/stopped_jobs.py); counted wherever a RayJob brings its cluster
            stopped_job_watch=self.workload == "job",
        )

    @property
    def system_instance(self):
        """The system node type's row in the instance table."""
        return INSTANCE_TYPES[self.system_instance_type]


_OWN_FIELDS = {f.name for f in fields(PlatformConfig)}


def declared_settings() -> list[Setting]:
    """Every setting, in declaration order."""
    return [f.metadata["setting"] for f in fields(PlatformConfig)]


def undeclared_key_problems(keys: Iterable[str]) -> list[str]:
    """A problem for each context key no setting declares (a typo, or a key of another
    version), naming the closest declared key. Keys of CDK itself (``@aws-cdk/...``,
    ``aws:cdk:...``, lookups like ``availability-zones:...``) contain ``@`` or ``:`` and pass."""
    declared = [s.key for s in declared_settings()]
    problems = []
    for key in keys:
        if key in declared or "@" in key or ":" in key:
            continue
        close = difflib.get_close_matches(key, declared, n=1, cutoff=0.6) or difflib.get_close_matches(
            key.lower(), [d.lower() for d in declared], n=1, cutoff=0.6)
        hint = f"did you mean {next(d for d in declared if d.lower() == close[0].lower())}?" if close else \
            "see the configuration table in docs/configuration.md for the settings there are"
        problems.append(f"{key}: not a setting of ray-train-eks; {hint}")
    return problems


def _shown_default(declared: Setting, default: Any) -> str:
    if declared.shown is not None:
        return declared.shown
    if default is None or default == ():
        return "none"
    if isinstance(default, bool):
        return f"`{str(default).lower()}`"
    if isinstance(default, tuple):
        return f"`{','.join(default)}`"
    return f"`{default}`"


def configuration_table() -> str:
    """The README's configuration table, from the declarations."""
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for f in fields(PlatformConfig):
        declared: Setting = f.metadata["setting"]
        default = f.default if f.default is not MISSING else None
        rows.append(f"| `{declared.key}` | {_shown_default(declared, default)} | {declared.doc} |")
    return "\n".join(rows) + "\n"
