"""Who can reach and run code on the Ray clusters: Ray's token authentication, and the
namespace's NetworkPolicies (all ingress denied, then each Ray cluster's own allows)."""

from __future__ import annotations

import re
from typing import Mapping

from ray_train_eks.workload.spec import PART_OF, RayWorkloadSpec

#: Ray's token authentication (RayCluster ``spec.authOptions.mode``, KubeRay v1.7.0): with
#: ``token`` the operator creates a Secret named after the RayCluster (key ``auth_token``, 32
#: random bytes, owned by the cluster, so deleted with it) and gives it to the head, the workers
#: and the submitter as ``RAY_AUTH_MODE=token`` and ``RAY_AUTH_TOKEN``; the operator's own
#: dashboard client reads it too (ray-operator/controllers/ray/common/pod.go
#: SetContainerTokenAuthEnvVars, utils/util.go). Ray then refuses every GCS, raylet and job-API
#: call without the token (ray/_private/authentication/).
AUTH_MODES = ("token", "disabled")
#: KubeRay rejects ``mode: token`` for an older Ray (utils/validation.go).
MIN_RAY_VERSION_FOR_TOKEN_AUTH = (2, 52, 0)
#: A label of every Ray pod we create, naming its Ray cluster (the standing RayCluster's name, or
#: the RayJob's for the cluster it brings): KubeRay's own ``ray.io/cluster`` of a RayJob's
#: cluster carries a random suffix, unknown when the NetworkPolicies are written.
CLUSTER_LABEL = "ray-train-eks/ray-cluster"
#: The labels KubeRay gives a RayJob's K8sJobMode submitter pod (rayjob_controller.go getSubmitterTemplate).
SUBMITTER_CRD_LABEL = "ray.io/originated-from-crd"
SUBMITTER_NAME_LABEL = "ray.io/originated-from-cr-name"
DASHBOARD_PORT = 8265
_DNS_1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def _version(text: str) -> tuple[int, ...]:
    """``2.58.0`` as (2, 58, 0); an unreadable version as (0,)."""
    parts = re.findall(r"\d+", text)[:3]
    return tuple(int(p) for p in parts) if parts else (0,)


def access_problems(spec: RayWorkloadSpec) -> list[str]:
    """The authentication mode Ray and KubeRay take, and the operator namespace the dashboard allows."""
    problems: list[str] = []
    if spec.auth_mode not in AUTH_MODES:
        problems.append(f"rayAuthMode={spec.auth_mode!r}: use token (Ray refuses callers without the cluster's token) or "
                        "disabled (anyone who reaches the head can run code on the cluster)")
    elif spec.auth_mode == "token" and _version(spec.ray_version) < MIN_RAY_VERSION_FOR_TOKEN_AUTH:
        problems.append(f"rayVersion={spec.ray_version!r} with rayAuthMode=token: Ray's token authentication needs Ray 2.52.0 "
                        "or later (KubeRay rejects the cluster otherwise); use an image with a newer Ray, or rayAuthMode=disabled")
    if not _DNS_1123_LABEL.match(spec.operator_namespace):
        problems.append(f"operator_namespace={spec.operator_namespace!r}: must be the namespace the KubeRay operator runs in "
                        "(a DNS-1123 label), e.g. kuberay")
    return problems


def _network_policy(spec: RayWorkloadSpec, name: str, pods: Mapping[str, str], ingress: list[dict]) -> dict:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": spec.namespace, "labels": dict(PART_OF)},
        "spec": {"podSelector": {"matchLabels": dict(pods)} if pods else {}, "policyTypes": ["Ingress"], "ingress": ingress},
    }


def deny_ingress_policy(spec: RayWorkloadSpec) -> dict:
    """No ingress to any pod of the namespace but what another policy allows. Egress stays open
    (DNS, S3, the Hub, the EKS API). Kubernetes always lets a pod's own node reach it (the
    NetworkPolicy API, v1.36: "OR if the traffic source is the pod's local node"): kubelet's probes."""
    return _network_policy(spec, "ray-train-eks-deny-ingress", {}, [])


def cluster_policies(spec: RayWorkloadSpec, cluster: str, *, submitter_of: str | None) -> list[dict]:
    """The allows of one Ray cluster (pods labelled ``cluster``): its pods to each other on every
    port (Ray's GCS 6379 and dashboard agent 52365 are fixed, its raylets, object managers and
    workers take random ports), and to the head's dashboard (8265: the job API) the KubeRay
    operator (job status, stop, HTTPMode submission) and K8sJobMode submitters: the one of the
    RayJob ``submitter_of``, or (None, a standing cluster) that of any RayJob of the namespace,
    since RayJobs select a standing cluster by name. The Ray Client port (10001) and Ray's
    metrics port (8080) get no allow: nothing here uses the one or scrapes the other."""
    pods = {CLUSTER_LABEL: cluster}
    submitters = {SUBMITTER_CRD_LABEL: "RayJob", "app.kubernetes.io/created-by": "kuberay-operator"}
    if submitter_of is not None:
        submitters[SUBMITTER_NAME_LABEL] = submitter_of
    dashboard_from = [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": spec.operator_namespace}},
         "podSelector": {"matchLabels": dict(spec.operator_pod_labels)}},
        {"podSelector": {"matchLabels": submitters}},
    ]
    return [
        _network_policy(spec, f"{cluster}-ray-pods", pods, [{"from": [{"podSelector": {"matchLabels": dict(pods)}}]}]),
        _network_policy(spec, f"{cluster}-dashboard", {**pods, "ray.io/node-type": "head"},
                        [{"from": dashboard_from, "ports": [{"protocol": "TCP", "port": DASHBOARD_PORT}]}]),
    ]


def network_policies(spec: RayWorkloadSpec, clusters: list[tuple[str, str | None]]) -> list[dict]:
    """The namespace's NetworkPolicies: all ingress denied (:func:`deny_ingress_policy`), then the
    allows of each of ``clusters`` (its name and the RayJob whose submitter reaches it, or None:
    :func:`cluster_policies`); none without ``spec.network_policies``."""
    if not spec.network_policies:
        return []
    return [deny_ingress_policy(spec), *(policy for cluster, submitter_of in clusters
                                         for policy in cluster_policies(spec, cluster, submitter_of=submitter_of))]
