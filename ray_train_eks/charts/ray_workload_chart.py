"""cdk8s charts holding the workload objects, and the ``dist/`` YAML written beside them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import cdk8s
import yaml
from constructs import Construct

from ray_train_eks.charts.ray_workload import SETTINGS_CONFIGMAP, RayWorkloadSpec, workload_objects


class ObjectChart(cdk8s.Chart):
    """A cdk8s chart of ready-made Kubernetes objects (plain dicts with camelCase keys,
    added whole through JSON patches: ``ApiObject`` takes only apiVersion, kind and
    metadata, and no key passes through jsii's name conversion)."""

    def __init__(self, scope: Construct, id: str, *, objects: list[dict]) -> None:
        super().__init__(scope, id)
        for index, body in enumerate(objects):
            metadata = body["metadata"]
            api_object = cdk8s.ApiObject(
                self,
                f"{body['kind']}{index}",
                api_version=body["apiVersion"],
                kind=body["kind"],
                metadata=cdk8s.ApiObjectMetadata(name=metadata["name"], namespace=metadata.get("namespace")),
            )
            for key in ("labels", "annotations"):
                if metadata.get(key):
                    api_object.add_json_patch(cdk8s.JsonPatch.add(f"/metadata/{key}", metadata[key]))
            for key, value in body.items():
                if key not in ("apiVersion", "kind", "metadata"):
                    api_object.add_json_patch(cdk8s.JsonPatch.add(f"/{key}", value))


def settings_configmap(*, namespace: str, bucket: str) -> dict:
    """Per-deployment settings the pods read (the bucket name is only known at deploy)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": SETTINGS_CONFIGMAP, "namespace": namespace},
        "data": {"bucket": bucket},
    }


def write_dist(spec: RayWorkloadSpec, outdir: Path) -> list[Path]:
    """Write both workloads' objects as YAML for kubectl and GitOps users: the same
    objects ``cdk deploy`` applies, plus the settings ConfigMap with a placeholder."""
    outdir.mkdir(parents=True, exist_ok=True)
    written = []
    for workload in ("job", "cluster"):
        variant = dataclasses.replace(spec, workload=workload, run_job=True, shutdown_after_job_finishes=workload == "job",
                                      ttl_seconds_after_finished=spec.ttl_seconds_after_finished if workload == "job" else 0)
        path = outdir / f"ray-workload-{workload}.k8s.yaml"
        path.write_text(yaml.safe_dump_all(workload_objects(variant), sort_keys=True))
        written.append(path)
    path = outdir / "settings.k8s.yaml"
    path.write_text(
        "# Fill in the bucket from the stack output BucketName before `kubectl apply`.\n"
        + yaml.safe_dump(settings_configmap(namespace=spec.namespace, bucket="REPLACE-WITH-BucketName-OUTPUT"), sort_keys=True)
    )
    written.append(path)
    return written
