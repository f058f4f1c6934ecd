"""Cluster add-ons installed through pinned Helm charts."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

from aws_cdk import Duration, aws_eks_v2 as eks
from constructs import Construct

from ray_train_eks.constructs.chart_packages import chart_source
from ray_train_eks.helm_charts import EFA_DEVICE_PLUGIN, KUBERAY_OPERATOR, NVIDIA_DEVICE_PLUGIN
from ray_train_eks.regions import EKS_REGISTRY_ACCOUNTS, eks_registry
from ray_train_eks.scheduling import GPU_TOLERATION

#: Helm's own timeout: the kubectl handler is a Lambda that dies at 15 minutes, and a Helm
#: install it abandons stays ``pending-upgrade``. 10 minutes leaves room for the rest.
HELM_TIMEOUT = Duration.minutes(10)

#: A chart_packages prop: a folder of pinned chart packages (``make upstream``'s cache), whose
#: verified package of the chart is installed as a CDK asset; None or no such package: the
#: chart's repository (ray_train_eks/constructs/chart_packages.py chart_source).


class NvidiaDevicePlugin(Construct):
    """NVIDIA device plugin 0.20.0: advertises ``nvidia.com/gpu`` on the GPU nodes.

    The AL2023 NVIDIA AMI has drivers but no plugin. The chart refuses the ``default``
    namespace, so it gets its own. Its default affinity selects ``nvidia.com/gpu.present=true``,
    which the EFA node group sets. ``mofedEnabled: false``: EFA nodes have no Mellanox OFED
    stack for the plugin to wait for (the EKS EFA guide's setting).

    :param namespace: Default - nvidia-device-plugin.
    :param tolerations: Default - the ``nvidia.com/gpu`` taint (EfaNodeGroup's) and CriticalAddonsOnly.
    :param chart_packages: a folder of pinned chart packages. Default - the chart's repository.
    """

    def __init__(self, scope: Construct, id: str, *, cluster: eks.ICluster, namespace: str = "nvidia-device-plugin",
                 tolerations: Sequence[Mapping[str, str]] = (GPU_TOLERATION, {"key": "CriticalAddonsOnly", "operator": "Exists"}),
                 chart_packages: Path | None = None) -> None:
        super().__init__(scope, id)
        self.chart = eks.HelmChart(
            self,
            "Resource",
            cluster=cluster,
            **chart_source(self, "Package", NVIDIA_DEVICE_PLUGIN, chart_packages),
            release="nvidia-device-plugin",
            namespace=namespace,
            create_namespace=True,
            timeout=HELM_TIMEOUT,
            wait=True,
            values={"tolerations": [dict(t) for t in tolerations], "mofedEnabled": False},
        )


class EfaDevicePlugin(Construct):
    """AWS EFA device plugin v0.5.30: advertises ``vpc.amazonaws.com/efa`` on the GPU nodes.

    Its image lives in the EKS ECR registry of the stack's region; it tolerates the GPU
    taint (the chart tolerates nothing by default); and its instance-type allowlist is set
    to exactly ``instance_types``, so a type missing from the chart's list cannot leave the
    DaemonSet at zero pods while NCCL silently falls back to TCP.

    :param region: the stack's region (concrete, for the registry).
    :param instance_types: the GPU node types to run on.
    :param tolerations: Default - the ``nvidia.com/gpu`` taint (EfaNodeGroup's).
    :param chart_packages: a folder of pinned chart packages. Default - the chart's repository.
    """

    def __init__(self, scope: Construct, id: str, *, cluster: eks.ICluster, region: str, instance_types: list[str],
                 tolerations: Sequence[Mapping[str, str]] = (GPU_TOLERATION,), chart_packages: Path | None = None) -> None:
        super().__init__(scope, id)
        if region not in EKS_REGISTRY_ACCOUNTS:
            raise ValueError(f"EfaDevicePlugin: no EKS image registry known for region {region!r}")
        self.chart = eks.HelmChart(
            self,
            "Resource",
            cluster=cluster,
            **chart_source(self, "Package", EFA_DEVICE_PLUGIN, chart_packages),
            release="aws-efa-k8s-device-plugin",
            namespace="kube-system",
            timeout=HELM_TIMEOUT,
            wait=True,
            values={
                "image": {"repository": f"{eks_registry(region)}/eks/aws-efa-k8s-device-plugin"},
                "tolerations": [dict(t) for t in tolerations],
                "supportedInstanceLabels": {
                    "keys": ["node.kubernetes.io/instance-type"],
                    "values": sorted(instance_types),
                },
            },
        )


class KubeRayOperator(Construct):
    """KubeRay operator 1.7.0, with its CRDs (the RayJob CRD is 1.4 MB: too large for a CDK
    manifest, so Helm installs it).

    :param namespace: Default - kuberay.
    :param node_selector: where the operator pod may run. Default - anywhere (no selector):
        a label the cluster lacks would leave it Pending until Helm's wait fails the deploy.
    :param chart_packages: a folder of pinned chart packages. Default - the chart's repository.
    """

    def __init__(self, scope: Construct, id: str, *, cluster: eks.ICluster, namespace: str = "kuberay",
                 node_selector: Mapping[str, str] | None = None, chart_packages: Path | None = None) -> None:
        super().__init__(scope, id)
        self.namespace = namespace
        self.chart = eks.HelmChart(
            self,
            "Resource",
            cluster=cluster,
            **chart_source(self, "Package", KUBERAY_OPERATOR, chart_packages),
            release="kuberay-operator",
            namespace=namespace,
            create_namespace=True,
            timeout=HELM_TIMEOUT,
            wait=True,
            values={"nodeSelector": dict(node_selector)} if node_selector else {},
        )
