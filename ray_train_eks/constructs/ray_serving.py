"""Runs served at deploy: what ``ray-train-eks serve`` makes, for CDK users who name their services in
code (GitOps of the stack itself)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Sequence

from aws_cdk import Duration, aws_eks_v2 as eks, aws_iam as iam, aws_s3 as s3
from constructs import Construct, IConstruct

from ray_train_eks.constructs.custom_resource import PythonCustomResource
from ray_train_eks.handlers.serving import SERVE_PREFIX, RUNS_PREFIX, ServingPlatform
from ray_train_eks.instances import INSTANCE_TYPES
from ray_train_eks.nag import acknowledge, rendered
from ray_train_eks.workload.serving import operator_problems, service_objects, service_problems
from ray_train_eks.workload.spec import RUN_NAME, RayWorkloadSpec


class RayServing(Construct):
    """Serves finished runs behind an OpenAI-compatible endpoint, as a RayService running Ray Serve LLM
    (ray_train_eks/workload/serving.py): a full fine-tune as its own model, LoRA runs of one base as
    adapters on it. At deploy a function (ray_train_eks/handlers/serving.py, the code ``ray-train-eks
    serve`` runs) reads the runs' records in the bucket, refuses what cannot be served (the deploy fails
    naming each run and why), stages the adapters and writes what the service serves; the RayService
    and its NetworkPolicies are then applied. Another list of runs is served in place on the
    next deploy (only ``serveConfigV2`` changes).

    :param cluster: the cluster, with the KubeRay operator (``depends_on``).
    :param spec: the platform's Ray workload spec (its namespace, service account, node roles, GPU
        type, serving's GPU nodes and idle time, image).
    :param bucket: the training bucket, where the runs are (``runs/<run>/``) and adapters are staged
        (``serve/<name>/``).
    :param name: the service's name (a DNS-1035 label, at most 47 characters).
    :param runs: the runs to serve (finished, with a ``final/``).
    :param depends_on: what must exist first (the KubeRay operator with its CRDs, the service account).
    """

    def __init__(self, scope: Construct, id: str, *, cluster: eks.ICluster, spec: RayWorkloadSpec, bucket: s3.IBucket,
                 name: str, runs: Sequence[str], depends_on: Sequence[IConstruct] = ()) -> None:
        super().__init__(scope, id)
        problems = service_problems(spec, name)
        problems += [f"runs: {run!r} is not a run's name (lower-case letters, digits and '-')" for run in runs
                     if not RUN_NAME.match(run)]
        if not runs:
            problems.append("runs: name at least one finished run to serve")
        if problems:
            raise ValueError("RayServing: " + "; ".join(problems))
        gpu = INSTANCE_TYPES[spec.gpu_instance_type]
        platform = ServingPlatform(gpus_per_node=spec.worker_gpus, gpu_memory_gib=gpu.gpu_memory_gib,
                                   max_replicas=spec.serving_gpu_nodes * spec.worker_gpus,
                                   idle_seconds=spec.serving_idle_seconds)
        self.runs = PythonCustomResource(
            self, "Runs", handler="serving.on_event", description=f"Reads, checks and stages the runs service {name} serves",
            properties={"Bucket": bucket.bucket_name, "Service": name, "Runs": PythonCustomResource.json(list(runs)),
                        "Platform": PythonCustomResource.json(asdict(platform))},
            statements=_staging_access(bucket, name), timeout=Duration.minutes(5))
        acknowledge(self.runs, f"The function reads the runs' records below runs/ and writes the adapters it stages below "
                               f"serve/{name}/ only: one wildcard each, object names it cannot know before the deploy.",
                    *(f"AwsSolutions-IAM5[Resource::{rendered(self, bucket.arn_for_objects(prefix))}]"
                      for prefix in (f"{RUNS_PREFIX}/*", f"{SERVE_PREFIX}/{name}/*")))
        # The function returns serveConfigV2 escaped for a JSON string: the manifest is JSON, and
        # CloudFormation joins the value in as it is (JSON is YAML, which KubeRay reads).
        objects = service_objects(spec, name, self.runs.resource.get_att_string("ServeConfigJsonEscaped"))
        refused = operator_problems(objects[-1])
        if refused:
            raise ValueError("RayServing: " + "; ".join(refused))
        #: The service's manifests (its NetworkPolicies first, then the RayService).
        self.manifests: list[eks.KubernetesManifest] = []
        for index, obj in enumerate(objects):
            manifest = eks.KubernetesManifest(self, f"{obj['kind']}{index}", cluster=cluster, manifest=[obj], prune=False)
            for dependency in [*depends_on, self.runs, *self.manifests]:
                manifest.node.add_dependency(dependency)
            self.manifests.append(manifest)
        #: The model ids a client asks for (comma-separated, known at deploy).
        self.models = self.runs.resource.get_att_string("Models")


def _staging_access(bucket: s3.IBucket, name: str) -> list[iam.PolicyStatement]:
    """Read the runs; write and delete the service's staging folder only."""
    staging = f"{SERVE_PREFIX}/{name}/*"
    statements = [
        iam.PolicyStatement(actions=["s3:GetObject"], resources=[bucket.arn_for_objects(f"{RUNS_PREFIX}/*")]),
        iam.PolicyStatement(actions=["s3:GetObject", "s3:PutObject", "s3:DeleteObject"], resources=[bucket.arn_for_objects(staging)]),
        iam.PolicyStatement(actions=["s3:ListBucket"], resources=[bucket.bucket_arn],
                            conditions={"StringLike": {"s3:prefix": [f"{RUNS_PREFIX}/*", staging]}}),
    ]
    if bucket.encryption_key is not None:
        statements.append(iam.PolicyStatement(actions=["kms:Decrypt", "kms:GenerateDataKey"],
                                              resources=[bucket.encryption_key.key_arn]))
    return statements
