"""The Ray workload as plain Kubernetes objects (RayJob, RayCluster, their pods, access rules and
checks): no CDK, no cdk8s, no jsii, so the ``ray-train-eks`` command (ray_train_eks/cli/) builds
the same objects as ``cdk deploy`` without starting Node.js.

One concern a module, imported in one direction: ``spec`` (the spec and its defaults) at the
bottom; ``code`` (the code ConfigMaps), ``access`` (token auth, NetworkPolicies), ``drain_hook``
(the preStop drain), ``node_marker`` (the node-taint permission and policy), ``queueing`` (Kueue),
``trainer_access`` (the trainers' Role), ``sizing`` (the pods' sizes and disk), ``environment``
(the pods' environment) and ``entrypoint`` (the job's command, options and runtime env) on it;
``job`` (the job resolved once: :func:`resolve_job`) on those; ``memory_plan``, ``pods`` and
``stopped_jobs`` on the resolved job; ``objects`` (the RayJob and RayCluster,
:func:`workload_problems`) on all. The cdk8s charts that carry these objects into a CDK stack are
ray_train_eks/charts/.
"""

from ray_train_eks.workload.access import CLUSTER_LABEL, deny_ingress_policy
from ray_train_eks.workload.code import applied_size_problem, code_items, code_key, code_parts, config_map_data
from ray_train_eks.workload.drain_hook import (
    DRAIN_HOOK,
    DRAIN_HOOK_LAUNCHER,
    DRAIN_MARGIN_SECONDS,
    PRESTOP_CHECK_ENV,
    SPOT_DRAIN_DEADLINE_SECONDS,
)
from ray_train_eks.workload.job import ResolvedJob, resolve_job, runtime_env_yaml, training_entrypoint, worker_disk_gib
from ray_train_eks.workload.memory_plan import memory_plan_choice, memory_plan_notice
from ray_train_eks.workload.node_marker import NODE_NAME_ENV, POD_GPUS_ENV, UNHEALTHY_TAINT_ENV, node_marker_objects
from ray_train_eks.workload.objects import (
    job_objects,
    ray_cluster,
    ray_job,
    ray_objects,
    standing_cluster_objects,
    workload_problems,
)
from ray_train_eks.workload.pods import head_group_spec, worker_group_spec
from ray_train_eks.workload.sizing import head_sizing
from ray_train_eks.workload.spec import (
    KUBERAY_OPERATOR_POD_LABELS,
    UNHEALTHY_TAINT_KEY,
    WORKER_TERMINATION_GRACE_SECONDS,
    RayWorkloadSpec,
    spec_from_settings,
    spec_settings,
)

__all__ = [
    "CLUSTER_LABEL",
    "DRAIN_HOOK",
    "DRAIN_HOOK_LAUNCHER",
    "DRAIN_MARGIN_SECONDS",
    "KUBERAY_OPERATOR_POD_LABELS",
    "NODE_NAME_ENV",
    "POD_GPUS_ENV",
    "PRESTOP_CHECK_ENV",
    "RayWorkloadSpec",
    "ResolvedJob",
    "SPOT_DRAIN_DEADLINE_SECONDS",
    "UNHEALTHY_TAINT_ENV",
    "UNHEALTHY_TAINT_KEY",
    "WORKER_TERMINATION_GRACE_SECONDS",
    "applied_size_problem",
    "code_items",
    "code_key",
    "code_parts",
    "config_map_data",
    "deny_ingress_policy",
    "head_group_spec",
    "head_sizing",
    "job_objects",
    "memory_plan_choice",
    "memory_plan_notice",
    "node_marker_objects",
    "ray_cluster",
    "ray_job",
    "ray_objects",
    "resolve_job",
    "runtime_env_yaml",
    "spec_from_settings",
    "spec_settings",
    "standing_cluster_objects",
    "training_entrypoint",
    "worker_disk_gib",
    "worker_group_spec",
    "workload_problems",
]
