"""Kueue on the cluster: its controller from the pinned chart, and the queue the Ray jobs wait in
(ray_train_eks/workload/queueing.py says how a RayJob is queued and admitted)."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

from aws_cdk import aws_eks_v2 as eks
from constructs import Construct

from ray_train_eks.workload.queueing import LOCAL_QUEUE, queue_objects
from ray_train_eks.workload.spec import RayWorkloadSpec
from ray_train_eks.workload.objects import ray_job
from ray_train_eks.constructs.addons import HELM_TIMEOUT
from ray_train_eks.constructs.chart_packages import chart_source
from ray_train_eks.helm_charts import KUEUE


class KueueQueueing(Construct):
    """Kueue 0.19.2 (its chart enables the ``ray.io/rayjob`` integration by default:
    ``managerConfig.controllerManagerConfigYaml``'s ``integrations.frameworks``), and the
    ResourceFlavor, ClusterQueue and LocalQueue for ``spec``'s jobs: the ClusterQueue's quota is
    one of its jobs' requests, so the GPU nodes take one job at a time and the others wait, oldest
    first.

    Kueue's webhooks refuse (``failurePolicy: Fail``) a RayJob while its controller is down, and its
    objects carry finalizers its controller removes: the Ray namespace must go before Kueue on
    destroy, as it goes before the KubeRay operator (the stack adds that dependency).

    :param spec: the Ray workload whose jobs queue (its namespace, its pods' requests); its
        ``queue_name`` names the LocalQueue. Default queue name - ``ray-train-eks``.
    :param namespace: Kueue's own namespace. Default - kueue-system.
    :param node_selector: where the controller may run. Default - anywhere.
    :param tolerations: the controller's tolerations. Default - none.
    :param chart_packages: a folder of pinned chart packages. Default - the chart's repository.
    """

    def __init__(self, scope: Construct, id: str, *, cluster: eks.ICluster, spec: RayWorkloadSpec, namespace: str = "kueue-system",
                 node_selector: Mapping[str, str] | None = None, tolerations: Sequence[Mapping[str, str]] = (),
                 chart_packages: Path | None = None) -> None:
        super().__init__(scope, id)
        self.namespace = namespace
        self.queue_name = spec.queue_name or LOCAL_QUEUE
        manager = {**({"nodeSelector": dict(node_selector)} if node_selector else {}),
                   **({"tolerations": [dict(t) for t in tolerations]} if tolerations else {})}
        self.chart = eks.HelmChart(
            self,
            "Resource",
            cluster=cluster,
            **chart_source(self, "Package", KUEUE, chart_packages),
            release="kueue",
            namespace=namespace,
            create_namespace=True,
            timeout=HELM_TIMEOUT,
            wait=True,  # the webhooks answer before a RayJob is created
            values={"controllerManager": manager} if manager else {},
        )
        self.objects = queue_objects(spec, ray_job(spec))
        self.queues = eks.KubernetesManifest(self, "Queues", cluster=cluster, manifest=self.objects)
        self.queues.node.add_dependency(self.chart)  # the CRDs first; on destroy, the queues before the controller
