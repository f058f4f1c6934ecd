"""What a trainer may do in the Ray namespace: exactly the verbs ``ray-train-eks`` uses, as a Role
bound to a Kubernetes group that the stack maps trainers' IAM roles to (EKS access entries with
``kubernetesGroups``: constructs/trainer_access.py). Least privilege: no exec into pods, no
secrets, nothing outside the namespace, no access to the cluster-wide Kueue objects."""

from __future__ import annotations

from ray_train_eks.workload.spec import PART_OF, RayWorkloadSpec

#: The group trainers' access entries carry (a name in the ``ray-train-eks:`` prefix, which no
#: Kubernetes or EKS group uses).
TRAINERS_GROUP = "ray-train-eks:trainers"
TRAINER_ROLE = "ray-train-eks-trainer"
#: (API group, resources, verbs): what each command sends (ray_train_eks/cli/).
TRAINER_RULES = (
    # The platform's settings and the deployed code's digest (get); a job's own code copy (create).
    ("", ("configmaps",), ("get", "create")),
    # list, status, logs: the submitter's pods, waited for and followed.
    ("", ("pods",), ("get", "list", "watch")),
    ("", ("pods/log",), ("get",)),
    # submit (create; a stopped job of the same name is waited for), list and status, stop (delete).
    ("ray.io", ("rayjobs",), ("get", "list", "watch", "create", "delete")),
    # A job's NetworkPolicies, created first, then owned by its RayJob (update). delete: where the API
    # server runs the OwnerReferencesPermissionEnforcement admission plugin (not EKS), setting an
    # ownerReference needs delete on the object itself (kubernetes plugin/pkg/admission/gc).
    ("networking.k8s.io", ("networkpolicies",), ("get", "create", "update", "delete")),
    # The GPU nodes' Lease, taken by compare-and-swap (ray_train_eks/cli/admission.py).
    ("coordination.k8s.io", ("leases",), ("get", "create", "update")),
    # Kueue: the queue is there; why a job waits.
    ("kueue.x-k8s.io", ("localqueues", "workloads"), ("get", "list")),
    # serve (create, or replace: a serve again), serve --list and status, unserve (delete); a service's
    # progress is watched (ray_train_eks/cli/serve.py).
    ("ray.io", ("rayservices",), ("get", "list", "watch", "create", "update", "delete")),
    # endpoint and chat: a port-forward to a service's head, the websocket upgrade authorized as a
    # create (Kubernetes 1.30+: AuthorizePodWebsocketUpgradeCreatePermission).
    ("", ("pods/portforward",), ("create",)),
)


def trainer_role_objects(spec: RayWorkloadSpec, *, group: str = TRAINERS_GROUP) -> list[dict]:
    """The Role with :data:`TRAINER_RULES` in ``spec.namespace`` and its RoleBinding to ``group``."""
    metadata = {"name": TRAINER_ROLE, "namespace": spec.namespace, "labels": dict(PART_OF)}
    return [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": dict(metadata),
         "rules": [{"apiGroups": [api_group], "resources": list(resources), "verbs": list(verbs)}
                   for api_group, resources, verbs in TRAINER_RULES]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": dict(metadata),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": TRAINER_ROLE},
         "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": group}]},
    ]
