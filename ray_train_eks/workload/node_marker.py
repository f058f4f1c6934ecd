"""What lets a GPU worker taint its own node at a hardware fault (training/resilience/health.py,
training/resilience/kube.py), and nothing more: the worker pods' environment that training.resilience.health reads,
a ClusterRole and its binding, and a ValidatingAdmissionPolicy that limits the Ray pods' node
updates to the one taint."""

from __future__ import annotations

import json
import re

from ray_train_eks.workload.spec import PART_OF, UNHEALTHY_TAINT_KEY, RayWorkloadSpec

#: training.resilience.health's environment of the GPU worker pods: the pod's node (downward API), the taint
#: a worker puts on it at a hardware fault (the spec's ``unhealthy_taint_key``, by default
#: ``UNHEALTHY_TAINT_KEY``), and the GPUs the pod was given.
NODE_NAME_ENV = "RAY_TRAIN_EKS_NODE_NAME"
UNHEALTHY_TAINT_ENV = "RAY_TRAIN_EKS_UNHEALTHY_TAINT"
POD_GPUS_ENV = "RAY_TRAIN_EKS_POD_GPUS"
#: The user information of a request made with a service-account token bound to a pod names the
#: pod's node (Kubernetes ServiceAccountTokenPodNodeInfo, KEP-4193: beta and on by default since
#: 1.30, GA in 1.32; the tokens the kubelet projects into pods are such tokens).
TOKEN_NODE_NAME = "authentication.kubernetes.io/node-name"
#: A label (and taint) key: an optional DNS-1123 subdomain prefix and '/', then a name of at most
#: 63 characters (k8s.io/apimachinery validation IsQualifiedName).
_QUALIFIED_NAME = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                             r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


def node_marker_problems(spec: RayWorkloadSpec) -> list[str]:
    """The taint key must be one Kubernetes takes."""
    if spec.unhealthy_taint_key is not None and not _QUALIFIED_NAME.match(spec.unhealthy_taint_key):
        return [f"unhealthy_taint_key={spec.unhealthy_taint_key!r}: a taint key is a label key ('prefix/name', the "
                f"name at most 63 letters, digits, '-', '_' or '.'), e.g. {UNHEALTHY_TAINT_KEY!r}; or None for no taint"]
    return []


def node_marker_objects(spec: RayWorkloadSpec) -> list[dict]:
    """What lets a GPU worker taint its own node at a hardware fault, and nothing more: a
    ClusterRole to get and patch nodes, bound to the Ray pods' service account, and a
    ValidatingAdmissionPolicy (admissionregistration.k8s.io/v1, GA since Kubernetes 1.30) under
    which that account's node updates may add, change or remove ``spec.unhealthy_taint_key`` with
    effect NoSchedule and leave every other taint, label, annotation, finalizer, owner and the
    node's ``unschedulable`` as they were, on the node the pod runs on only: the one its bound
    service-account token names (``TOKEN_NODE_NAME``; RBAC cannot say "this pod's node", so the
    ClusterRole is cluster-wide and the policy narrows it). None without an ``unhealthy_taint_key``."""
    key = spec.unhealthy_taint_key
    if not key:
        return []
    name = f"ray-train-eks-node-marker-{spec.namespace}"
    user = f"system:serviceaccount:{spec.namespace}:{spec.service_account}"
    metadata = {"name": name, "labels": dict(PART_OF)}

    def same(path: str) -> str:  # has() first: CEL compares fields that are set
        return f"has(object.{path}) == has(oldObject.{path}) && (!has(object.{path}) || object.{path} == oldObject.{path})"

    def kept(new: str, old: str) -> str:  # every taint of ``new`` but ours is one of ``old``'s
        return (f"!has({new}.spec.taints) || {new}.spec.taints.all(t, t.key == variables.key || "
                f"(has({old}.spec.taints) && {old}.spec.taints.exists(o, o == t)))")

    return [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": metadata,
         "rules": [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]},
                   # Why a replacement node does not come (Karpenter's NodeClaims: training/resilience/kube.py).
                   *([{"apiGroups": ["karpenter.sh"], "resources": ["nodeclaims"], "verbs": ["list"]},
                      # Karpenter's events about them (a launch EC2 refused deletes its NodeClaim).
                      {"apiGroups": [""], "resources": ["events"], "verbs": ["list"]}]
                     if spec.node_claims_readable else [])]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": metadata,
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": spec.service_account, "namespace": spec.namespace}]},
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy", "metadata": metadata,
         "spec": {
             "failurePolicy": "Fail",
             "matchConstraints": {"resourceRules": [
                 {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["UPDATE"], "resources": ["nodes"]}]},
             "matchConditions": [{"name": "ray-pods", "expression": f"request.userInfo.username == {json.dumps(user)}"}],
             "variables": [{"name": "key", "expression": json.dumps(key)}],
             "validations": [
                 {"expression": f"has(request.userInfo.extra) && {json.dumps(TOKEN_NODE_NAME)} in request.userInfo.extra && "
                                f"request.userInfo.extra[{json.dumps(TOKEN_NODE_NAME)}].exists(n, n == object.metadata.name)",
                  "message": "the Ray pods may mark only the node they run on (the node their service-account token names)"},
                 {"expression": f"({kept('object', 'oldObject')}) && ({kept('oldObject', 'object')})",
                  "message": f"the Ray pods may change no taint of a node but {key}"},
                 {"expression": "!has(object.spec.taints) || object.spec.taints.all(t, t.key != variables.key || "
                                "t.effect == 'NoSchedule')",
                  "message": f"the Ray pods may set {key} with effect NoSchedule only"},
                 *({"expression": same(path), "message": f"the Ray pods may not change a node's {path}"}
                   for path in ("metadata.labels", "metadata.annotations", "metadata.finalizers",
                                "metadata.ownerReferences", "spec.unschedulable")),
             ],
         }},
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding", "metadata": metadata,
         "spec": {"policyName": name, "validationActions": ["Deny"]}},
    ]
