"""Validate custom objects as the API server would: structural defaulting from the CRD's
v1 schema, then strict validation (unknown fields rejected, where the API server would
silently prune them). Shared by the KubeRay and Karpenter tests."""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import jsonschema
import yaml

from upstream import KUBERAY_CRDS, KUEUE_CRDS, upstream_file


def strict(schema: dict) -> dict:
    """Reject unknown fields wherever the CRD lists the fields (as the API server's
    structural pruning would silently drop them, we want to fail instead)."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if "properties" in node and "additionalProperties" not in node and not node.get("x-kubernetes-preserve-unknown-fields"):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


def apply_defaults(schema: dict, value):
    """Structural defaulting as the API server does it: a missing field with a default
    gets it, recursively, inside objects that are present."""
    if isinstance(value, dict) and "properties" in schema:
        for name, sub in schema["properties"].items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = apply_defaults(sub, value[name])
    elif isinstance(value, list) and "items" in schema:
        return [apply_defaults(schema["items"], item) for item in value]
    return value


def kuberay_schemas() -> dict[str, tuple[dict, jsonschema.protocols.Validator]]:
    """The RayJob, RayCluster and RayService schemas of KubeRay v1.7.0, parsed once per test session
    (the RayJob CRD alone is 1.4 MB of YAML); skips the test where the CRDs are nowhere (upstream.py)."""
    return _load_schemas(upstream_file(f"{KUBERAY_CRDS}/ray.io_rayjobs.yaml"),
                         upstream_file(f"{KUBERAY_CRDS}/ray.io_rayclusters.yaml"),
                         upstream_file(f"{KUBERAY_CRDS}/ray.io_rayservices.yaml"))


@functools.cache
def _load_schemas(rayjobs: Path, rayclusters: Path, rayservices: Path):
    return load_schemas({"RayJob": rayjobs, "RayCluster": rayclusters, "RayService": rayservices})


def kueue_schemas() -> dict[str, tuple[dict, jsonschema.protocols.Validator]]:
    """Kueue v0.19.2's ClusterQueue, LocalQueue and ResourceFlavor schemas (v1beta2, its storage
    version); skips the test where the CRDs are nowhere (upstream.py)."""
    return _load_kueue(*(upstream_file(f"{KUEUE_CRDS}/kueue.x-k8s.io_{name}.yaml")
                         for name in ("clusterqueues", "localqueues", "resourceflavors")))


@functools.cache
def _load_kueue(clusterqueues: Path, localqueues: Path, resourceflavors: Path):
    return load_schemas({"ClusterQueue": clusterqueues, "LocalQueue": localqueues, "ResourceFlavor": resourceflavors},
                        version="v1beta2")


def load_schemas(crd_files: dict[str, Path], version: str = "v1") -> dict[str, tuple[dict, jsonschema.protocols.Validator]]:
    """Per kind: the ``version`` schema (for defaults) and a strict validator built once."""
    schemas = {}
    for kind, file in crd_files.items():
        crd = yaml.load(file.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
        schema = v1["schema"]["openAPIV3Schema"]
        schemas[kind] = (schema, jsonschema.Draft7Validator(strict(schema)))
    return schemas


#: Kubernetes' own objects (NetworkPolicy, ConfigMap, Namespace) are checked against its
#: OpenAPI schemas of this version, strict (kubernetes-validate ships them).
KUBERNETES_VERSION = "1.36.0"


def validate_builtin(obj: dict) -> None:
    """Validate a Kubernetes built-in object strictly; raises jsonschema.ValidationError if invalid."""
    import kubernetes_validate

    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as error:  # a jsonschema error in its own class
        raise jsonschema.ValidationError(f"{obj['kind']} {obj['metadata'].get('name')}: {error.message} at "
                                         f"{'/'.join(str(p) for p in error.path)}") from error


def validate(obj: dict, schemas) -> dict:
    """``obj`` after API-server defaulting; raises jsonschema.ValidationError if invalid. A kind
    without a CRD here is a Kubernetes built-in: validated by :func:`validate_builtin`."""
    if obj["kind"] not in schemas:
        validate_builtin(obj)
        return copy.deepcopy(obj)
    schema, validator = schemas[obj["kind"]]
    defaulted = apply_defaults(schema, copy.deepcopy(obj))
    validator.validate(defaulted)
    return defaulted
