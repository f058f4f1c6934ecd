"""The Ray workload applied by ``cdk deploy``: training code, settings, RayCluster, RayJob."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import cdk8s
from aws_cdk import aws_eks_v2 as eks, aws_s3 as s3
from constructs import Construct, IConstruct

from ray_train_eks.charts.ray_workload import (
    RayWorkloadSpec,
    load_training_code,
    ray_cluster,
    ray_job,
    training_code_configmap,
    workload_problems,
)
from ray_train_eks.charts.ray_workload_chart import ObjectChart, settings_configmap

#: The repository's training package, shipped when no ``training_code`` is given.
REPO_TRAINING_DIR = Path(__file__).resolve().parents[2] / "training"


class RayWorkload(Construct):
    """Applies the Ray workload to the cluster through cdk8s charts.

    Each object is its own manifest so that CloudFormation replaces or deletes it on its
    own: the RayJob's construct id carries its spec hash (a RayJob ignores edits once
    created, so a new training config must be a new RayJob, and the old one is deleted),
    and dropping the standing RayCluster deletes it instead of orphaning it with its GPUs.

    :param spec: what to run (validated here too; the app validates it earlier with the rest of the config).
    :param bucket: the training bucket; its name reaches the pods through a settings ConfigMap.
    :param depends_on: what must exist first (the KubeRay operator with its CRDs, the service account).
    :param training_code: file name -> content of the training package. Default - this repository's ``training/``.
    """

    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        cluster: eks.ICluster,
        spec: RayWorkloadSpec,
        bucket: s3.IBucket,
        depends_on: list[IConstruct] | None = None,
        training_code: dict[str, str] | None = None,
    ) -> None:
        super().__init__(scope, id)
        if training_code is None:
            if not REPO_TRAINING_DIR.is_dir():
                raise ValueError("RayWorkload: training_code not given and no training/ folder beside the package; pass training_code")
            training_code = load_training_code(REPO_TRAINING_DIR)
        self.spec = dataclasses.replace(spec, training_code=training_code)
        problems = workload_problems(self.spec)
        if problems:
            raise ValueError("RayWorkload: " + "; ".join(problems))

        app = cdk8s.App()
        settings = cluster.add_manifest("Settings", settings_configmap(namespace=self.spec.namespace, bucket=bucket.bucket_name))
        self.manifests: dict[str, eks.KubernetesManifest] = {"Settings": settings}
        charts = {"TrainingCode": [training_code_configmap(self.spec)]}
        if self.spec.workload == "cluster":
            charts["RayCluster"] = [ray_cluster(self.spec)]
        if self.spec.run_job:
            job = ray_job(self.spec)
            self.job_name = job["metadata"]["name"]
            charts[f"RayJob-{self.job_name}"] = [job]
        for chart_id, objects in charts.items():
            # prune=False: what CDK applies is exactly what dist/ holds (no prune labels);
            # removal is by CloudFormation deleting the manifest, one object per manifest.
            manifest = cluster.add_cdk8s_chart(chart_id, ObjectChart(app, chart_id, objects=objects), prune=False)
            for dependency in depends_on or []:
                manifest.node.add_dependency(dependency)
            self.manifests[chart_id] = manifest
        for chart_id, manifest in self.manifests.items():
            if chart_id.startswith("Ray"):
                manifest.node.add_dependency(self.manifests["TrainingCode"], settings)
        for dependency in depends_on or []:
            settings.node.add_dependency(dependency)
