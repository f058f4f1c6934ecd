"""Trainers on the cluster: IAM roles that run ``ray-train-eks`` (submit, list, status, logs, stop)
and nothing else. Each role gets an EKS access entry that maps it to a Kubernetes group, and a Role
in the Ray namespace grants that group exactly the command's verbs (workload/trainer_access.py)."""

from __future__ import annotations

from typing import Sequence

import cdk8s
from aws_cdk import aws_eks as eks_l1, aws_eks_v2 as eks
from constructs import Construct

from ray_train_eks.charts import ObjectChart, RayWorkloadSpec
from ray_train_eks.workload.trainer_access import TRAINERS_GROUP, trainer_role_objects


class TrainerAccess(Construct):
    """Access entries for ``role_arns`` in ``group`` and the Role it is bound to in ``spec.namespace``.

    :param cluster: the cluster.
    :param spec: the Ray workload's spec (its namespace).
    :param role_arns: IAM role (or user) ARNs of the trainers.
    :param group: the Kubernetes group. Default - ``ray-train-eks:trainers``.
    :param depends_on: what must exist first (the namespace's manifest).
    """

    def __init__(self, scope: Construct, id: str, *, cluster: eks.ICluster, spec: RayWorkloadSpec, role_arns: Sequence[str],
                 group: str = TRAINERS_GROUP, depends_on: Sequence[Construct] = ()) -> None:
        super().__init__(scope, id)
        app = cdk8s.App()
        #: The Role and its RoleBinding, applied as one manifest.
        self.manifest = cluster.add_cdk8s_chart(
            "TrainerRole", ObjectChart(app, "TrainerRole", objects=trainer_role_objects(spec, group=group)), prune=False)
        for dependency in depends_on:
            self.manifest.node.add_dependency(dependency)
        #: One access entry per trainer (STANDARD, no access policy: the Role is what they may do).
        self.access_entries = [
            eks_l1.CfnAccessEntry(self, f"Trainer{index}", cluster_name=cluster.cluster_name, principal_arn=arn,
                                  kubernetes_groups=[group], type="STANDARD")
            for index, arn in enumerate(role_arns)
        ]
