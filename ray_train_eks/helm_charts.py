"""The Helm charts the platform installs, pinned, and where a deploy takes each from.

Every chart is pinned by version; where its repository records the package's sha256 (the
``digest`` of its entry in the repository's ``index.yaml``) the pin holds it too. ``make
upstream`` (``scripts/fetch_upstream.py``) downloads the pinned packages into
``.cache/upstream/packages/`` and keeps only those whose sha256 is the pinned one.

A deploy installs a chart either

- from its **package** (``eks.HelmChart(chart_asset=...)``): the unpacked chart becomes a CDK
  asset, so the kubectl handler fetches nothing from a chart repository and what deploys is the
  very package the tests rendered; or
- from its **repository** (``chart``, ``version``, ``repository``), which the kubectl handler
  reaches through the NAT gateway at deploy time.

:func:`verified_package` finds the package in a folder when it holds it with the pinned sha256;
ray_train_eks/constructs/chart_packages.py ``chart_source`` takes it as an asset, else the repository.
No CDK here (the configuration and the ray-train-eks command import this module).
"""

from __future__ import annotations

import hashlib
import shutil
import tarfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PinnedChart:
    """One Helm chart at one version.

    :param sha256: the package's sha256 as its repository records it; None where none is
        published (an OCI chart's tag, or an index that could not be read): such a package is
        never shipped as an asset, since nothing here could vouch for it.
    :param digest_source: where ``sha256`` was read.
    """

    chart: str
    version: str
    repository: str
    sha256: str | None = None
    digest_source: str = ""

    @property
    def package(self) -> str:
        """The package's file name, as ``helm pull`` writes it."""
        return f"{self.chart}-{self.version}.tgz"

    @property
    def is_oci(self) -> bool:
        return self.repository.startswith("oci://")

    def repository_props(self) -> dict[str, str]:
        """``eks.HelmChart`` props that install from the repository."""
        return {"chart": self.chart, "version": self.version, "repository": self.repository}


NVIDIA_DEVICE_PLUGIN = PinnedChart(
    "nvidia-device-plugin", "0.20.0", "https://nvidia.github.io/k8s-device-plugin",
    sha256="9e5642bcdd3805c6e931f9d3ca542677d1f714d68c14c1364892011e67d9a606",
    digest_source="NVIDIA/k8s-device-plugin gh-pages index.yaml (bf584288ed8c31d6b63b1ec5bdc9c8ef8f0ded7c)",
)
EFA_DEVICE_PLUGIN = PinnedChart(
    "aws-efa-k8s-device-plugin", "v0.5.30", "https://aws.github.io/eks-charts",
    sha256="43b3d666f81a40b7f7ac88ee04a64954abaaa061b1e5f54dc7ce4beb3374e32a",
    digest_source="aws/eks-charts gh-pages index.yaml (c7f9ea56017831aa11ea7e81112f8cd6cc0fd2db)",
)
#: ray-project/kuberay-helm's index.yaml lists the 1.7.0 package; no copy of that index could be
#: read when this was pinned, so its digest is not recorded yet (``make upstream`` prints it).
KUBERAY_OPERATOR = PinnedChart("kuberay-operator", "1.7.0", "https://ray-project.github.io/kuberay-helm/")
#: OCI charts: the registry addresses the package by the digest in the tag's manifest, which
#: aws/karpenter-provider-aws computes at release (hack/release/common.sh, ``crane digest``) but
#: does not publish in the repository.
KARPENTER = PinnedChart("karpenter", "1.14.1", "oci://public.ecr.aws/karpenter/karpenter")
KARPENTER_CRD = PinnedChart("karpenter-crd", "1.14.1", "oci://public.ecr.aws/karpenter/karpenter-crd")
#: Not installed by Helm here (EKS installs it as the amazon-cloudwatch-observability add-on),
#: pinned so that the tests can read the values of the chart the add-on version installs.
CLOUDWATCH_OBSERVABILITY = PinnedChart(
    "amazon-cloudwatch-observability", "6.4.0", "https://aws-observability.github.io/helm-charts",
    sha256="6e57b841b0b90c80a5cf4ae4d7c76c88db44ecfd61d8db062d2393ded1120e0a",
    digest_source="aws-observability/helm-charts gh-pages index.yaml (f513983731fe98815c2a78f787bde5e5efd2096b)",
)

#: Kueue (``-c queueing=kueue``): an OCI chart, its digest not published in the repository either
#: (kubernetes-sigs/kueue charts/kueue/README.md installs it by tag: ``--version 0.19.2``).
KUEUE = PinnedChart("kueue", "0.19.2", "oci://registry.k8s.io/kueue/charts/kueue")

#: Every chart a deploy can install with Helm.
INSTALLED_CHARTS = (NVIDIA_DEVICE_PLUGIN, EFA_DEVICE_PLUGIN, KUBERAY_OPERATOR, KARPENTER, KARPENTER_CRD, KUEUE)
#: Every pinned chart, the add-on's included.
PINNED_CHARTS = (*INSTALLED_CHARTS, CLOUDWATCH_OBSERVABILITY)

#: Where ``make upstream`` puts the packages, relative to the repository (and the app's working folder).
DEFAULT_PACKAGES_DIR = Path(".cache") / "upstream" / "packages"


def packages_dir(setting: str) -> Path | None:
    """The folder whose verified chart packages the deploy installs as assets (None: every chart
    from its repository), as the ``chartPackages`` setting names it: ``none``; ``auto``, the ``make
    upstream`` cache (:data:`DEFAULT_PACKAGES_DIR`, relative to the folder ``cdk`` runs in) when it
    is there; or a folder."""
    if setting == "none":
        return None
    if setting == "auto":
        return DEFAULT_PACKAGES_DIR if DEFAULT_PACKAGES_DIR.is_dir() else None
    return Path(setting)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verified_package(pin: PinnedChart, packages_dir: Path | None) -> Path | None:
    """``packages_dir``'s package of ``pin`` when its sha256 is the pinned one; None when the
    folder does not hold it, or ``pin`` has no recorded sha256.

    Raises ValueError for a package whose sha256 differs from the pin (a corrupt download, or
    another release under the same name): deploying it would deploy what no test rendered."""
    if packages_dir is None or pin.sha256 is None:
        return None
    path = Path(packages_dir) / pin.package
    if not path.is_file():
        return None
    actual = sha256_of(path)
    if actual != pin.sha256:
        raise ValueError(
            f"{path}: sha256 {actual} is not the pinned {pin.sha256} of {pin.chart} {pin.version} "
            f"({pin.digest_source}); delete it and run `make upstream` again"
        )
    return path


def unpacked_chart(package: Path) -> Path:
    """The chart folder of ``package``, unpacked once beside it (under ``.unpacked/<sha256>/``),
    as the kubectl handler needs it: a folder, which CDK zips into the asset the handler unzips."""
    digest = sha256_of(package)
    root = package.parent / ".unpacked" / digest[:16]
    with tarfile.open(package) as archive:
        (top,) = {Path(m.name).parts[0] for m in archive.getmembers()}
        if not (root / top / "Chart.yaml").is_file():
            partial = root.with_name(root.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            archive.extractall(partial, filter="data")
            shutil.rmtree(root, ignore_errors=True)
            partial.rename(root)
    return root / top
