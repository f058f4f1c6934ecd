"""The Ray workload's spec: everything its Kubernetes objects are built from, with its defaults,
and the rules about the spec as a whole. Each concern's own rules live with it (pods.py,
access.py, drain_hook.py, node_marker.py, code.py, entrypoint.py, workload.py); workload.py's
``workload_problems`` collects them all.

The objects are plain dicts built by typed builders and checked at synth for what only the
KubeRay operator would reject later; the tests validate every object strictly against the
KubeRay v1.7.0 CRD schemas. (The standard objects, the ConfigMaps and the namespace, are
cdk8s-plus: ray_workload_chart.py.)

Why not ``cdk8s import`` bindings: in Python their nested lists take dicts whose keys must
already be Kubernetes camelCase (snake_case ones are dropped without a word), so they give
no safety where the risk is; they add an 8 MB generated module to import at every synth.
Plain dicts with literal camelCase keys plus strict schema validation catch every
misspelled field instead.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, fields
from typing import Mapping

from ray_train_eks.instances import INSTANCE_TYPES
from ray_train_eks.scheduling import GPU_TOLERATION, RAY_NAMESPACE, RAY_SERVICE_ACCOUNT

#: The Ray Train DLC: Ray 2.58.0, PyTorch 2.13.0, CUDA 13, NCCL 2.29 with aws-ofi-nccl, EFA 1.47.
DEFAULT_RAY_IMAGE = "public.ecr.aws/deep-learning-containers/ray:train-ml-cuda-v1.1"
#: Must equal the image's Ray (KubeRay uses it to pick compatible behaviour).
DEFAULT_RAY_VERSION = "2.58.0"
#: The Ray Serve LLM DLC the services run on: Ray 2.58.0 (the training image's, so one ``rayVersion``
#: and one driver) and vLLM 0.26.0, the vLLM Ray 2.58's ``ray[llm]`` extra pins
#: (ray-2.58.0.dist-info METADATA: ``vllm[audio]==0.26.0``); CUDA 13.0.2, Python 3.13, EFA.
#: aws/deep-learning-containers docs/ray-llm/changelog (released 2026-08-31). The training image has
#: no vLLM, and the head builds the app (it imports vLLM), so head and GPU workers both run this one.
DEFAULT_SERVING_IMAGE = "public.ecr.aws/deep-learning-containers/ray:serve-llm-cuda-v1.0.0"
#: The label of every object we create.
PART_OF = {"app.kubernetes.io/part-of": "ray-train-eks"}
#: The GPU worker pods' grace period: their preStop hook drains the pod's Ray node for it (less a
#: margin for SIGTERM), and the training writes and uploads its checkpoint at the notice inside
#: it (see drain_hook.py ``DRAIN_HOOK``).
WORKER_TERMINATION_GRACE_SECONDS = 300
#: The taint a training worker puts on its node when its GPU breaks (training/resilience/health.py; the
#: permission and policy that let it: node_marker.py).
UNHEALTHY_TAINT_KEY = "ray-train-eks/gpu-unhealthy"
#: The driver's (the head's) environment variable for ``replacement_timeout_s`` (training/resilience/preemption.py).
REPLACEMENT_TIMEOUT_ENV = "RAY_TRAIN_EKS_REPLACEMENT_TIMEOUT_S"
#: The KubeRay operator's pod labels in its chart (helm-chart/kuberay-operator/templates/deployment.yaml
#: at v1.7.0: app.kubernetes.io/name is the chart's name unless nameOverride); access.py's
#: NetworkPolicies let them reach the Ray heads' dashboard.
KUBERAY_OPERATOR_POD_LABELS = {"app.kubernetes.io/name": "kuberay-operator"}
WORKLOADS = ("job", "cluster")
#: A run's name: a DNS label short enough for the RayJob's name (the run, a dash and 8 hex digits)
#: and KubeRay's names derived from it (its RayCluster adds 6 characters, its pods more).
RUN_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,28}[a-z0-9])?$")


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
    #: Kueue's LocalQueue the RayJob is queued in (queueing.py: created suspended, admitted whole);
    #: None: not queued.
    queue_name: str | None = None
    ttl_seconds_after_finished: int = 600
    active_deadline_seconds: int = 4 * 3600
    #: Seconds a RayJob may take to reach Running (its cluster Ready, the job submitted);
    #: past it KubeRay fails the job and, with ``shutdown_after_job_finishes``, deletes its
    #: RayCluster, freeing whatever nodes did come. None: no deadline.
    pre_running_deadline_seconds: int | None = None
    #: CloudWatch namespace rank 0 publishes training metrics to (training/telemetry/cloudwatch.py),
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
    #: sooner than the grace period says (Spot: drain_hook.py ``SPOT_DRAIN_DEADLINE_SECONDS``).
    #: None: the grace period less drain_hook.py ``DRAIN_MARGIN_SECONDS``.
    drain_deadline_seconds: int | None = None
    #: (CPU, GiB) of the head and of each GPU worker. None: from the instance table.
    head_resources: tuple[int, int] | None = None
    worker_resources: tuple[int, int] | None = None
    head_node_selector: Mapping[str, str] = field(default_factory=dict)
    worker_node_selector: Mapping[str, str] = field(default_factory=dict)
    head_tolerations: tuple[Mapping[str, str], ...] = ()
    worker_tolerations: tuple[Mapping[str, str], ...] = (GPU_TOLERATION,)
    #: Ray's authentication on every Ray cluster created here: ``token`` (the default; see
    #: access.py ``AUTH_MODES``) or ``disabled``.
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
    #: straggler (training/resilience/health.py), so the worker pod KubeRay creates next lands elsewhere: the
    #: service account may patch nodes, and an admission policy lets it change this taint only
    #: (node_marker.py ``node_marker_objects``). None: no taint, no node permission (the Ray drain
    #: alone then keeps the retry off the node only until its pod restarts).
    unhealthy_taint_key: str | None = UNHEALTHY_TAINT_KEY
    #: Seconds after the run lost a node (a preemption, a node lost without notice, a node taken out for
    #: a hardware fault) that it may wait for its worker group before it stops, naming the nodes and what
    #: to do (training/resilience/replacement.py ``NoReplacement``): a fixed-size node group replaces a node
    #: taken out only by repair, which never repairs what the monitoring agent does not report (a
    #: straggler), and neither it nor Karpenter launches an instance where EC2 has no capacity. None: wait
    #: as long as it takes.
    replacement_timeout_s: int | None = None
    #: The GPU nodes come from Karpenter: the Ray pods may list its NodeClaims, to say why a
    #: replacement node does not come (training/resilience/kube.py ``capacity_trouble``).
    node_claims_readable: bool = False
    #: Seconds after a job was stopped with ``ray job stop`` that a watch beside its Ray head
    #: deletes its RayJob, so its GPU nodes are freed: KubeRay's deletion rules cannot name a
    #: stopped job (stopped_jobs.py). None: no watch (the job stays until its RayJob is deleted).
    stopped_job_grace_s: int | None = 60
    #: The runs log to MLflow (training/telemetry/tracking.py): the pods get ``MLFLOW_TRACKING_URI`` from the
    #: settings ConfigMap (key ``mlflow_tracking_uri``, written by the deploy) and the job's runtime env
    #: installs the MLflow client where the image lacks it.
    tracking: bool = False
    #: The MLflow experiment of the runs (``RAY_TRAIN_EKS_MLFLOW_EXPERIMENT``); None: the training's default.
    tracking_experiment: str | None = None
    #: Serving (ray_train_eks/workload/serving.py): the image of a service's pods; the GPU nodes its
    #: replicas may take (its worker group's ``maxReplicas``; with Karpenter, the serving NodePool's
    #: limit); where they go (None: the GPU workers' selector, and their tolerations plus these); and
    #: the seconds a replica (and then its GPU node) stays without a request.
    serving_image: str = DEFAULT_SERVING_IMAGE
    #: Where the GPU nodes come from (``nodegroup``: a fixed group training and serving share;
    #: ``karpenter``: nodes while pods need them, serving's in a NodePool of its own): what the
    #: command says waits for what.
    gpu_capacity: str = "nodegroup"
    serving_gpu_nodes: int = 1
    serving_node_selector: Mapping[str, str] | None = None
    serving_tolerations: tuple[Mapping[str, str], ...] = ()
    serving_idle_seconds: int = 900
    #: CPU (millicores) the system nodes have left beside the training's head: a service's head needs
    #: capacity.py's ``serving-head`` of it, else it waits until no training job runs. None: unknown.
    system_room_m: int | None = None
    #: Memory (MiB) one system node can give a pod beside the training's head. None: unknown.
    system_memory_room_mib: int | None = None
    #: The ConfigMaps the pods mount the code from: None, the deployed code's
    #: (``ray-train-eks-code``); a name, a copy of the job's own (``ray-train-eks submit``
    #: of code that is not the deployed code: code.py ``code_config_maps``).
    code_config_map: str | None = None
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


def spec_settings(spec: RayWorkloadSpec) -> str:
    """The spec as JSON, its training code left out (the code ConfigMaps hold it): what the stack
    writes into the cluster (the settings ConfigMap) for ``ray-train-eks submit`` to build its
    jobs with the deployed platform's settings (ray_train_eks/cli/, :func:`spec_from_settings`)."""
    values = {f.name: getattr(spec, f.name) for f in fields(RayWorkloadSpec) if f.name != "training_code"}
    return json.dumps(values, sort_keys=True, default=dict)


#: Fields whose objects the deployed platform creates (the stopped-job watch's Role and policy): in the
#: settings of a platform deployed before the field existed they are absent, and mean "off".
DEPLOYED_OBJECTS_FOR = {"stopped_job_grace_s": None}


def spec_from_settings(text: str, **changes) -> RayWorkloadSpec:
    """The spec :func:`spec_settings` wrote (JSON's lists back to tuples where the field is one),
    with ``changes``; keys this version does not know are left out, so a newer stack's settings
    still build a spec."""
    values, known = json.loads(text), {f.name: f for f in fields(RayWorkloadSpec)}
    for name, off in DEPLOYED_OBJECTS_FOR.items():  # a platform deployed before a field made none of its objects
        values.setdefault(name, off)
    for name, value in list(values.items()):
        if name not in known:
            values.pop(name)
        elif isinstance(value, list):
            values[name] = tuple(tuple(v) if isinstance(v, list) else v for v in value)
    return RayWorkloadSpec(**{**values, **changes})


def spec_problems(spec: RayWorkloadSpec) -> list[str]:
    """The rules about the spec as a whole: which workload it is."""
    if spec.workload not in WORKLOADS:
        return [f"workload={spec.workload!r}: use job (the RayJob brings its own cluster) or cluster (a standing RayCluster)"]
    if spec.replacement_timeout_s is not None and spec.replacement_timeout_s <= 0:
        return [f"replacement_timeout_s={spec.replacement_timeout_s}: give a positive number of seconds, or None to wait "
                "for a replacement node as long as it takes"]
    if spec.stopped_job_grace_s is not None and spec.stopped_job_grace_s < 0:
        return [f"stopped_job_grace_s={spec.stopped_job_grace_s}: give the seconds a stopped job keeps its cluster "
                "(0 or more, e.g. 60), or None for no watch"]
    return []
