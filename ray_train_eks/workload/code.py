"""The ConfigMaps the Ray pods read: the training code, split into as many ConfigMaps as
``kubectl apply`` takes (their names, the code's digest, the size check), and the settings.
(The ConfigMaps themselves are cdk8s-plus: ray_workload_chart.py ``TrainingCodeChart``.)"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Mapping

from ray_train_eks.workload.spec import RayWorkloadSpec

#: Where the pods mount the code: /opt/ray-train-eks/<code_package>, on their PYTHONPATH.
CODE_MOUNT = "/opt/ray-train-eks"
#: ``kubectl apply`` (and ``create --save-config``, what CDK's kubectl handler runs) keeps the
#: whole object in the ``kubectl.kubernetes.io/last-applied-configuration`` annotation, and
#: all annotations of an object together are capped at 256 KiB by the API server.
MAX_APPLIED_OBJECT_BYTES = 256 * 1024 - 1024  # a KiB for the other annotations
CODE_DIGEST_ANNOTATION = "ray-train-eks/code-sha256"
#: ConfigMap with per-deployment settings (the bucket name), created by the stack.
SETTINGS_CONFIGMAP = "ray-train-eks-settings"
#: The deployed training code's ConfigMap (and its parts' prefix). Named ``ray-train-eks-training-code`` before
#: round 9, when its manifest moved to a nested stack of its own: a new name, so that the old manifest's
#: delete in the update's clean-up (``kubectl delete``, by name) cannot take the new code with it.
TRAINING_CODE_CONFIGMAP = "ray-train-eks-code"
#: The most one training-code ConfigMap holds (its data as JSON): the code is split into as many
#: as it takes, each well under :data:`MAX_APPLIED_OBJECT_BYTES`, and projected into one folder.
CODE_PART_BYTES = 160 * 1024


def package_files(directory) -> dict[str, str]:
    """A training package's ``.py`` files (path in the package -> content), its subpackages' too (a
    folder with an ``__init__.py``, as the wheel ships them); nothing else (caches, notes, data):
    what the code ConfigMaps hold and the RayJob's name hash covers."""
    from pathlib import Path

    root = Path(directory)

    def in_package(path: Path) -> bool:
        folder = path.parent
        while folder != root:
            if not (folder / "__init__.py").is_file():
                return False
            folder = folder.parent
        return True

    return {path.relative_to(root).as_posix(): path.read_text() for path in sorted(root.rglob("*.py"))
            if path.is_file() and in_package(path)}


def code_key(path: str) -> str:
    """The ConfigMap key of the package's file at ``path`` (``data/records.py`` ->
    ``data.records.py``): a key may hold no ``/`` (``[-._a-zA-Z0-9]+``), so the pods' projection
    gives each key its path back (:func:`code_items`)."""
    return path.replace("/", ".")


def code_items(part: Mapping[str, str]) -> list[dict[str, str]]:
    """The projection ``items`` of one code ConfigMap: each key to its file's path in the package."""
    return [{"key": code_key(path), "path": path} for path in sorted(part)]


def config_map_data(part: Mapping[str, str]) -> dict[str, str]:
    """One part of the code (path -> content) as ConfigMap data (key -> content)."""
    return {code_key(path): content for path, content in sorted(part.items())}


def code_parts(files: Mapping[str, str]) -> list[dict[str, str]]:
    """The training code (path in the package -> content) in ConfigMaps' worth: files in path
    order, a new part when the next file would take one past :data:`CODE_PART_BYTES`; one part
    at least."""
    parts: list[dict[str, str]] = [{}]
    size = 0
    for name in sorted(files):
        added = len(json.dumps({code_key(name): files[name]}).encode())
        if parts[-1] and size + added > CODE_PART_BYTES:
            parts.append({})
            size = 0
        parts[-1][name] = files[name]
        size += added
    return parts


def code_config_map_name(index: int, base: str | None = None) -> str:
    """The name of the training code's ``index``-th ConfigMap (the first keeps the old name), of the
    deployed code (``base`` None) or of a copy named ``base``."""
    base = base or TRAINING_CODE_CONFIGMAP
    return base if index == 0 else f"{base}-{index + 1}"


def code_volume(files: Mapping[str, str], base: str | None = None) -> dict:
    """The pods' ``training-code`` volume: every part of the code (:func:`code_parts`) projected into one
    folder, each file at its path in the package, from the deployed code's ConfigMaps (``base`` None)
    or a copy's named ``base``."""
    return {"name": "training-code", "projected": {"sources": [
        {"configMap": {"name": code_config_map_name(index, base), "items": code_items(part)}}
        for index, part in enumerate(code_parts(files))]}}


def code_config_maps(files: Mapping[str, str], *, namespace: str, base: str | None = None,
                     labels: Mapping[str, str] | None = None) -> list[dict]:
    """The code's ConfigMaps as plain objects (what ray_workload_chart.py ``TrainingCodeChart``
    builds with cdk8s for the stack), for a job that carries a copy of its own."""
    from ray_train_eks.workload.spec import PART_OF

    return [{"apiVersion": "v1", "kind": "ConfigMap",
             "metadata": {"name": code_config_map_name(index, base), "namespace": namespace,
                          "labels": {**PART_OF, **(labels or {})},
                          "annotations": {CODE_DIGEST_ANNOTATION: files_digest(files)}},
             "data": config_map_data(part)}
            for index, part in enumerate(code_parts(files))]


def files_digest(files: Mapping[str, str]) -> str:
    """Short hash of file name -> content."""
    return hashlib.sha256(json.dumps(sorted(files.items())).encode()).hexdigest()[:16]


def applied_size_problem(obj: Mapping[str, Any], *, fix: str) -> str | None:
    """A problem when ``obj`` is too large to ``kubectl apply`` (see MAX_APPLIED_OBJECT_BYTES)."""
    size = len(json.dumps(obj, separators=(",", ":")).encode())
    if size <= MAX_APPLIED_OBJECT_BYTES:
        return None
    kind, name = obj.get("kind"), obj.get("metadata", {}).get("name")
    return (f"{kind} {name} is {size / 1024:.0f} KiB; kubectl apply keeps the whole object in the "
            f"kubectl.kubernetes.io/last-applied-configuration annotation, and an object's annotations are capped at "
            f"256 KiB: {fix}")


def code_problems(spec: RayWorkloadSpec) -> list[str]:
    """The code's package name must be importable (the pods mount it as that folder)."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", spec.code_package):
        return [f"code_package={spec.code_package!r}: must be an importable Python package name, e.g. my_trainer"]
    return []
