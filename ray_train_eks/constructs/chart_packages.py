"""A pinned Helm chart as ``eks.HelmChart`` takes it: its verified package as a CDK asset, or its
repository (ray_train_eks/helm_charts.py holds the pins and the verification, without the CDK)."""

from __future__ import annotations

from pathlib import Path

from aws_cdk import aws_s3_assets as s3_assets
from constructs import Construct

from ray_train_eks.helm_charts import PinnedChart, unpacked_chart, verified_package


def chart_source(scope: Construct, id: str, pin: PinnedChart, packages_dir: Path | None) -> dict:
    """``eks.HelmChart`` props for ``pin``: its verified package in ``packages_dir`` as an asset
    (``chart_asset`` alone: CDK refuses a version or repository beside it), or else its
    repository.

    The kubectl handler (aws-cdk-lib 2.275, ``custom-resource-handlers/dist/aws-eks-v2/
    kubectl-handler/helm/__init__.py``, ``get_chart_asset_from_url``) copies the asset's zip from
    S3, unzips it into a folder and hands that folder to ``helm upgrade --install``: so the asset
    is the chart's folder (``Chart.yaml`` at its root), which CDK zips."""
    package = verified_package(pin, packages_dir)
    if package is None:
        return pin.repository_props()
    asset = s3_assets.Asset(scope, id, path=str(unpacked_chart(package)))
    return {"chart_asset": asset}
