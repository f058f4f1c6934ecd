"""cdk8s charts of the Ray workload (RayJob, RayCluster, training code)."""

from ray_train_eks.charts.ray_workload import RayWorkloadSpec, workload_objects, workload_problems
from ray_train_eks.charts.ray_workload_chart import ObjectChart, write_dist

__all__ = ["ObjectChart", "RayWorkloadSpec", "workload_objects", "workload_problems", "write_dist"]
