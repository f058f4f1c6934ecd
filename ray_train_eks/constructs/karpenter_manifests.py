"""Karpenter's EC2NodeClass and NodePool for EFA GPU nodes, as data (KarpenterGpuCapacity in
``karpenter.py`` puts them in the cluster): one instance type in one AZ, bought as the capacity
types a user orders (ray_train_eks/rules/reservations.py), into reservations selected by id or
tags, validated in the tests against Karpenter 1.14.1's CRDs."""

from __future__ import annotations

from typing import Mapping, Sequence

from aws_cdk import Duration, aws_eks_v2 as eks

from ray_train_eks.constructs.launch_templates import ROOT_DEVICE, NodeDisks

#: EKS taint effects (TaintSpec) as Kubernetes writes them.
_EFFECTS = {"NO_SCHEDULE": "NoSchedule", "NO_EXECUTE": "NoExecute", "PREFER_NO_SCHEDULE": "PreferNoSchedule"}


def capacity_reservation_terms(ids: Sequence[str] = (), tags: Mapping[str, str] | None = None) -> list[dict]:
    """The EC2NodeClass's ``capacityReservationSelectorTerms``: one term per id (terms are ORed),
    or one term of every tag (ANDed within it). Karpenter finds the reservations' type, AZ,
    instance type and room itself (``status.capacityReservations``)."""
    if ids:
        return [{"id": reservation} for reservation in ids]
    return [{"tags": dict(tags)}] if tags else []


def _go_duration(duration: Duration) -> str:
    """A CDK duration as Karpenter writes one: ``5m``, ``90s``."""
    seconds = int(duration.to_seconds())
    return f"{seconds // 60}m" if seconds % 60 == 0 else f"{seconds}s"


def kubernetes_taint(taint: eks.TaintSpec) -> dict[str, str]:
    """An EKS TaintSpec as a Kubernetes taint."""
    out = {"key": taint.key, "effect": _EFFECTS[taint.effect.value]}
    if taint.value is not None:
        out["value"] = taint.value
    return out


def ec2_node_class(
    *,
    name: str,
    role_name: str,
    ami_alias: str,
    subnet_id: str,
    security_group_ids: Sequence[str],
    placement_group_name: str | None,
    disks: NodeDisks,
    tags: Mapping[str, str] | None = None,
    reservation_terms: Sequence[Mapping] = (),
    user_data: str | None = None,
) -> dict:
    """The EC2NodeClass (karpenter.k8s.aws/v1). No ``networkInterfaces``: a pod that requests
    ``vpc.amazonaws.com/efa`` makes Karpenter launch with one ``efa`` interface per network
    card (device 0 on card 0, device 1 on the others: EfaNodeGroup's layout), each carrying
    every selected security group. ``placement_group_name`` None: no placement group (the
    reservations' own placement, or a Capacity Block's UltraCluster). ``reservation_terms``:
    :func:`capacity_reservation_terms`. ``user_data``: nodeadm's MIME parts, which Karpenter merges
    with its own NodeConfig."""
    spec = {
        "role": role_name,
        "amiSelectorTerms": [{"alias": ami_alias}],
        "subnetSelectorTerms": [{"id": subnet_id}],
        "securityGroupSelectorTerms": [{"id": group} for group in security_group_ids],
        **({"placementGroupSelector": {"name": placement_group_name}} if placement_group_name else {}),
        **({"capacityReservationSelectorTerms": [dict(t) for t in reservation_terms]} if reservation_terms else {}),
        "metadataOptions": {
            "httpEndpoint": "enabled",
            "httpProtocolIPv6": "disabled",
            "httpPutResponseHopLimit": 1,
            "httpTokens": "required",
        },
        # containerd, kubelet and the pods' emptyDirs on a RAID0 of the local NVMe (Karpenter sets
        # nodeadm's localStorage strategy), and the node's ephemeral storage is its size.
        **({"instanceStorePolicy": "RAID0"} if disks.instance_store else {}),
        "blockDeviceMappings": [{
            "deviceName": ROOT_DEVICE,
            "ebs": {"volumeSize": f"{disks.root_volume_gib}Gi", "volumeType": "gp3", "encrypted": True, "deleteOnTermination": True,
                    **({"throughput": disks.throughput_mibps, "iops": disks.iops} if disks.throughput_mibps else {})},
        }],
    }
    if tags:
        spec["tags"] = dict(tags)
    if user_data:
        spec["userData"] = user_data
    return {"apiVersion": "karpenter.k8s.aws/v1", "kind": "EC2NodeClass", "metadata": {"name": name}, "spec": spec}


def node_pool(
    *,
    name: str,
    node_class_name: str,
    instance_type: str,
    availability_zone: str,
    gpu_limit: int,
    labels: Mapping[str, str],
    taints: Sequence[Mapping[str, str]],
    consolidate_after: str,
    termination_grace: str,
    capacity_types: Sequence[str] = ("on-demand",),
) -> dict:
    """The NodePool (karpenter.sh/v1): nodes of one type in one AZ, of ``capacity_types``
    (Karpenter takes reserved capacity first, then Spot, then On-Demand, each when the one before
    has no room), at most ``gpu_limit`` GPUs, removed once empty for ``consolidate_after``, never expired, drained
    for at most ``termination_grace`` before they are terminated."""
    return {
        "apiVersion": "karpenter.sh/v1",
        "kind": "NodePool",
        "metadata": {"name": name},
        "spec": {
            "template": {
                "metadata": {"labels": dict(labels)},
                "spec": {
                    "nodeClassRef": {"group": "karpenter.k8s.aws", "kind": "EC2NodeClass", "name": node_class_name},
                    "requirements": [
                        {"key": "node.kubernetes.io/instance-type", "operator": "In", "values": [instance_type]},
                        {"key": "karpenter.sh/capacity-type", "operator": "In", "values": list(capacity_types)},
                        {"key": "topology.kubernetes.io/zone", "operator": "In", "values": [availability_zone]},
                        # Never an interruptible reservation, whenever it was made one (its owner takes its
                        # instances back at two minutes' notice): Karpenter v1.14.1 labels reserved offerings
                        # with it (offering/reserved_capacity_resolver.go) and only ranks them last
                        # (instance/filter/filter.go); Spot and On-Demand offerings lack the label, which
                        # NotIn allows. The deploy's check refuses one named at deploy time.
                        *([{"key": "karpenter.k8s.aws/capacity-reservation-interruptible", "operator": "NotIn",
                            "values": ["true"]}] if "reserved" in capacity_types else []),
                    ],
                    "taints": [dict(t) for t in taints],
                    # Expiration is forceful (no budget stops it): a node lives until it
                    # is empty, never mid-run.
                    "expireAfter": "Never",
                    # A draining node's pods (any a PodDisruptionBudget holds, or a user's with
                    # do-not-disrupt) are deleted after this, so its termination, the
                    # EC2NodeClass's deletion and cdk destroy end in bounded time.
                    "terminationGracePeriod": termination_grace,
                },
            },
            "limits": {"nvidia.com/gpu": str(gpu_limit)},
            "disruption": node_pool_disruption(capacity_types, consolidate_after),
        },
    }


def node_pool_disruption(capacity_types: Sequence[str], consolidate_after: str) -> dict:
    """What Karpenter may disrupt on its own (voluntary disruption, karpenter.sh/v1 NodePool
    ``spec.disruption``). The Ray pods carry no ``karpenter.sh/do-not-disrupt``: Karpenter's drain
    never evicts such a pod (kubernetes-sigs/karpenter v1.14.1 pkg/utils/pod/scheduling.go
    ``IsEvictable``), so on a Spot interruption its preStop hook would never run before EC2 takes
    the instance; the budgets keep the voluntary methods off a running node instead (budgets
    bound drift, emptiness and consolidation only; interruption, expiration and node repair are
    forceful, website/content/en/docs/concepts/disruption.md at tag v1.14.1):

    - ``Empty``, 100%: the nodes of a finished run all go at once, ``consolidate_after`` after
      their last pod (the default budget is 10% of nodes);
    - ``Drifted``, 0: a changed NodePool, EC2NodeClass or AMI never replaces a node under a run
      (each replacement would cost every GPU a restart); empty nodes still go, and new ones come
      with the new settings;
    - ``Underutilized``, 1 node at a time, only where the NodePool falls back (reserved, Spot,
      On-Demand: more than one type allowed): an On-Demand node goes back to a reservation once it
      has room (a reserved offering is priced at the On-Demand price / 10^7,
      ``reserved_capacity_resolver.go``) or to Spot; a Spot node stays Spot (its move to a reservation
      is spot-to-spot consolidation in ``consolidation.go``, behind the ``SpotToSpotConsolidation``
      gate, off). After a Spot reclaim the replacement may be on-demand (Karpenter marks the Spot offering
      unavailable for 3 minutes, aws/karpenter-provider-aws pkg/cache/cache.go
      ``UnavailableOfferingsTTL``); single-node consolidation then replaces an on-demand node
      with Spot once Spot is cheaper and available (pkg/controllers/disruption/consolidation.go
      ``computeConsolidation`` pins an OD -> [OD, Spot] replacement to Spot; no feature gate,
      unlike spot-to-spot), launching the Spot node first and draining the old one once it is
      initialized (queue.go ``waitOrTerminate``). Each return costs one preemption.
    """
    falls_back = len(set(capacity_types)) > 1
    budgets = [{"nodes": "100%", "reasons": ["Empty"]}, {"nodes": "0", "reasons": ["Drifted"]}]
    if falls_back:
        budgets.append({"nodes": "1", "reasons": ["Underutilized"]})
    return {
        "consolidationPolicy": "WhenEmptyOrUnderutilized" if falls_back else "WhenEmpty",
        "consolidateAfter": consolidate_after,
        "budgets": budgets,
    }


