"""The Ray workload as Kubernetes objects: a RayJob that runs the fine-tune (and, in
``cluster`` mode, a standing RayCluster it runs on). Built as plain dicts by typed builders
and checked here for what only the KubeRay operator would reject later; the tests validate
every object strictly against the KubeRay v1.7.0 CRD schemas. (The standard objects, the
ConfigMaps and the namespace, are cdk8s-plus: ray_workload_chart.py.)

Why not ``cdk8s import`` bindings: in Python their nested lists take dicts whose keys must
already be Kubernetes camelCase (snake_case ones are dropped without a word), so they give
no safety where the risk is; they add an 8 MB generated module to import at every synth.
Plain dicts with literal camelCase keys plus strict schema validation catch every
misspelled field instead.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import shlex
from dataclasses import dataclass, field
from typing import Any, Mapping

from ray_train_eks.instances import INSTANCE_TYPES
from ray_train_eks.scheduling import GPU_TOLERATION, RAY_NAMESPACE, RAY_SERVICE_ACCOUNT

RAY_API_VERSION = "ray.io/v1"
#: The Ray Train DLC: Ray 2.58.0, PyTorch 2.13.0, CUDA 13, NCCL 2.29 with aws-ofi-nccl, EFA 1.47.
DEFAULT_RAY_IMAGE = "public.ecr.aws/deep-learning-containers/ray:train-ml-cuda-v1.1"
#: Must equal the image's Ray (KubeRay uses it to pick compatible behaviour).
DEFAULT_RAY_VERSION = "2.58.0"
SUBMISSION_MODES = ("K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode")
#: KubeRay's limits: the operator derives longer child names from these.
MAX_RAYJOB_NAME = 47
MAX_RAYCLUSTER_NAME = 53
_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS_1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
#: A label (and taint) key: an optional DNS-1123 subdomain prefix and '/', then a name of at most
#: 63 characters (k8s.io/apimachinery validation IsQualifiedName).
_QUALIFIED_NAME = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                             r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


def _version(text: str) -> tuple[int, ...]:
    """``2.58.0`` as (2, 58, 0); an unreadable version as (0,)."""
    parts = re.findall(r"\d+", text)[:3]
    return tuple(int(p) for p in parts) if parts else (0,)

CODE_MOUNT = "/opt/ray-train-eks"
#: ``kubectl apply`` (and ``create --save-config``, what CDK's kubectl handler runs) keeps the
#: whole object in the ``kubectl.kubernetes.io/last-applied-configuration`` annotation, and
#: all annotations of an object together are capped at 256 KiB by the API server.
MAX_APPLIED_OBJECT_BYTES = 256 * 1024 - 1024  # a KiB for the other annotations
PART_OF = {"app.kubernetes.io/part-of": "ray-train-eks"}
CODE_DIGEST_ANNOTATION = "ray-train-eks/code-sha256"
CACHE_MOUNT = "/cache"
#: Where the GPU workers stage checkpoints before Ray uploads them (training/checkpoint.py): an
#: emptyDir, so on the node's NVMe RAID0 where the type has one (nodeadm's localStorage).
SCRATCH_MOUNT = "/scratch"
#: training.preflight.PRESTOP_CHECK_ENV (the chart does not import the training code).
PRESTOP_CHECK_ENV = "RAY_TRAIN_EKS_PRESTOP_CHECK"
#: training.health's environment of the GPU worker pods: the pod's node (downward API), the taint
#: a worker puts on it at a hardware fault, and the GPUs the pod was given.
NODE_NAME_ENV = "RAY_TRAIN_EKS_NODE_NAME"
UNHEALTHY_TAINT_ENV = "RAY_TRAIN_EKS_UNHEALTHY_TAINT"
POD_GPUS_ENV = "RAY_TRAIN_EKS_POD_GPUS"
#: The taint a training worker puts on its node when its GPU breaks (training/health.py).
UNHEALTHY_TAINT_KEY = "ray-train-eks/gpu-unhealthy"
#: The GPU worker pods' grace period: their preStop hook drains the pod's Ray node for it (less a
#: margin for SIGTERM), and the training writes and uploads its checkpoint at the notice inside
#: it (see :data:`DRAIN_HOOK`).
WORKER_TERMINATION_GRACE_SECONDS = 300
#: Seconds of the grace kept for what follows the hook: Kubernetes' SIGTERM, on which ``ray
#: start`` drains its node again and stops (RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S, 30 s).
DRAIN_MARGIN_SECONDS = 30
#: The drain deadline on Spot nodes, from the hook's start: EC2 takes a Spot instance two minutes
#: after its interruption notice (EC2 User Guide, "Spot Instance interruption notices") whatever
#: the pod's grace, and the hook starts after the notice has gone through EventBridge, SQS and
#: Karpenter's drain (or EKS's node-group drain), seconds later. Ray counts a node's death as a
#: preemption only after its drain deadline (GCS ``InferDeathInfo``): a deadline past the
#: instance's end would charge the reclaim to ``--max-failures``. 90 s leaves up to 25 s for
#: the notice to reach the pod and 5 s for the node's last report.
SPOT_DRAIN_DEADLINE_SECONDS = 90
#: The GPU worker pods' preStop hook, run by the interpreter that runs the pod's Ray (the parent
#: of the pod's one raylet, ``ray start --block``: whatever ``python`` means on the image's PATH
#: does not matter) as ``-c DRAIN_HOOK <seconds>``:
#:
#: 1. it finds this pod's Ray node and GCS from its raylet's command line (``--node_id``,
#:    ``--gcs-address``; ray/_private/services.py ``find_node_ids``, ``find_gcs_addresses``), as
#:    ``ray drain-node`` would be told them (ray/scripts/scripts.py);
#: 2. drains the node in the GCS with reason preemption and a deadline ``seconds`` from now, so
#:    Ray Train's PreemptionWatcher tells the training, which writes and uploads a checkpoint,
#:    then moves the deadline to that moment (training/preemption.py): Ray Train restarts the
#:    run at once, counting a preemption (its controller's PREEMPTING state ends at the deadline);
#: 3. holds while the raylet runs, at most until the deadline: a drained node's raylet exits by
#:    itself once its workers are gone (ray/_private/node.py, the SIGTERM drain), and Kubernetes
#:    sends SIGTERM as soon as the hook returns.
#:
#: With ``check`` after the seconds it only prints what it found (the training's preflight runs
#: it so, in the pod, at job start: training/preflight.py). The node id must be hex: a binary id
#: is accepted and drains nothing.
DRAIN_HOOK = """\
import sys, time
import ray
import psutil  # Ray's own copy (ray/thirdparty_files), importable once ray is
from ray._private import services
from ray.core.generated import autoscaler_pb2
seconds, check = int(sys.argv[1]), sys.argv[2:] == ["check"]
nodes, gcs = sorted(services.find_node_ids()), sorted(services.find_gcs_addresses())
if len(nodes) != 1 or len(gcs) != 1:
    sys.exit("preStop: expected this pod's one Ray node and GCS, found nodes %s and GCS %s" % (nodes, gcs))
if check:
    print("preStop check: node %s GCS %s python %s ray %s" % (nodes[0], gcs[0], sys.executable, ray.__version__))
    sys.exit(0)
deadline_ms = int(time.time() * 1000) + seconds * 1000
accepted, why = ray._raylet.GcsClient(address=gcs[0]).drain_node(
    nodes[0], autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
    "Kubernetes is stopping the pod (preStop)", deadline_ms)
print("drain %s: accepted=%s %s; deadline in %d s" % (nodes[0], accepted, why, seconds), flush=True)
raylets = [p for p in psutil.process_iter(["name"]) if p.info["name"] == "raylet"]
gone, alive = psutil.wait_procs(raylets, timeout=max(0.0, deadline_ms / 1000 - time.time()))
print("drain %s: %s" % (nodes[0], "the raylet exited" if gone else "deadline reached"), flush=True)
"""
#: The shell part of the hook: the pod's Ray interpreter is the first word of the command line of
#: its raylet's parent, as the kernel ran ``ray``'s shebang (not ``/proc/<pid>/exe``: in a virtual
#: environment that is the base interpreter, without the environment's packages).
DRAIN_HOOK_LAUNCHER = """\
hook=$1; shift
for comm in /proc/[0-9]*/comm; do
  [ "$(cat "$comm" 2>/dev/null)" = raylet ] || continue
  parent=$(awk '/^PPid:/ {print $2}' "${comm%/comm}/status")
  exec "$(tr '\\0' '\\n' < "/proc/$parent/cmdline" | head -n 1)" -c "$hook" "$@"
done
echo "preStop: no raylet runs in this pod" >&2
exit 1
"""

#: Ray's token authentication (RayCluster ``spec.authOptions.mode``, KubeRay v1.7.0): with
#: ``token`` the operator creates a Secret named after the RayCluster (key ``auth_token``, 32
#: random bytes, owned by the cluster, so deleted with it) and gives it to the head, the workers
#: and the submitter as ``RAY_AUTH_MODE=token`` and ``RAY_AUTH_TOKEN``; the operator's own
#: dashboard client reads it too (ray-operator/controllers/ray/common/pod.go
#: SetContainerTokenAuthEnvVars, utils/util.go). Ray then refuses every GCS, raylet and job-API
#: call without the token (ray/_private/authentication/).
AUTH_MODES = ("token", "disabled")
#: KubeRay rejects ``mode: token`` for an older Ray (utils/validation.go).
MIN_RAY_VERSION_FOR_TOKEN_AUTH = (2, 52, 0)
#: A label of every Ray pod we create, naming its Ray cluster (the standing RayCluster's name, or
#: the RayJob's for the cluster it brings): KubeRay's own ``ray.io/cluster`` of a RayJob's
#: cluster carries a random suffix, unknown when the NetworkPolicies are written.
CLUSTER_LABEL = "ray-train-eks/ray-cluster"
#: The labels KubeRay gives a RayJob's K8sJobMode submitter pod (rayjob_controller.go getSubmitterTemplate).
SUBMITTER_CRD_LABEL = "ray.io/originated-from-crd"
SUBMITTER_NAME_LABEL = "ray.io/originated-from-cr-name"
DASHBOARD_PORT = 8265
#: The KubeRay operator's pod labels in its chart (helm-chart/kuberay-operator/templates/deployment.yaml
#: at v1.7.0: app.kubernetes.io/name is the chart's name unless nameOverride).
KUBERAY_OPERATOR_POD_LABELS = {"app.kubernetes.io/name": "kuberay-operator"}

#: ConfigMap with per-deployment settings (the bucket name), created by the stack.
SETTINGS_CONFIGMAP = "ray-train-eks-settings"
TRAINING_CODE_CONFIGMAP = "ray-train-eks-training-code"


@dataclass(frozen=True, kw_only=True)
class RayWorkloadSpec:
    """Everything the Ray objects are built from.

    Scheduling is neutral by default (no node selector; GPU workers tolerate the standard
    ``nvidia.com/gpu`` taint): a cluster of anyone's works. Our stack passes its own node
    roles. Pod sizes come from the instance table, or from ``head_resources`` /
    ``worker_resources`` for types it does not list.
    """

    gpu_instance_type: str = "g6.12xlarge"
    gpu_node_count: int = 2
    system_instance_type: str = "m7i.xlarge"
    namespace: str = RAY_NAMESPACE
    service_account: str = RAY_SERVICE_ACCOUNT
    ray_image: str = DEFAULT_RAY_IMAGE
    ray_version: str = DEFAULT_RAY_VERSION
    #: ``job``: the RayJob brings its own RayCluster and frees the GPUs when done;
    #: ``cluster``: a standing RayCluster, and the RayJob runs on it.
    workload: str = "job"
    run_job: bool = True
    ray_cluster_name: str = "ray-train"
    ray_job_name_prefix: str = "finetune"
    training_preset: str = "qwen2.5-1.5b-l4x8"
    #: Extra options of ``python -m training.train`` (the default entrypoint).
    training_args: tuple[str, ...] = ()
    #: The command the job runs, one argument per item (each is quoted for the submitter's
    #: shell). None: ``python -m training.train`` with the preset, the worker counts and ``training_args``.
    entrypoint: tuple[str, ...] | None = None
    #: Importable name of the shipped code: the ConfigMap is mounted at /opt/ray-train-eks/<name>.
    code_package: str = "training"
    #: ``NCCL_DEBUG=INFO`` in the GPU workers (NCCL's whole log in the job log); otherwise
    #: ``WARN``, overriding the DLC image's own INFO (its env and /etc/nccl.conf).
    nccl_debug: bool = False
    submission_mode: str = "K8sJobMode"
    shutdown_after_job_finishes: bool = True
    suspend: bool = False
    ttl_seconds_after_finished: int = 600
    active_deadline_seconds: int = 4 * 3600
    #: Seconds a RayJob may take to reach Running (its cluster Ready, the job submitted);
    #: past it KubeRay fails the job and, with ``shutdown_after_job_finishes``, deletes its
    #: RayCluster, freeing whatever nodes did come. None: no deadline.
    pre_running_deadline_seconds: int | None = None
    #: CloudWatch namespace rank 0 publishes training metrics to (training/cloudwatch.py),
    #: with ``region`` for its client. None: no metrics.
    metrics_namespace: str | None = None
    region: str | None = None
    #: Annotations of every Ray pod (head and workers), e.g. ``karpenter.sh/do-not-disrupt``.
    pod_annotations: Mapping[str, str] = field(default_factory=dict)
    #: A retry is a new RayCluster: useful when the head or submitter dies, useless for a
    #: deliberate stop (failed preflight, non-finite loss), which KubeRay would retry too
    #: (it retries every FAILED job). Worker failures are Ray Train's (--max-failures).
    backoff_limit: int = 0
    gpus_per_worker: int | None = None
    efa_per_worker: int | None = None
    #: The GPU worker pods' terminationGracePeriodSeconds: their preStop hook drains the Ray node
    #: with the rest of it as the deadline, and the training checkpoints within it.
    worker_termination_grace_seconds: int = WORKER_TERMINATION_GRACE_SECONDS
    #: Seconds from the preStop hook's start to the Ray node's drain deadline, when the node goes
    #: sooner than the grace period says (Spot: :data:`SPOT_DRAIN_DEADLINE_SECONDS`). None: the
    #: grace period less :data:`DRAIN_MARGIN_SECONDS`.
    drain_deadline_seconds: int | None = None
    #: (CPU, GiB) of the head and of each GPU worker. None: from the instance table.
    head_resources: tuple[int, int] | None = None
    worker_resources: tuple[int, int] | None = None
    head_node_selector: Mapping[str, str] = field(default_factory=dict)
    worker_node_selector: Mapping[str, str] = field(default_factory=dict)
    head_tolerations: tuple[Mapping[str, str], ...] = ()
    worker_tolerations: tuple[Mapping[str, str], ...] = (GPU_TOLERATION,)
    #: Ray's authentication on every Ray cluster created here: ``token`` (the default; see
    #: :data:`AUTH_MODES`) or ``disabled``.
    auth_mode: str = "token"
    #: NetworkPolicies in ``namespace``: all ingress to its pods denied, then each Ray cluster's pods
    #: allowed to each other (every port: GCS, raylets, object transfer, workers, agents) and the
    #: KubeRay operator and the job's submitter to the head's dashboard port. Enforced only where
    #: the cluster's CNI enforces NetworkPolicies (VPC CNI: ``enableNetworkPolicy``).
    network_policies: bool = True
    #: Where the KubeRay operator runs, and its pods' labels: the dashboard allows them.
    operator_namespace: str = "kuberay"
    operator_pod_labels: Mapping[str, str] = field(default_factory=lambda: dict(KUBERAY_OPERATOR_POD_LABELS))
    #: The taint a GPU worker puts on its own node (``NoSchedule``) when it finds a GPU broken or a
    #: straggler (training/health.py), so the worker pod KubeRay creates next lands elsewhere: the
    #: service account may patch nodes, and an admission policy lets it change this taint only
    #: (:func:`node_marker_objects`). None: no taint, no node permission (the Ray drain alone then
    #: keeps the retry off the node only until its pod restarts).
    unhealthy_taint_key: str | None = UNHEALTHY_TAINT_KEY
    #: Training code shipped in a ConfigMap: file name -> content (filled by RayWorkload).
    training_code: Mapping[str, str] = field(default_factory=dict, compare=False)

    @property
    def worker_gpus(self) -> int:
        if self.gpus_per_worker is not None:
            return self.gpus_per_worker
        return INSTANCE_TYPES[self.gpu_instance_type].gpus

    @property
    def worker_efa(self) -> int:
        if self.efa_per_worker is not None:
            return self.efa_per_worker
        return INSTANCE_TYPES[self.gpu_instance_type].efa_interfaces


def planned_training(spec: RayWorkloadSpec):
    """The job's training configuration and its model's shape, read at synth from the job's own
    command line (training/config.py and training/plan.py, the code the job runs), or None when
    synth cannot know them: a custom entrypoint, options trainingArgs gets wrong (its own
    problem), a model neither in the plan's table nor a local folder."""
    if spec.entrypoint is not None:
        return None
    from ray_train_eks.training_code.config import ConfigError, parse_config
    from ray_train_eks.training_code.plan import model_shape

    try:
        config = parse_config(list(entrypoint_args(spec)[3:]), storage_path="s3://synth/runs", validate=False)
        return config, model_shape(config.model)
    except (ConfigError, ValueError, SystemExit):
        return None


def memory_plan_problem(spec: RayWorkloadSpec) -> str | None:
    """The training's memory plan (training/plan.py, the same code the job runs before Ray
    starts), made at synth from the job's own command line: why the model cannot fit the GPUs,
    with what would, or None (it fits, or synth cannot know: a custom entrypoint, a model
    neither in the plan's table nor a local folder, which the job then plans at its start)."""
    planned = planned_training(spec) if spec.gpu_instance_type in INSTANCE_TYPES else None
    if planned is None:  # unknown models plan at the job's start
        return None
    from ray_train_eks.training_code.plan import DoesNotFit, Options, check, choose_sharding

    config, shape = planned
    if not config.use_gpu or not config.gpu_type:
        return None
    options, _ = choose_sharding(shape, config.gpu_type, Options.of(config), hsdp_asked=config.hsdp)
    try:
        check(shape, config.gpu_type, options)
    except DoesNotFit as error:
        return (f"trainingArgs={' '.join(spec.training_args)!r} on {spec.gpu_node_count} x {spec.gpu_instance_type}: {error} "
                f"(python -m training.plan {' '.join(entrypoint_args(spec)[3:])} prints the whole plan)")
    return None


#: What else a GPU worker keeps on its node's disk besides staged checkpoints: the model's
#: download and the data set in /cache, Ray's logs and spilled objects.
SCRATCH_MARGIN_GIB = 10


def worker_disk_gib(spec: RayWorkloadSpec) -> int | None:
    """The ephemeral storage a GPU worker pod requests (its emptyDirs, /scratch and /cache, are
    on the node's disk): two staged checkpoints of its node's share (one being written while the
    previous one uploads: training/checkpoint.py; fp32 weights and AdamW's two moments, 12 bytes a
    parameter, a node's share of one copy), the model's bf16 weights, and a margin. None when
    synth cannot know the model (a custom entrypoint, a model out of the plan's table)."""
    planned = planned_training(spec)
    if planned is None:
        return None
    parameters = planned[1].parameters
    checkpoint_share = parameters * 12 / max(1, spec.gpu_node_count)
    return math.ceil((2 * checkpoint_share + parameters * 2) / 2**30) + SCRATCH_MARGIN_GIB


def worker_disk_problem(spec: RayWorkloadSpec) -> str | None:
    """Why the GPU nodes' instance store cannot hold what a worker keeps on it, or None."""
    needed, gpu = worker_disk_gib(spec), INSTANCE_TYPES.get(spec.gpu_instance_type)
    if needed is None or gpu is None or not gpu.instance_store_gb:
        return None
    if needed * 2**30 > gpu.instance_store_gb * 1e9:
        return (f"trainingArgs={' '.join(spec.training_args)!r}: each GPU worker stages {needed} GiB of checkpoints and "
                f"model on its node's disk, more than {spec.gpu_instance_type}'s {gpu.instance_store_gb} GB of NVMe; use "
                "more nodes (-c gpuNodeCount) or a type with more instance storage")
    return None


def workload_problems(spec: RayWorkloadSpec) -> list[str]:
    """What the KubeRay operator would reject (late, as ValidationFailed), checked at synth."""
    problems: list[str] = []
    if spec.unhealthy_taint_key is not None and not _QUALIFIED_NAME.match(spec.unhealthy_taint_key):
        problems.append(f"unhealthy_taint_key={spec.unhealthy_taint_key!r}: a taint key is a label key ('prefix/name', the "
                        f"name at most 63 letters, digits, '-', '_' or '.'), e.g. {UNHEALTHY_TAINT_KEY!r}; or None for no taint")
    if spec.workload not in ("job", "cluster"):
        problems.append(f"workload={spec.workload!r}: use job (the RayJob brings its own cluster) or cluster (a standing RayCluster)")
    if not _DNS_1035.match(spec.ray_cluster_name) or len(spec.ray_cluster_name) > MAX_RAYCLUSTER_NAME:
        problems.append(
            f"rayClusterName={spec.ray_cluster_name!r}: a RayCluster name must be DNS-1035 (lower-case letters, digits, '-', "
            f"starting with a letter) and at most {MAX_RAYCLUSTER_NAME} characters"
        )
    longest = MAX_RAYJOB_NAME - 9  # "-" and an 8-character spec hash follow the prefix
    if not _DNS_1035.match(spec.ray_job_name_prefix) or len(spec.ray_job_name_prefix) > longest:
        problems.append(
            f"rayJobNamePrefix={spec.ray_job_name_prefix!r}: the RayJob name is '<prefix>-<8-character hash>', DNS-1035 and at "
            f"most {MAX_RAYJOB_NAME} characters, so the prefix must be DNS-1035 and at most {longest} characters"
        )
    if spec.pre_running_deadline_seconds is not None and spec.pre_running_deadline_seconds <= 0:
        problems.append(
            f"preRunningDeadlineSeconds={spec.pre_running_deadline_seconds}: KubeRay takes a positive number of seconds; "
            "use e.g. 1800, or leave it unset for no deadline"
        )
    if spec.submission_mode not in SUBMISSION_MODES:
        problems.append(f"submissionMode={spec.submission_mode!r}: use one of {', '.join(SUBMISSION_MODES)}")
    if spec.ttl_seconds_after_finished and not spec.shutdown_after_job_finishes:
        problems.append(
            f"ttlSecondsAfterFinished={spec.ttl_seconds_after_finished} needs shutdownAfterJobFinishes=true "
            "(KubeRay rejects a TTL without it); set both, or ttlSecondsAfterFinished=0"
        )
    if spec.suspend and not spec.shutdown_after_job_finishes:
        problems.append("suspend=true needs shutdownAfterJobFinishes=true (KubeRay rejects it otherwise)")
    if spec.workload == "cluster" and spec.shutdown_after_job_finishes and spec.run_job:
        problems.append(
            "workload=cluster with shutdownAfterJobFinishes=true: a RayJob on an existing cluster (clusterSelector) "
            "cannot shut that cluster down; set shutdownAfterJobFinishes=false (and ttlSecondsAfterFinished=0)"
        )
    # KubeRay v1.7.0 ValidateRayJobSpec (ray-operator/controllers/ray/utils/validation.go): these
    # end as ValidationFailed in the RayJob's status, with no retry, while the apply succeeds.
    if spec.workload == "cluster" and spec.run_job:
        if spec.backoff_limit > 0:
            problems.append(
                f"backoffLimit={spec.backoff_limit} with workload=cluster: KubeRay rejects backoffLimit > 0 for a RayJob on an "
                "existing cluster (clusterSelector); use backoffLimit=0"
            )
        if spec.submission_mode == "SidecarMode":
            problems.append("submissionMode=SidecarMode with workload=cluster: KubeRay does not support clusterSelector in "
                            "SidecarMode; use K8sJobMode or HTTPMode")
        if spec.suspend:
            problems.append("suspend=true with workload=cluster: KubeRay's clusterSelector mode cannot suspend; use workload=job")
    if spec.submission_mode == "InteractiveMode" and spec.backoff_limit > 0:
        problems.append(f"backoffLimit={spec.backoff_limit} with submissionMode=InteractiveMode: KubeRay rejects retries in "
                        "InteractiveMode; use backoffLimit=0")
    if spec.auth_mode not in AUTH_MODES:
        problems.append(f"rayAuthMode={spec.auth_mode!r}: use token (Ray refuses callers without the cluster's token) or "
                        "disabled (anyone who reaches the head can run code on the cluster)")
    elif spec.auth_mode == "token" and _version(spec.ray_version) < MIN_RAY_VERSION_FOR_TOKEN_AUTH:
        problems.append(f"rayVersion={spec.ray_version!r} with rayAuthMode=token: Ray's token authentication needs Ray 2.52.0 "
                        "or later (KubeRay rejects the cluster otherwise); use an image with a newer Ray, or rayAuthMode=disabled")
    if not _DNS_1123_LABEL.match(spec.operator_namespace):
        problems.append(f"operator_namespace={spec.operator_namespace!r}: must be the namespace the KubeRay operator runs in "
                        "(a DNS-1123 label), e.g. kuberay")
    if spec.gpu_node_count < 1:
        problems.append(f"gpuNodeCount={spec.gpu_node_count}: at least 1 GPU node is needed; e.g. -c gpuNodeCount=2")
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", spec.code_package):
        problems.append(f"code_package={spec.code_package!r}: must be an importable Python package name, e.g. my_trainer")
    if spec.entrypoint is not None and not spec.entrypoint:
        problems.append("entrypoint=(): give the command as a tuple of arguments, e.g. ('python', '-m', 'my_trainer.main'), or None")
    if spec.head_resources is None and spec.system_instance_type not in INSTANCE_TYPES:
        problems.append(
            f"system_instance_type={spec.system_instance_type!r} is not in ray_train_eks.instances.INSTANCE_TYPES, so the Ray "
            "head cannot be sized from it; pass head_resources=(cpu, memory_gib)"
        )
    if spec.gpu_instance_type not in INSTANCE_TYPES and (
        spec.worker_resources is None or spec.gpus_per_worker is None or spec.efa_per_worker is None
    ):
        problems.append(
            f"gpu_instance_type={spec.gpu_instance_type!r} is not in ray_train_eks.instances.INSTANCE_TYPES; pass "
            "worker_resources=(cpu, memory_gib), gpus_per_worker and efa_per_worker"
        )
    for name, value in (("ttlSecondsAfterFinished", spec.ttl_seconds_after_finished), ("backoffLimit", spec.backoff_limit)):
        if value < 0:
            problems.append(f"{name}={value} must be 0 or more")
    if spec.worker_termination_grace_seconds < DRAIN_MARGIN_SECONDS + 30:
        problems.append(
            f"worker_termination_grace_seconds={spec.worker_termination_grace_seconds}: the preStop hook keeps "
            f"{DRAIN_MARGIN_SECONDS} s for SIGTERM and a checkpoint needs time; use at least {DRAIN_MARGIN_SECONDS + 30}, e.g. "
            f"{WORKER_TERMINATION_GRACE_SECONDS}")
    if spec.drain_deadline_seconds is not None and spec.drain_deadline_seconds < 30:
        problems.append(
            f"drain_deadline_seconds={spec.drain_deadline_seconds}: the training needs time to write and upload a "
            f"checkpoint after the notice; use at least 30, e.g. {SPOT_DRAIN_DEADLINE_SECONDS} on Spot, or None")
    if spec.active_deadline_seconds < 60:
        problems.append(f"activeDeadlineSeconds={spec.active_deadline_seconds}: below a minute the job cannot even start; use e.g. 14400")
    gpu = INSTANCE_TYPES.get(spec.gpu_instance_type)
    if gpu is not None:
        if not 1 <= spec.worker_gpus <= gpu.gpus:
            problems.append(f"gpusPerWorker={spec.worker_gpus}: {spec.gpu_instance_type} has {gpu.gpus} GPUs; use 1 to {gpu.gpus}")
        if not 0 <= spec.worker_efa <= gpu.efa_interfaces:
            problems.append(
                f"efaPerWorker={spec.worker_efa}: {spec.gpu_instance_type} has {gpu.efa_interfaces} EFA interfaces; "
                f"use 0 to {gpu.efa_interfaces}"
            )
        elif not problems:
            memory = memory_plan_problem(spec)
            if memory:
                problems.append(memory)
            disk = worker_disk_problem(spec)
            if disk:
                problems.append(disk)
    return problems


# --------------------------------------------------------------------- pod templates

def _resources(cpu: int | str, memory_gib: int, extra: Mapping[str, int] | None = None) -> dict:
    """Requests equal to limits (Guaranteed QoS; KubeRay sizes Ray from them)."""
    amounts = {"cpu": str(cpu), "memory": f"{memory_gib}Gi", **{k: str(v) for k, v in (extra or {}).items()}}
    return {"requests": dict(amounts), "limits": dict(amounts)}


#: The most one training-code ConfigMap holds (its data as JSON): the code is split into as many
#: as it takes, each well under :data:`MAX_APPLIED_OBJECT_BYTES`, and projected into one folder.
CODE_PART_BYTES = 160 * 1024


def code_parts(files: Mapping[str, str]) -> list[dict[str, str]]:
    """The training code (file name -> content) in ConfigMaps' worth: files in name order, a new
    part when the next file would take one past :data:`CODE_PART_BYTES`; one part at least."""
    parts: list[dict[str, str]] = [{}]
    size = 0
    for name in sorted(files):
        added = len(json.dumps({name: files[name]}).encode())
        if parts[-1] and size + added > CODE_PART_BYTES:
            parts.append({})
            size = 0
        parts[-1][name] = files[name]
        size += added
    return parts


def code_config_map_name(index: int) -> str:
    """The name of the training code's ``index``-th ConfigMap (the first keeps the old name)."""
    return TRAINING_CODE_CONFIGMAP if index == 0 else f"{TRAINING_CODE_CONFIGMAP}-{index + 1}"


def _common_volumes(shm_gib: int, code_package: str, code: Mapping[str, str]) -> tuple[list[dict], list[dict]]:
    volumes = [
        # Every part of the code (code_parts) in one folder.
        {"name": "training-code", "projected": {"sources": [
            {"configMap": {"name": code_config_map_name(index)}} for index in range(len(code_parts(code)))]}},
        # Pod-level emptyDir: survives a container restart, so the model is fetched once per pod.
        {"name": "cache", "emptyDir": {}},
        # Ray's object store lives in /dev/shm; size it explicitly (30% of memory, Ray's default share).
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{shm_gib}Gi"}},
    ]
    mounts = [
        {"name": "training-code", "mountPath": f"{CODE_MOUNT}/{code_package}", "readOnly": True},
        {"name": "cache", "mountPath": CACHE_MOUNT},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    return volumes, mounts


def _common_env() -> list[dict]:
    return [
        {"name": "PYTHONPATH", "value": CODE_MOUNT},
        {"name": "HF_HOME", "value": f"{CACHE_MOUNT}/huggingface"},
        {"name": "RAY_TRAIN_EKS_CACHE", "value": f"{CACHE_MOUNT}/ray-train-eks"},
        {"name": "TRAINING_BUCKET", "valueFrom": {"configMapKeyRef": {"name": SETTINGS_CONFIGMAP, "key": "bucket"}}},
        # Kubernetes expands $(VAR) from earlier entries. The training module reads this when
        # --storage-path is not given, so the entrypoint holds no shell variable (KubeRay's
        # submitter pod would expand it in its own shell, where it is empty).
        {"name": "RAY_TRAIN_EKS_STORAGE_PATH", "value": "s3://$(TRAINING_BUCKET)/runs"},
    ]


def head_sizing(spec: RayWorkloadSpec) -> tuple[int, int]:
    """CPU and GiB of the head: ``head_resources``, else half the system node (the rest for
    the operator and add-ons)."""
    if spec.head_resources is not None:
        return spec.head_resources
    system = INSTANCE_TYPES[spec.system_instance_type]
    return max(1, system.vcpus // 2), max(2, system.memory_gib // 2)


def worker_sizing(spec: RayWorkloadSpec) -> tuple[int, int]:
    """CPU and GiB of a GPU worker: ``worker_resources``, else the whole node less room for
    kubelet and the DaemonSets (VPC CNI, kube-proxy, device plugins, pod identity agent)."""
    if spec.worker_resources is not None:
        return spec.worker_resources
    gpu = INSTANCE_TYPES[spec.gpu_instance_type]
    return gpu.vcpus - 2, int(gpu.memory_gib * 0.85)


def _placement(node_selector: Mapping[str, str], tolerations) -> dict:
    """The pod's nodeSelector and tolerations, only when there are any."""
    placement: dict[str, Any] = {}
    if node_selector:
        placement["nodeSelector"] = dict(node_selector)
    if tolerations:
        placement["tolerations"] = [dict(t) for t in tolerations]
    return placement


def _pod_metadata(spec: RayWorkloadSpec, cluster: str | None) -> dict:
    """The pod template's metadata: the Ray cluster's label (``cluster``, for the NetworkPolicies)
    and the annotations, each only when there is one."""
    metadata: dict[str, Any] = {}
    if cluster is not None:
        metadata["labels"] = {CLUSTER_LABEL: cluster}
    if spec.pod_annotations:
        metadata["annotations"] = dict(spec.pod_annotations)
    return {"metadata": metadata} if metadata else {}


def head_group_spec(spec: RayWorkloadSpec, cluster: str | None = None) -> dict:
    """The head: where ``head_node_selector`` puts it, no GPUs, the dashboard, ``ray stop`` before it goes."""
    cpu, memory = head_sizing(spec)
    volumes, mounts = _common_volumes(max(1, int(memory * 0.3)), spec.code_package, spec.training_code)
    return {
        "rayStartParams": {"num-gpus": "0", "num-cpus": "0", "dashboard-host": "0.0.0.0"},
        "template": {
            **_pod_metadata(spec, cluster),
            "spec": {
                "serviceAccountName": spec.service_account,
                **_placement(spec.head_node_selector, spec.head_tolerations),
                "volumes": volumes,
                "containers": [{
                    "name": "ray-head",
                    "image": spec.ray_image,
                    "imagePullPolicy": "IfNotPresent",
                    "ports": [
                        {"name": "gcs-server", "containerPort": 6379},
                        {"name": "dashboard", "containerPort": DASHBOARD_PORT},
                        {"name": "client", "containerPort": 10001},
                    ],
                    "env": [*_common_env(), {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}],
                    "resources": _resources(cpu, memory),
                    "volumeMounts": mounts,
                    "lifecycle": {"preStop": {"exec": {"command": ["/bin/sh", "-c", "ray stop"]}}},
                }],
            }
        },
    }


def worker_group_spec(spec: RayWorkloadSpec, cluster: str | None = None) -> dict:
    """GPU workers: one pod per GPU node with all its GPUs and EFA interfaces, where
    ``worker_node_selector`` and ``worker_tolerations`` put them."""
    cpu, memory = worker_sizing(spec)
    volumes, mounts = _common_volumes(max(1, int(memory * 0.3)), spec.code_package, spec.training_code)
    volumes.append({"name": "scratch", "emptyDir": {}})
    mounts.append({"name": "scratch", "mountPath": SCRATCH_MOUNT})
    env = [
        *_common_env(),
        {"name": "RAY_TRAIN_EKS_SCRATCH", "value": SCRATCH_MOUNT},
        {"name": "FI_PROVIDER", "value": "efa"},
        {"name": "NCCL_NET_PLUGIN", "value": "ofi"},
        # Keep NCCL's bootstrap and socket fallback off loopback and pod-local links.
        {"name": "NCCL_SOCKET_IFNAME", "value": "^lo,docker,veth"},
        # Set either way: the DLC sets INFO in its image env and /etc/nccl.conf, and an
        # environment variable wins over nccl.conf. With WARN the preflight logs NCCL's
        # INIT/NET lines to a file in /tmp and echoes the transport (training/preflight.py).
        {"name": "NCCL_DEBUG", "value": "INFO" if spec.nccl_debug else "WARN"},
        # The preflight runs the preStop hook in check mode in the pod (training/preflight.py).
        {"name": PRESTOP_CHECK_ENV, "value": json.dumps([*drain_hook_command(spec), "check"])},
        # training/health.py: the GPUs the pod asked for (a missing one fails the preflight) and the
        # node to taint when a GPU breaks.
        {"name": POD_GPUS_ENV, "value": str(spec.worker_gpus)},
        {"name": NODE_NAME_ENV, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
    ]
    if spec.unhealthy_taint_key:
        env.append({"name": UNHEALTHY_TAINT_ENV, "value": spec.unhealthy_taint_key})
    if spec.metrics_namespace:
        env.append({"name": "RAY_TRAIN_EKS_METRICS_NAMESPACE", "value": spec.metrics_namespace})
        if spec.region:
            env.append({"name": "AWS_REGION", "value": spec.region})
    extra = {"nvidia.com/gpu": spec.worker_gpus}
    if spec.worker_efa:
        extra["vpc.amazonaws.com/efa"] = spec.worker_efa
    resources = _resources(cpu, memory, extra)
    disk = worker_disk_gib(spec)
    if disk is not None:
        # A request, no limit: the scheduler keeps room for the staged checkpoints on the node's
        # disk (the NVMe RAID0 nodeadm mounts the kubelet's directory on, where the type has one);
        # a limit would evict the pod, mid-checkpoint, the moment it was passed.
        resources["requests"]["ephemeral-storage"] = f"{disk}Gi"
    return {
        "groupName": "gpu-workers",
        "replicas": spec.gpu_node_count,
        "minReplicas": spec.gpu_node_count,
        "maxReplicas": spec.gpu_node_count,
        "rayStartParams": {},
        "template": {
            **_pod_metadata(spec, cluster),
            "spec": {
                "serviceAccountName": spec.service_account,
                **_placement(spec.worker_node_selector, spec.worker_tolerations),
                # Room for the checkpoint the training writes at the preemption notice.
                "terminationGracePeriodSeconds": spec.worker_termination_grace_seconds,
                # A worker pod whose Ray node ended (drained at a hardware fault or a preemption) is
                # deleted and created anew by KubeRay (raycluster_controller.go shouldDeletePod at
                # v1.7.0), so the scheduler places it again and an unhealthy taint keeps it off the
                # broken node. Unset, Kubernetes' default Always restarts the container in place, on
                # the same node, and Ray Train's retry would land on the broken GPU again.
                "restartPolicy": "Never",
                "volumes": volumes,
                "containers": [{
                    "name": "ray-worker",
                    "image": spec.ray_image,
                    "imagePullPolicy": "IfNotPresent",
                    "env": env,
                    "resources": resources,
                    "volumeMounts": mounts,
                    "lifecycle": {"preStop": {"exec": {"command": drain_hook_command(spec)}}},
                }],
            }
        },
    }


def drain_hook_command(spec: RayWorkloadSpec) -> list[str]:
    """The GPU workers' preStop command: :data:`DRAIN_HOOK` with :func:`drain_deadline_seconds`."""
    return ["/bin/sh", "-c", DRAIN_HOOK_LAUNCHER, "ray-train-eks-prestop", DRAIN_HOOK, str(drain_deadline_seconds(spec))]


def drain_deadline_seconds(spec: RayWorkloadSpec) -> int:
    """Seconds from the hook's start to the node's drain deadline: ``drain_deadline_seconds``
    (Spot: :data:`SPOT_DRAIN_DEADLINE_SECONDS`), at most the grace period less the margin."""
    longest = spec.worker_termination_grace_seconds - DRAIN_MARGIN_SECONDS
    return longest if spec.drain_deadline_seconds is None else min(spec.drain_deadline_seconds, longest)


def ray_cluster_spec(spec: RayWorkloadSpec, cluster: str | None = None) -> dict:
    """The RayCluster spec the RayJob and the standing RayCluster share; its pods labelled with
    ``cluster`` (:data:`CLUSTER_LABEL`)."""
    return {
        "rayVersion": spec.ray_version,
        "enableInTreeAutoscaling": False,
        # Always explicit: KubeRay v1.7.0 documents "token" as the default but defaults nothing.
        "authOptions": {"mode": spec.auth_mode},
        "headGroupSpec": head_group_spec(spec, cluster),
        "workerGroupSpecs": [worker_group_spec(spec, cluster)],
    }


# --------------------------------------------------------------------- objects

def entrypoint_args(spec: RayWorkloadSpec) -> tuple[str, ...]:
    """The job's command as arguments: ``spec.entrypoint``, or our training module with the
    preset, the worker counts and ``training_args``. The storage path comes from the pods'
    ``RAY_TRAIN_EKS_STORAGE_PATH`` (s3://<bucket>/runs)."""
    if spec.entrypoint is not None:
        return tuple(spec.entrypoint)
    return (
        "python", "-m", "training.train",
        "--preset", spec.training_preset,
        "--num-workers", str(spec.worker_gpus * spec.gpu_node_count),
        "--workers-per-node", str(spec.worker_gpus),
        *(["--gpu-type", INSTANCE_TYPES[spec.gpu_instance_type].gpu_model]
          if spec.gpu_instance_type in INSTANCE_TYPES and INSTANCE_TYPES[spec.gpu_instance_type].gpu_model else []),
        *(["--expect-efa"] if spec.worker_efa and spec.gpu_node_count > 1 else []),
        *spec.training_args,
    )


def training_entrypoint(spec: RayWorkloadSpec) -> str:
    """The entrypoint string. KubeRay's K8sJobMode submitter runs it inside ``bash -c``
    unquoted (ray-operator/controllers/ray/common/job.go), so every argument is quoted:
    ``$``, quotes or ``;`` in an argument reach the program, not the submitter's shell."""
    return shlex.join(entrypoint_args(spec))


def runtime_env_yaml() -> str:
    """The job's runtime environment. The code is in the image's pods already (ConfigMap
    volume); the runtime env puts it on the path of the driver and of every Ray worker.
    No ``pip``: the image has what training needs (Hub data sets load without ``datasets``)."""
    return f"env_vars:\n  PYTHONPATH: {CODE_MOUNT}\n  TOKENIZERS_PARALLELISM: \"false\"\n"


def ray_job(spec: RayWorkloadSpec) -> dict:
    """The fine-tune as a RayJob, named from a hash of its spec and code: a RayJob ignores
    changes to its spec once created, so a changed run must be a new object."""
    job_spec: dict[str, Any] = {
        "entrypoint": training_entrypoint(spec),
        "runtimeEnvYAML": runtime_env_yaml(),
        "submissionMode": spec.submission_mode,
        "activeDeadlineSeconds": spec.active_deadline_seconds,
    }
    if spec.pre_running_deadline_seconds is not None:
        job_spec["preRunningDeadlineSeconds"] = spec.pre_running_deadline_seconds
    if spec.workload == "cluster":
        # No backoffLimit at all: KubeRay rejects any value above 0 with a clusterSelector.
        job_spec["clusterSelector"] = {"ray.io/cluster": spec.ray_cluster_name}
        job_spec["shutdownAfterJobFinishes"] = False
    else:
        job_spec["rayClusterSpec"] = ray_cluster_spec(spec)  # labelled with the job's name below
        job_spec["backoffLimit"] = spec.backoff_limit
        job_spec["shutdownAfterJobFinishes"] = spec.shutdown_after_job_finishes
        if spec.shutdown_after_job_finishes:
            job_spec["ttlSecondsAfterFinished"] = spec.ttl_seconds_after_finished
    if spec.suspend:
        job_spec["suspend"] = True
    digest = hashlib.sha256(json.dumps([job_spec, files_digest(spec.training_code)], sort_keys=True).encode()).hexdigest()[:8]
    name = f"{spec.ray_job_name_prefix}-{digest}"
    if "rayClusterSpec" in job_spec:
        job_spec["rayClusterSpec"] = ray_cluster_spec(spec, cluster=name)
    return {
        "apiVersion": RAY_API_VERSION,
        "kind": "RayJob",
        "metadata": {"name": name, "namespace": spec.namespace, "labels": dict(PART_OF)},
        "spec": job_spec,
    }


def ray_cluster(spec: RayWorkloadSpec) -> dict:
    """The standing RayCluster of the ``cluster`` workload."""
    return {
        "apiVersion": RAY_API_VERSION,
        "kind": "RayCluster",
        "metadata": {"name": spec.ray_cluster_name, "namespace": spec.namespace, "labels": dict(PART_OF)},
        # KubeRay recreates no pod when a RayCluster's spec changes (token auth turned on, a new
        # image) unless told to: with Recreate it deletes them all when the spec's hash differs
        # from the one on its head pod (raycluster_controller.go shouldRecreatePodsForUpgrade;
        # only for a RayCluster of its own, not a RayJob's: utils/validation.go). Pods created
        # before it carry no hash and stay once: delete them (README, "Who can run code").
        "spec": {**ray_cluster_spec(spec, cluster=spec.ray_cluster_name), "upgradeStrategy": {"type": "Recreate"}},
    }


# --------------------------------------------------------------------- network policies

def _network_policy(spec: RayWorkloadSpec, name: str, pods: Mapping[str, str], ingress: list[dict]) -> dict:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": spec.namespace, "labels": dict(PART_OF)},
        "spec": {"podSelector": {"matchLabels": dict(pods)} if pods else {}, "policyTypes": ["Ingress"], "ingress": ingress},
    }


def deny_ingress_policy(spec: RayWorkloadSpec) -> dict:
    """No ingress to any pod of the namespace but what another policy allows. Egress stays open
    (DNS, S3, the Hub, the EKS API). Kubernetes always lets a pod's own node reach it (the
    NetworkPolicy API, v1.36: "OR if the traffic source is the pod's local node"): kubelet's probes."""
    return _network_policy(spec, "ray-train-eks-deny-ingress", {}, [])


def cluster_policies(spec: RayWorkloadSpec, cluster: str, *, submitter_of: str | None) -> list[dict]:
    """The allows of one Ray cluster (pods labelled ``cluster``): its pods to each other on every
    port (Ray's GCS 6379 and dashboard agent 52365 are fixed, its raylets, object managers and
    workers take random ports), and to the head's dashboard (8265: the job API) the KubeRay
    operator (job status, stop, HTTPMode submission) and K8sJobMode submitters: the one of the
    RayJob ``submitter_of``, or (None, a standing cluster) that of any RayJob of the namespace,
    since RayJobs select a standing cluster by name. The Ray Client port (10001) and Ray's
    metrics port (8080) get no allow: nothing here uses the one or scrapes the other."""
    pods = {CLUSTER_LABEL: cluster}
    submitters = {SUBMITTER_CRD_LABEL: "RayJob", "app.kubernetes.io/created-by": "kuberay-operator"}
    if submitter_of is not None:
        submitters[SUBMITTER_NAME_LABEL] = submitter_of
    dashboard_from = [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": spec.operator_namespace}},
         "podSelector": {"matchLabels": dict(spec.operator_pod_labels)}},
        {"podSelector": {"matchLabels": submitters}},
    ]
    return [
        _network_policy(spec, f"{cluster}-ray-pods", pods, [{"from": [{"podSelector": {"matchLabels": dict(pods)}}]}]),
        _network_policy(spec, f"{cluster}-dashboard", {**pods, "ray.io/node-type": "head"},
                        [{"from": dashboard_from, "ports": [{"protocol": "TCP", "port": DASHBOARD_PORT}]}]),
    ]


def files_digest(files: Mapping[str, str]) -> str:
    """Short hash of file name -> content."""
    return hashlib.sha256(json.dumps(sorted(files.items())).encode()).hexdigest()[:16]


def standing_cluster_objects(spec: RayWorkloadSpec) -> list[dict]:
    """The standing RayCluster, after its NetworkPolicies (applied first; in the VPC CNI's standard
    mode a new pod still accepts traffic until the agent has applied them to it)."""
    policies = cluster_policies(spec, spec.ray_cluster_name, submitter_of=None) if spec.network_policies else []
    return [*policies, ray_cluster(spec)]


def job_objects(spec: RayWorkloadSpec) -> list[dict]:
    """The RayJob, after the NetworkPolicies of the cluster it brings (none on a standing cluster)."""
    job = ray_job(spec)
    name = job["metadata"]["name"]
    policies = cluster_policies(spec, name, submitter_of=name) if spec.network_policies and spec.workload == "job" else []
    return [*policies, job]


def node_marker_objects(spec: RayWorkloadSpec) -> list[dict]:
    """What lets a GPU worker taint its own node at a hardware fault, and nothing more: a
    ClusterRole to get and patch nodes, bound to the Ray pods' service account, and a
    ValidatingAdmissionPolicy (admissionregistration.k8s.io/v1, GA since Kubernetes 1.30) under
    which that account's node updates may add, change or remove ``spec.unhealthy_taint_key`` with
    effect NoSchedule and leave every other taint, label, annotation, finalizer, owner and the
    node's ``unschedulable`` as they were. None without an ``unhealthy_taint_key``."""
    key = spec.unhealthy_taint_key
    if not key:
        return []
    name = f"ray-train-eks-node-marker-{spec.namespace}"
    user = f"system:serviceaccount:{spec.namespace}:{spec.service_account}"
    metadata = {"name": name, "labels": dict(PART_OF)}

    def same(path: str) -> str:  # has() first: CEL compares fields that are set
        return f"has(object.{path}) == has(oldObject.{path}) && (!has(object.{path}) || object.{path} == oldObject.{path})"

    def kept(new: str, old: str) -> str:  # every taint of ``new`` but ours is one of ``old``'s
        return (f"!has({new}.spec.taints) || {new}.spec.taints.all(t, t.key == variables.key || "
                f"(has({old}.spec.taints) && {old}.spec.taints.exists(o, o == t)))")

    return [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": metadata,
         "rules": [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": metadata,
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": spec.service_account, "namespace": spec.namespace}]},
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy", "metadata": metadata,
         "spec": {
             "failurePolicy": "Fail",
             "matchConstraints": {"resourceRules": [
                 {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["UPDATE"], "resources": ["nodes"]}]},
             "matchConditions": [{"name": "ray-pods", "expression": f"request.userInfo.username == {json.dumps(user)}"}],
             "variables": [{"name": "key", "expression": json.dumps(key)}],
             "validations": [
                 {"expression": f"({kept('object', 'oldObject')}) && ({kept('oldObject', 'object')})",
                  "message": f"the Ray pods may change no taint of a node but {key}"},
                 {"expression": "!has(object.spec.taints) || object.spec.taints.all(t, t.key != variables.key || "
                                "t.effect == 'NoSchedule')",
                  "message": f"the Ray pods may set {key} with effect NoSchedule only"},
                 *({"expression": same(path), "message": f"the Ray pods may not change a node's {path}"}
                   for path in ("metadata.labels", "metadata.annotations", "metadata.finalizers",
                                "metadata.ownerReferences", "spec.unschedulable")),
             ],
         }},
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding", "metadata": metadata,
         "spec": {"policyName": name, "validationActions": ["Deny"]}},
    ]


def ray_objects(spec: RayWorkloadSpec) -> list[dict]:
    """The Ray objects of the configured workload with their NetworkPolicies, in apply order (the
    training-code ConfigMap, built with cdk8s-plus, comes before them: ray_workload_chart.py), after
    the node marker's permission and policy."""
    objects = [*node_marker_objects(spec), *([deny_ingress_policy(spec)] if spec.network_policies else [])]
    if spec.workload == "cluster":
        objects.extend(standing_cluster_objects(spec))
    if spec.run_job:
        objects.extend(job_objects(spec))
    return objects


def applied_size_problem(obj: Mapping[str, Any], *, fix: str) -> str | None:
    """A problem when ``obj`` is too large to ``kubectl apply`` (see MAX_APPLIED_OBJECT_BYTES)."""
    size = len(json.dumps(obj, separators=(",", ":")).encode())
    if size <= MAX_APPLIED_OBJECT_BYTES:
        return None
    kind, name = obj.get("kind"), obj.get("metadata", {}).get("name")
    return (f"{kind} {name} is {size / 1024:.0f} KiB; kubectl apply keeps the whole object in the "
            f"kubectl.kubernetes.io/last-applied-configuration annotation, and an object's annotations are capped at "
            f"256 KiB: {fix}")

