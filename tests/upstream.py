"""Upstream release data the tests validate against (CRDs, charts' values, chart packages,
Karpenter's IAM reference), found at test time: this repository commits no upstream file.

Looked up in this order, each a folder laid out like the steering repository's
``shared/k8s/`` (``crds/<name>-<version>/``, ``charts/<chart>-<version>/``,
``reference/<name>-<version>/``, and ``packages/<chart>-<version>.tgz`` for chart packages):

1. ``$RAY_TRAIN_EKS_UPSTREAM``, a folder you name;
2. ``.cache/upstream/``, which ``make upstream`` fills from the real chart repositories,
   every package checked against the sha256 pinned in ``ray_train_eks/helm_charts.py``;
3. ``../shared/k8s/`` beside the repository (always there in CI).

A test whose file none of them has is skipped with a reason that says ``make upstream``. Under
CI (``CI=true``) a file of the kinds ``shared/k8s/`` holds (CRDs, charts' ``Chart.yaml`` and
``values.yaml``, references) must be found: its absence fails the test, so coverage cannot drop
without a word. Chart packages are only ever in the first two places, so their tests may skip.
"""

from __future__ import annotations

import copy
import functools
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV_VAR = "RAY_TRAIN_EKS_UPSTREAM"
CACHE = ROOT / ".cache" / "upstream"
SHARED = ROOT.parent / "shared" / "k8s"
#: The kinds of file shared/k8s/ holds (first path component).
SHARED_KINDS = ("crds", "charts", "reference")

KUBERAY_CRDS = "crds/kuberay-v1.7.0"
KARPENTER_CRDS = "crds/karpenter-1.14.1"
KUEUE_CRDS = "crds/kueue-v0.19.2"
KARPENTER_REFERENCE = "reference/karpenter-1.14.1/cloudformation.yaml"
#: Chart folder of each pinned chart (shared/k8s names KubeRay's with a v, as its git tag).
CHART_FOLDERS = {
    "kuberay-operator": "charts/kuberay-operator-v1.7.0",
    "nvidia-device-plugin": "charts/nvidia-device-plugin-0.20.0",
    "aws-efa-k8s-device-plugin": "charts/aws-efa-k8s-device-plugin-v0.5.30",
    "karpenter": "charts/karpenter-1.14.1",
    "amazon-cloudwatch-observability": "charts/amazon-cloudwatch-observability-6.4.0",
    "kueue": "charts/kueue-0.19.2",
}


def search_path() -> list[Path]:
    """The folders looked in, in order."""
    folders = [Path(os.environ[ENV_VAR])] if os.environ.get(ENV_VAR) else []
    return [*folders, CACHE, SHARED]


def find(relative: str) -> Path | None:
    """The first ``relative`` path that exists in the search path, or None."""
    for folder in search_path():
        if (folder / relative).exists():
            return folder / relative
    return None


def _missing(relative: str):
    where = ", ".join(str(folder) for folder in search_path())
    message = (f"upstream file {relative} not found in {where}: run `make upstream` (downloads the pinned charts into "
               f".cache/upstream/), or set {ENV_VAR} to a folder laid out like shared/k8s/")
    if os.environ.get("CI") == "true" and relative.split("/")[0] in SHARED_KINDS:
        pytest.fail(f"CI must have every file shared/k8s/ holds; {message}", pytrace=False)
    pytest.skip(message)


def upstream_file(relative: str) -> Path:
    """The upstream file ``relative`` (e.g. ``crds/kuberay-v1.7.0/ray.io_rayjobs.yaml``); skips
    the calling test when it is nowhere (fails it under CI, for what shared/k8s/ holds)."""
    path = find(relative)
    if path is None:
        _missing(relative)
    return path


def chart_values(chart: str) -> dict:
    """The default ``values.yaml`` of a pinned chart."""
    return load_yaml(upstream_file(f"{CHART_FOLDERS[chart]}/values.yaml"))


def chart_package(pin) -> Path:
    """The pinned package of ``pin`` (a ray_train_eks.helm_charts.PinnedChart), verified against
    its pinned sha256 where one is recorded; skips where no folder has it."""
    from ray_train_eks.helm_charts import sha256_of

    path = upstream_file(f"packages/{pin.package}")
    if pin.sha256 is not None and sha256_of(path) != pin.sha256:
        pytest.fail(f"{path} is not the pinned {pin.chart} {pin.version} (sha256 {pin.sha256}); run `make upstream`")
    return path


@functools.cache
def _load(path: Path):
    import yaml

    return yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def load_yaml(path: Path):
    """A YAML file, parsed once per session (a copy: callers may change it)."""
    return copy.deepcopy(_load(Path(path)))
