"""cdk8s charts of the workload: the standard objects (namespace, training-code and
settings ConfigMaps) with cdk8s-plus, the Ray objects as checked plain dicts, and the
``dist/`` YAML written from the same charts."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Mapping

import cdk8s
import cdk8s_plus_36 as kplus
import yaml
from constructs import Construct

from ray_train_eks.workload.code import (CODE_DIGEST_ANNOTATION, SETTINGS_CONFIGMAP, TRAINING_CODE_CONFIGMAP, code_parts, config_map_data,
                                     files_digest, package_files)
from ray_train_eks.workload.spec import PART_OF, RayWorkloadSpec
from ray_train_eks.workload.objects import ray_objects


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


class TrainingCodeChart(cdk8s.Chart):
    """The training package as ConfigMaps, one key per ``.py`` file of ``directory`` and of its
    subpackages, split by size (``code_parts``: each ConfigMap must stay under ``kubectl apply``'s
    256 KiB; the pods project them all into one folder, each file at its path), each annotated
    with a hash of the whole code.

    :attr files: path in the package (``data/records.py``) -> content, what the RayJob's name hash covers.
    :attr config_maps: the ConfigMaps, the first named ``name``.
    """

    def __init__(self, scope: Construct, id: str, *, directory: Path, namespace: str,
                 name: str = TRAINING_CODE_CONFIGMAP) -> None:
        super().__init__(scope, id)
        # The package's .py files, its subpackages' too (a folder with an __init__.py, as the wheel
        # ships them); nothing else (caches, notes, data).
        self.files: dict[str, str] = package_files(directory)
        if not self.files:
            raise ValueError(f"training code: {directory} holds no .py files; pass the folder of your training package")
        digest = files_digest(self.files)
        self.config_maps = []
        for index, part in enumerate(code_parts(self.files)):
            config_map = kplus.ConfigMap(
                self, "Resource" if index == 0 else f"Part{index + 1}", data=config_map_data(part),
                metadata=cdk8s.ApiObjectMetadata(name=name if index == 0 else f"{name}-{index + 1}", namespace=namespace,
                                                 labels=dict(PART_OF)))
            config_map.metadata.add_annotation(CODE_DIGEST_ANNOTATION, digest)
            self.config_maps.append(config_map)
        self.config_map = self.config_maps[0]


class SettingsChart(cdk8s.Chart):
    """Per-deployment settings: the bucket name and the MLflow tracking URI (an App's ARN), only
    known at deploy, which the Ray pods read; and
    the workload's spec (``workload``, JSON: spec.py ``spec_settings``), from which
    ``ray-train-eks submit`` builds each new job with the deployed platform's settings."""

    def __init__(self, scope: Construct, id: str, *, namespace: str, bucket: str, workload: str | None = None,
                 tracking_uri: str | None = None, extra: Mapping[str, str] | None = None) -> None:
        super().__init__(scope, id)
        from ray_train_eks.tracking import TRACKING_URI_KEY

        kplus.ConfigMap(self, "Resource", metadata=cdk8s.ApiObjectMetadata(name=SETTINGS_CONFIGMAP, namespace=namespace),
                        data={"bucket": bucket, **({"workload": workload} if workload is not None else {}),
                              **({TRACKING_URI_KEY: tracking_uri} if tracking_uri else {}), **dict(extra or {})})


class NamespaceChart(cdk8s.Chart):
    """One namespace."""

    def __init__(self, scope: Construct, id: str, *, name: str) -> None:
        super().__init__(scope, id)
        kplus.Namespace(self, "Resource", metadata=cdk8s.ApiObjectMetadata(name=name))


def dist_header(spec: RayWorkloadSpec) -> str:
    """What the YAML assumes about the cluster it is applied to, said at its top: the deploy
    knows these from its own objects, a GitOps user applying the file must check them."""
    lines = [f"# Written by ray-train-eks for namespace {spec.namespace!r}, service account {spec.service_account!r}."]
    if spec.network_policies:
        labels = ",".join(f"{k}={v}" for k, v in spec.operator_pod_labels.items())
        lines += [
            "# Its NetworkPolicies let the KubeRay operator reach the Ray heads' dashboard port from namespace",
            f"# {spec.operator_namespace!r}, pods labelled {labels}: if your operator runs elsewhere or is labelled",
            "# otherwise, edit the *-dashboard policies, or RayJobs never leave Initializing.",
        ]
    return "\n".join(lines) + "\n"


def write_dist(spec: RayWorkloadSpec, code_directory: Path, outdir: Path) -> list[Path]:
    """Write both workloads' objects as YAML for kubectl and GitOps users: the same
    objects ``cdk deploy`` applies, plus the settings ConfigMap with a placeholder."""
    outdir.mkdir(parents=True, exist_ok=True)
    app = cdk8s.App(outdir=str(outdir))
    code = TrainingCodeChart(app, "TrainingCode", directory=code_directory, namespace=spec.namespace)
    spec = dataclasses.replace(spec, training_code=code.files)
    written = []
    for workload in ("job", "cluster"):
        variant = dataclasses.replace(spec, workload=workload, run_job=True, shutdown_after_job_finishes=workload == "job",
                                      ttl_seconds_after_finished=spec.ttl_seconds_after_finished if workload == "job" else 0,
                                      backoff_limit=spec.backoff_limit if workload == "job" else 0)
        path = outdir / f"ray-workload-{workload}.k8s.yaml"
        path.write_text(dist_header(spec) + yaml.safe_dump_all([*code.to_json(), *ray_objects(variant)], sort_keys=True))
        written.append(path)
    settings = SettingsChart(app, "Settings", namespace=spec.namespace, bucket="REPLACE-WITH-BucketName-OUTPUT")
    path = outdir / "settings.k8s.yaml"
    path.write_text("# Fill in the bucket from the stack output BucketName before `kubectl apply`.\n"
                    + yaml.safe_dump_all(settings.to_json(), sort_keys=True))
    written.append(path)
    return written
