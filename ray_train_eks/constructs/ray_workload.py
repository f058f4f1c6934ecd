"""The Ray workload applied by ``cdk deploy``: training code, settings, RayCluster, RayJob."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path
from typing import Mapping

import cdk8s
from aws_cdk import Annotations, NestedStack, aws_eks_v2 as eks, aws_s3 as s3
from constructs import Construct, IConstruct

from ray_train_eks.charts.ray_workload_chart import ObjectChart, SettingsChart, TrainingCodeChart
from ray_train_eks.workload import (
    RayWorkloadSpec,
    applied_size_problem,
    deny_ingress_policy,
    job_objects,
    memory_plan_choice,
    memory_plan_notice,
    node_marker_objects,
    resolve_job,
    spec_settings,
    standing_cluster_objects,
    workload_problems,
)
from ray_train_eks.workload.serving import serving_head_room_problem
from ray_train_eks.workload.stopped_jobs import stopped_job_objects

#: The bundled training package: ``training/`` of this repository, installed by the wheel
#: as ``ray_train_eks.training_code`` (pyproject.toml maps it).
BUNDLED_TRAINING_PACKAGE = "ray_train_eks.training_code"


def bundled_training_code() -> Path:
    """The folder of the training package that comes with ray-train-eks (not imported)."""
    spec = importlib.util.find_spec(BUNDLED_TRAINING_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"RayWorkload: {BUNDLED_TRAINING_PACKAGE} is not installed; pass training_code_dir")
    return Path(list(spec.submodule_search_locations)[0])


#: The most the training code's manifest may take of its nested stack's template (CloudFormation: 1 MB a
#: template; the rest is the custom resource's own properties, parameters and metadata).
CODE_TEMPLATE_BYTES = 980_000

#: The manifests applied before the Ray objects: the code, the node marker's permission (a worker may
#: taint its node from its first step), the stopped-job watch's (workload/stopped_jobs.py), the namespace's deny.
RAY_OBJECTS_AFTER = ("TrainingCode", "NodeMarker", "StoppedJobs", "NetworkPolicy")


def code_template_problem(code: cdk8s.Chart) -> str | None:
    """A problem when the training code's manifest would not fit its nested stack's template (:data:`CODE_TEMPLATE_BYTES`)."""
    # As the template holds each part's manifest: a JSON string (escaped once more) inside the template's JSON.
    size = sum(len(json.dumps(json.dumps([obj], separators=(",", ":"))).encode()) for obj in code.to_json())
    if size <= CODE_TEMPLATE_BYTES:
        return None
    return (f"the training code's ConfigMaps are {size / 1e6:.2f} MB, more than a CloudFormation template holds beside them "
            f"({CODE_TEMPLATE_BYTES / 1e6:.2f} MB of 1 MB): trim the package (training_code_dir) to what the job imports, or "
            "ship the code as an S3 object fetched by the entrypoint")


def _unenforced(namespace: str) -> str:
    """The warning when nothing says the cluster enforces NetworkPolicies."""
    return (f"RayWorkload: NetworkPolicies in namespace {namespace} (deny ingress, then allow the Ray pods "
            "and the job API to the operator and submitter) hold only where the cluster's CNI enforces them; with "
            "the VPC CNI set the vpc-cni add-on's configuration {\"enableNetworkPolicy\": \"true\"}. Without "
            "enforcement they are stored and have no effect (Ray's token authentication still holds). Pass "
            "network_policy_enforced=True once it does, or spec.network_policies=False.")


class RayWorkload(Construct):
    """Applies the Ray workload to the cluster through cdk8s charts.

    Each object is its own manifest so that CloudFormation replaces or deletes it on its
    own: the RayJob's construct id carries its spec hash (a RayJob ignores edits once
    created, so a new training config must be a new RayJob, and the old one is deleted),
    and dropping the standing RayCluster deletes it instead of orphaning it with its GPUs.

    :param spec: what to run, where its pods go and how big they are (validated here too;
        the app validates it earlier with the rest of the config).
    :param bucket: the training bucket; its name reaches the pods through a settings ConfigMap.
    :param depends_on: what must exist first (the KubeRay operator with its CRDs, the service account).
    :param training_code_dir: the folder of the Python package the job runs, shipped as a
        ConfigMap mounted at /opt/ray-train-eks/<spec.code_package>. Default - the bundled
        ``training`` package (run with ``spec.entrypoint`` None).
    :param network_policy_enforced: whether ``cluster`` enforces NetworkPolicies (TrainingCluster
        turns the VPC CNI's enforcement on and says so). Default - unknown: with
        ``spec.network_policies`` synth notes that the policies are applied but only a CNI that
        enforces them makes them hold; the deploy works either way.
    :param tracking_uri: the MLflow the runs log to (``spec.tracking``): an http(s) URL or a SageMaker MLflow
        ARN (a token: ``MlflowTracking.tracking_uri``), written into the settings ConfigMap. Default - none.
    :param settings: more keys of the settings ConfigMap, which the pods read (``notify_topic_arn``: the SNS
        topic a run's end and faults are published to; ``capacity_block_ids``: the Capacity Blocks the GPU
        nodes run on, for the stop before their end; ``capacity_block_nodes``: ``karpenter`` where Karpenter runs
        them, so a block's extension moves that stop, else a managed node group's, whose stop stays;
        ray_train_eks/workload/environment.py). Default - none.
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
        training_code_dir: Path | str | None = None,
        network_policy_enforced: bool = False,
        tracking_uri: str | None = None,
        settings: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(scope, id)
        self.code_directory = Path(training_code_dir) if training_code_dir is not None else bundled_training_code()
        app = cdk8s.App()
        code = TrainingCodeChart(app, "TrainingCode", directory=self.code_directory, namespace=spec.namespace)
        self.spec = dataclasses.replace(spec, training_code=code.files)
        #: The job resolved once (ray_train_eks/workload/job.py): every object below is built from it.
        self.job = resolve_job(self.spec)
        problems = workload_problems(self.job)
        if problems:
            raise ValueError("RayWorkload: " + "; ".join(problems))

        notice = memory_plan_notice(self.job)
        if notice:
            Annotations.of(self).add_warning_v2("ray-train-eks:modelNotPlanned", f"RayWorkload: {notice}")
        serving_head = serving_head_room_problem(self.spec)
        if serving_head:
            Annotations.of(self).add_warning_v2("ray-train-eks:servingHeadRoom", f"RayWorkload: {serving_head}")
        #: What the memory plan chose for the job where its options left it open (None: nothing).
        self.memory_plan_choice = memory_plan_choice(self.job)
        if self.memory_plan_choice:
            Annotations.of(self).add_info(f"RayWorkload: memory plan: {self.memory_plan_choice}")
        charts: dict[str, cdk8s.Chart] = {"TrainingCode": code}
        if self.spec.unhealthy_taint_key:
            charts["NodeMarker"] = ObjectChart(app, "NodeMarker", objects=node_marker_objects(self.spec))
        if self.job.frees_stopped_jobs:  # the watch beside each head may delete its stopped job
            charts["StoppedJobs"] = ObjectChart(app, "StoppedJobs", objects=stopped_job_objects(self.job))
        if self.spec.network_policies:
            charts["NetworkPolicy"] = ObjectChart(app, "NetworkPolicy", objects=[deny_ingress_policy(self.spec)])
            if not network_policy_enforced:
                Annotations.of(self).add_warning_v2("ray-train-eks:networkPolicyNotEnforced", _unenforced(self.spec.namespace))
        # Each Ray object's manifest holds its NetworkPolicies first, so they are applied before its
        # pods are created and go with it (in the VPC CNI's standard mode a new pod still accepts
        # traffic until the policy agent has applied them to it: seconds).
        if self.spec.workload == "cluster":
            charts["RayCluster"] = ObjectChart(app, "RayCluster", objects=standing_cluster_objects(self.job))
        if self.spec.run_job:
            objects = job_objects(self.job)
            self.job_name = objects[-1]["metadata"]["name"]
            charts[f"RayJob-{self.job_name}"] = ObjectChart(app, f"RayJob-{self.job_name}", objects=objects)
        too_large = [problem for chart in charts.values() for obj in chart.to_json()
                     if (problem := applied_size_problem(obj, fix="ship the code as an S3 object and fetch it in the entrypoint, "
                                                               "or trim the package to what the job imports"))]
        too_large += [problem] if (problem := code_template_problem(code)) else []
        if too_large:
            raise ValueError("RayWorkload: " + "; ".join(too_large))

        # "manifest-Settings": the id add_manifest gave it before, so the logical id stays and an
        # update does not replace (delete) the object.
        settings = cluster.add_cdk8s_chart(
            "manifest-Settings", SettingsChart(app, "Settings", namespace=self.spec.namespace, bucket=bucket.bucket_name,
                                               workload=spec_settings(self.spec), tracking_uri=tracking_uri,
                                               extra=settings),
            prune=False,
        )
        self.manifests: dict[str, eks.KubernetesManifest] = {"Settings": settings}
        for chart_id, chart in charts.items():
            # prune=False: what CDK applies is exactly what dist/ holds (no prune labels);
            # removal is by CloudFormation deleting the manifest, one object per manifest.
            self.manifests[chart_id] = (self._code_manifest(cluster, chart) if chart_id == "TrainingCode"
                                        else cluster.add_cdk8s_chart(chart_id, chart, prune=False))
        for chart_id, manifest in self.manifests.items():
            for dependency in depends_on or []:
                manifest.node.add_dependency(dependency)
            if chart_id.startswith("Ray"):  # after the code, settings, permissions and policies its pods use
                manifest.node.add_dependency(settings, *(self.manifests[first] for first in RAY_OBJECTS_AFTER
                                                         if first in self.manifests))

    def _code_manifest(self, cluster: eks.ICluster, chart: cdk8s.Chart) -> eks.KubernetesManifest:
        """The training code's ConfigMaps in a nested stack of their own (``TrainingCodeStack``), one manifest
        each; the first is returned (a dependency on it is one on the nested stack, so on every part).

        - A stack of their own: the code is most of a template's size (about 0.8 MB of the Python package,
          inline), and CloudFormation takes at most 1 MB a template (AWS CloudFormation User Guide,
          "Understand CloudFormation quotas": template body size in an S3 object); alone it has the megabyte.
        - A manifest each: CloudFormation invokes a custom resource's function asynchronously, whose event
          Lambda caps at 1 MB, and an update's event holds the properties twice (new and old); one ConfigMap
          (``CODE_PART_BYTES``, 160 kB) a manifest keeps an update's event near 0.35 MB, where the whole code
          in one would be 1.5 MB and every update of the code would fail."""
        code_stack = NestedStack(self, "TrainingCodeStack",
                                 description="ray-train-eks: the training code's ConfigMaps (a template of their own: 1 MB a template)")
        parts = [eks.KubernetesManifest(code_stack, "TrainingCode" if index == 0 else f"TrainingCodePart{index + 1}",
                                        cluster=cluster, manifest=[config_map], prune=False)
                 for index, config_map in enumerate(chart.to_json())]
        return parts[0]

