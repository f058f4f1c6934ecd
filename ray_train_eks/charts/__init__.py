"""cdk8s charts of the Ray workload (RayJob, RayCluster, training code, settings)."""

from ray_train_eks.charts.ray_workload import RayWorkloadSpec, ray_objects, workload_problems
from ray_train_eks.charts.ray_workload_chart import (
    NamespaceChart,
    ObjectChart,
    SettingsChart,
    TrainingCodeChart,
    write_dist,
)

__all__ = [
    "NamespaceChart",
    "ObjectChart",
    "RayWorkloadSpec",
    "SettingsChart",
    "TrainingCodeChart",
    "ray_objects",
    "workload_problems",
    "write_dist",
]
