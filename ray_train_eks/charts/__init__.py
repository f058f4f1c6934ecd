"""cdk8s charts of the Ray workload (RayJob, RayCluster, training code, settings).

One concern a module, each with its own rules, imported in one direction: ``spec`` (the spec
and its defaults); ``code`` (the code ConfigMaps), ``access`` (token auth, NetworkPolicies),
``drain_hook`` (the preStop drain), ``node_marker`` (the node-taint permission and policy) and
``entrypoint`` (the job's command, the training's plan) on it; ``pods`` (head and worker
groups) on those; ``workload`` (the RayJob and RayCluster, ``workload_problems``) on all; and
``ray_workload_chart`` (the cdk8s charts, ``write_dist``) on top. The charts are imported when first
used (:func:`__getattr__`): cdk8s starts Node.js, which ``ray-train-eks`` (ray_train_eks/cli.py),
building the same objects as plain dicts, neither needs nor has to have.
"""

from ray_train_eks.charts.access import CLUSTER_LABEL, deny_ingress_policy
from ray_train_eks.charts.code import applied_size_problem, code_items, code_key, code_parts, config_map_data
from ray_train_eks.charts.drain_hook import (
    DRAIN_HOOK,
    DRAIN_HOOK_LAUNCHER,
    DRAIN_MARGIN_SECONDS,
    PRESTOP_CHECK_ENV,
    SPOT_DRAIN_DEADLINE_SECONDS,
)
from ray_train_eks.charts.entrypoint import memory_plan_choice, memory_plan_notice, training_entrypoint
from ray_train_eks.charts.node_marker import NODE_NAME_ENV, POD_GPUS_ENV, UNHEALTHY_TAINT_ENV, node_marker_objects
from ray_train_eks.charts.pods import head_sizing, worker_disk_gib, worker_group_spec
from ray_train_eks.charts.spec import (
    KUBERAY_OPERATOR_POD_LABELS,
    UNHEALTHY_TAINT_KEY,
    WORKER_TERMINATION_GRACE_SECONDS,
    RayWorkloadSpec,
    spec_from_settings,
    spec_settings,
)
from ray_train_eks.charts.workload import (
    job_objects,
    ray_cluster,
    ray_job,
    ray_objects,
    runtime_env_yaml,
    standing_cluster_objects,
    workload_problems,
)

__all__ = [
    "CLUSTER_LABEL",
    "DRAIN_HOOK",
    "DRAIN_HOOK_LAUNCHER",
    "DRAIN_MARGIN_SECONDS",
    "KUBERAY_OPERATOR_POD_LABELS",
    "NODE_NAME_ENV",
    "NamespaceChart",
    "ObjectChart",
    "POD_GPUS_ENV",
    "PRESTOP_CHECK_ENV",
    "RayWorkloadSpec",
    "spec_from_settings",
    "spec_settings",
    "SPOT_DRAIN_DEADLINE_SECONDS",
    "SettingsChart",
    "TrainingCodeChart",
    "UNHEALTHY_TAINT_ENV",
    "UNHEALTHY_TAINT_KEY",
    "WORKER_TERMINATION_GRACE_SECONDS",
    "applied_size_problem",
    "code_items",
    "code_key",
    "code_parts",
    "config_map_data",
    "deny_ingress_policy",
    "head_sizing",
    "job_objects",
    "node_marker_objects",
    "ray_cluster",
    "ray_job",
    "ray_objects",
    "runtime_env_yaml",
    "standing_cluster_objects",
    "training_entrypoint",
    "memory_plan_choice",
    "memory_plan_notice",
    "worker_disk_gib",
    "worker_group_spec",
    "workload_problems",
    "write_dist",
]

#: The cdk8s charts (ray_workload_chart.py), imported on first use.
_CHARTS = ("NamespaceChart", "ObjectChart", "SettingsChart", "TrainingCodeChart", "write_dist")


def __getattr__(name: str):
    if name in _CHARTS:
        from ray_train_eks.charts import ray_workload_chart

        return getattr(ray_workload_chart, name)
    raise AttributeError(f"module 'ray_train_eks.charts' has no attribute {name!r}")
