#!/usr/bin/env python3
"""Refresh the upstream files the tests validate against (tests/fixtures/upstream/).

Each file comes from the packaged Helm chart of a pinned version, found through the chart
repository's index.yaml, so what is tested is what Helm installs:

    python scripts/refresh_upstream.py                  # download (needs the chart repositories)
    python scripts/refresh_upstream.py --from DIR       # copy from a folder laid out like DIR/crds/<name>-<version>/, DIR/charts/<chart>-<version>/

Bump a version in UPSTREAM (and in ray_train_eks/constructs/addons.py), run this, and
review the diff. tests/fixtures/upstream/README.md lists every file with its source.
"""

from __future__ import annotations

import argparse
import io
import shutil
import sys
import tarfile
import urllib.request
from pathlib import Path

import yaml

DEST = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "upstream"

#: (folder under DEST, Helm repository, chart, version, {path in the chart: file name in the folder}, folder in --from)
UPSTREAM = [
    ("kuberay-v1.7.0", "https://ray-project.github.io/kuberay-helm/", "kuberay-operator", "1.7.0",
     {"crds/ray.io_rayjobs.yaml": "ray.io_rayjobs.yaml", "crds/ray.io_rayclusters.yaml": "ray.io_rayclusters.yaml",
      "values.yaml": "kuberay-operator-values.yaml"},
     {"crds/kuberay-v1.7.0/ray.io_rayjobs.yaml": "ray.io_rayjobs.yaml",
      "crds/kuberay-v1.7.0/ray.io_rayclusters.yaml": "ray.io_rayclusters.yaml",
      "charts/kuberay-operator-v1.7.0/values.yaml": "kuberay-operator-values.yaml"}),
    ("aws-efa-k8s-device-plugin-v0.5.30", "https://aws.github.io/eks-charts", "aws-efa-k8s-device-plugin", "v0.5.30",
     {"values.yaml": "values.yaml"},
     {"charts/aws-efa-k8s-device-plugin-v0.5.30/values.yaml": "values.yaml"}),
    ("nvidia-device-plugin-0.20.0", "https://nvidia.github.io/k8s-device-plugin", "nvidia-device-plugin", "0.20.0",
     {"values.yaml": "values.yaml"},
     {"charts/nvidia-device-plugin-0.20.0/values.yaml": "values.yaml"}),
    ("amazon-cloudwatch-observability-6.4.0", "https://aws-observability.github.io/helm-charts",
     "amazon-cloudwatch-observability", "6.4.0",
     {"values.yaml": "values.yaml"},
     {"charts/amazon-cloudwatch-observability-6.4.0/values.yaml": "values.yaml"}),
]


#: Karpenter's chart is an OCI artifact (no index.yaml): its files come from the release tag
#: on GitHub, where the chart's crds/ are links to pkg/apis/crds/.
#: (destination under the repository root, URL, path in --from)
KARPENTER = "https://raw.githubusercontent.com/aws/karpenter-provider-aws/v1.14.1/"
FILES = [
    ("tests/fixtures/upstream/karpenter-1.14.1/karpenter.k8s.aws_ec2nodeclasses.yaml",
     KARPENTER + "pkg/apis/crds/karpenter.k8s.aws_ec2nodeclasses.yaml", "crds/karpenter-1.14.1/karpenter.k8s.aws_ec2nodeclasses.yaml"),
    ("tests/fixtures/upstream/karpenter-1.14.1/karpenter.sh_nodepools.yaml",
     KARPENTER + "pkg/apis/crds/karpenter.sh_nodepools.yaml", "crds/karpenter-1.14.1/karpenter.sh_nodepools.yaml"),
    ("tests/fixtures/upstream/karpenter-1.14.1/karpenter-values.yaml",
     KARPENTER + "charts/karpenter/values.yaml", "charts/karpenter-1.14.1/values.yaml"),
    # Package data, not a fixture: KarpenterGpuCapacity reads the controller's policies from it.
    ("ray_train_eks/constructs/karpenter-1.14.1-cloudformation.yaml",
     KARPENTER + "website/content/en/v1.14/getting-started/getting-started-with-karpenter/cloudformation.yaml",
     "reference/karpenter-1.14.1/cloudformation.yaml"),
]


def _chart_archive(repository: str, chart: str, version: str) -> tarfile.TarFile:
    with urllib.request.urlopen(repository.rstrip("/") + "/index.yaml", timeout=60) as response:
        index = yaml.safe_load(response.read())
    (entry,) = [e for e in index["entries"][chart] if str(e["version"]) == version]
    url = entry["urls"][0]
    if "://" not in url:
        url = repository.rstrip("/") + "/" + url
    with urllib.request.urlopen(url, timeout=120) as response:
        return tarfile.open(fileobj=io.BytesIO(response.read()), mode="r:gz")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="source", type=Path, help="copy from this folder instead of downloading")
    args = parser.parse_args()
    for folder, repository, chart, version, in_chart, in_folder in UPSTREAM:
        target = DEST / folder
        target.mkdir(parents=True, exist_ok=True)
        if args.source:
            for relative, name in in_folder.items():
                shutil.copyfile(args.source / relative, target / name)
                print(f"{target / name} <- {args.source / relative}")
            continue
        archive = _chart_archive(repository, chart, version)
        for relative, name in in_chart.items():
            member = archive.extractfile(f"{chart}/{relative}")
            (target / name).write_bytes(member.read())
            print(f"{target / name} <- {chart} {version} ({repository}) {relative}")
    root = DEST.parents[2]
    for destination, url, relative in FILES:
        if args.source:
            shutil.copyfile(args.source / relative, root / destination)
            print(f"{destination} <- {args.source / relative}")
            continue
        with urllib.request.urlopen(url, timeout=60) as response:
            (root / destination).write_bytes(response.read())
        print(f"{destination} <- {url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
