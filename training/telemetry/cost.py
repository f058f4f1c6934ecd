"""What a run costs: its GPU nodes' hours times each node's price, as the node is billed, so far and at
the measured pace, and in the end.

- **The price of a node** (:func:`node_price`, on each node's first worker, from its Kubernetes node's
  labels): On-Demand at the platform's table price (``RAY_TRAIN_EKS_PLATFORM``'s ``gpu_usd_per_hour``
  for its ``node_count`` nodes, ray_train_eks/charts/pods.py); Spot at the Spot price EC2 bills now in
  the node's zone (``DescribeSpotPriceHistory``; the On-Demand price, said as a ceiling, where it cannot
  be read); a capacity reservation at the On-Demand rate (an ODCR bills it, used or not); a Capacity
  Block at ``--gpu-usd-per-hour`` where given (its upfront fee over its hours and instances, which EC2's
  API does not return for a block once bought), else the On-Demand rate, said as an estimate.
  ``--gpu-usd-per-hour`` overrides every node's (a Savings Plan, a discount). Karpenter labels a node
  ``karpenter.sh/capacity-type`` (``on-demand``, ``spot``, ``reserved``) and
  ``karpenter.k8s.aws/capacity-reservation-type`` (``default``, ``capacity-block``)
  (aws/karpenter-provider-aws v1.14.1 ``pkg/apis/v1/labels.go``); a managed node group
  ``eks.amazonaws.com/capacityType`` (``ON_DEMAND``, ``SPOT``, ``CAPACITY_BLOCK``; EKS User Guide,
  "Managed node groups").
- **The run's cost** (:class:`RunCost`): the nodes' prices together times the hours since the job
  started (the driver's start: nodes are billed while the job holds them, its waits included), plus
  each node's time before that (its launch, boot and image pull: from the later of its Kubernetes
  node's ``creationTimestamp`` and the Ray cluster's start, where the cluster was made for this job,
  :func:`billed_from`), plus what the run's earlier invocations cost (:func:`earlier_cost`); after a
  restart or an elastic run's resize, what the last step recorded plus the new group's nodes since
  (:meth:`RunCost.continue_from`). A lower bound of EC2's bill: an instance is billed from its
  ``running`` state, a little before its node registers, and until it is terminated, after the
  driver ends (KubeRay deletes the cluster, Karpenter or the node group removes the node); neither
  is counted. Rank 0 puts ``cost_usd`` (so far) and
  ``cost_usd_projected`` (so far, plus the steps left at the median step time) in each step's
  metrics.jsonl record, the rate in run.json (``cost``); the driver the final figure in summary.json
  (``cost``) and the tracker."""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import dataclasses
from dataclasses import dataclass

from .notify import PLATFORM_ENV

#: Node labels (see the module's text).
KARPENTER_CAPACITY_TYPE = "karpenter.sh/capacity-type"
KARPENTER_RESERVATION_TYPE = "karpenter.k8s.aws/capacity-reservation-type"
EKS_CAPACITY_TYPE = "eks.amazonaws.com/capacityType"
INSTANCE_TYPE, ZONE = "node.kubernetes.io/instance-type", "topology.kubernetes.io/zone"
#: Steps whose median time projects the rest.
PACE_STEPS = 20


#: A Ray cluster started longer than this before the driver is taken as a standing one (ray_train_eks's
#: ``cluster`` workload: a RayCluster that lives across jobs), whose idle hours are not this job's: its nodes
#: are counted from the driver's start only. A RayJob's own cluster starts minutes before its driver (KubeRay
#: submits the job once the cluster's pods are up: the nodes launched, booted, the image pulled). The pods of
#: both carry the same environment (workload/objects.py: one cluster spec), so the gap is what tells them
#: apart; a job on a standing cluster made less than this before it is charged the cluster's start, said in
#: docs/operations.md.
MADE_FOR_THE_JOB_S = 3600


@dataclass(frozen=True)
class NodePrice:
    """One node's price an hour (None: not known), how it is billed and since when it is counted (None: the
    driver's start, :func:`billed_from`)."""

    usd_per_hour: float | None
    basis: str
    since: float | None = None


def cluster_started(session_name: str) -> float | None:
    """When the Ray cluster started, from its session's name (Ray 2.58 ``ray/_private/node.py``:
    ``session_%Y-%m-%d_%H-%M-%S_%f_<pid>`` in the head's local time; the driver runs in the head's pod, so
    on the same clock and zone); None where the name is not of that form."""
    import datetime

    parts = session_name.split("_")
    try:
        return datetime.datetime.strptime("_".join(parts[1:4]), "%Y-%m-%d_%H-%M-%S_%f").timestamp()
    except ValueError:
        return None


def ray_cluster_started() -> float | None:
    """When the Ray cluster this driver joined started (:func:`cluster_started` of its session's name), None
    where not readable."""
    import ray

    if not ray.is_initialized():  # asking the runtime context would start a Ray of its own
        return None
    try:
        return cluster_started(ray.get_runtime_context().get_session_name())
    except Exception:  # noqa: BLE001 - not known: the nodes counted from the driver's start
        return None


def billed_from(node_created: float | None, cluster_start: float | None, driver_start: float) -> float | None:
    """Since when a node is counted, where before the driver's start: the later of its Kubernetes node's
    creation (it registered: its EC2 instance is running) and the Ray cluster's start (a node already up
    for another job), where the cluster was made for this job (:data:`MADE_FOR_THE_JOB_S`); else None."""
    if node_created is None or cluster_start is None or not 0 <= driver_start - cluster_start < MADE_FOR_THE_JOB_S:
        return None
    return min(driver_start, max(node_created, cluster_start))


def platform_price(environ=None) -> float | None:
    """One GPU node's On-Demand price an hour, from the platform's (its nodes' together over their count)."""
    environ = os.environ if environ is None else environ
    try:
        platform = json.loads(environ.get(PLATFORM_ENV) or "{}")
        return float(platform["gpu_usd_per_hour"]) / max(1, int(platform.get("node_count") or 1))
    except (ValueError, KeyError, TypeError):
        return None


def capacity_of(labels: dict) -> str:
    """``on-demand``, ``spot``, ``reserved`` or ``capacity-block``, from a node's labels."""
    karpenter, eks = labels.get(KARPENTER_CAPACITY_TYPE), labels.get(EKS_CAPACITY_TYPE)
    if karpenter == "reserved":
        return "capacity-block" if labels.get(KARPENTER_RESERVATION_TYPE) == "capacity-block" else "reserved"
    if karpenter == "spot" or eks == "SPOT":
        return "spot"
    if eks == "CAPACITY_BLOCK":
        return "capacity-block"
    return "on-demand"


def node_price(labels: dict, *, on_demand: float | None, given: float | None = None, ec2=None) -> NodePrice:
    """A node's price an hour from its labels (see the module's text); ``given``: ``--gpu-usd-per-hour``."""
    if given is not None:
        return NodePrice(given, "--gpu-usd-per-hour")
    capacity = capacity_of(labels)
    if capacity == "spot":
        try:
            return NodePrice(*spot_price(labels, ec2))
        except Exception as error:  # noqa: BLE001 - no permission, no network: the ceiling, said
            return NodePrice(on_demand, f"Spot, its price not readable ({type(error).__name__}: {str(error)[:120]}): the "
                                        "On-Demand price, its ceiling")
    if capacity == "reserved":
        return NodePrice(on_demand, "capacity reservation, billed at the On-Demand rate used or not")
    if capacity == "capacity-block":
        return NodePrice(on_demand, "Capacity Block, paid up front: the On-Demand rate as an estimate; give the block's "
                                    "rate with --gpu-usd-per-hour")
    return NodePrice(on_demand, "On-Demand")


def spot_price(labels: dict, ec2=None) -> tuple[float, str]:
    """The Spot price EC2 bills now for the node's type in its zone, and where it comes from."""
    from ..resilience.deadline import ec2_client

    instance_type, zone = labels[INSTANCE_TYPE], labels[ZONE]
    ec2 = ec2 or ec2_client(os.environ)
    # EC2's API reference (botocore 1.44.8 ``ec2/2016-11-15`` DescribeSpotPriceHistory) documents one form: with a
    # start and end time it "also returns the last price change before the start time, which is the effective
    # price as of the start time". Its order is not documented: the latest change is taken by its time.
    now = datetime.datetime.now(datetime.timezone.utc)
    history = ec2.describe_spot_price_history(InstanceTypes=[instance_type], AvailabilityZone=zone, StartTime=now,
                                              EndTime=now, ProductDescriptions=["Linux/UNIX"])["SpotPriceHistory"]
    latest = max(history, key=lambda entry: entry["Timestamp"])
    return float(latest["SpotPrice"]), f"Spot at {latest['SpotPrice']} USD/h in {zone} (EC2's Spot price since {latest['Timestamp']})"


def run_cost(config, rank: int, world: int, *, started: float, earlier_usd: float,
             cluster_start: float | None = None) -> RunCost | None:
    """The run's cost (collective): each node priced once, by its lowest rank (two all-gathers of a few
    bytes, once per invocation); every rank gets the same. ``cluster_start``: the Ray cluster's
    (:func:`cluster_started`, read on the driver)."""
    import socket

    import torch.distributed as dist

    from ..resilience.faults import NODE_NAME_ENV

    node = os.environ.get(NODE_NAME_ENV) or socket.gethostname()
    nodes: list = [None] * world
    dist.all_gather_object(nodes, node)
    mine = this_node_price(config, started=started, cluster_start=cluster_start) if nodes.index(node) == rank else None
    prices: list = [None] * world
    dist.all_gather_object(prices, mine)
    return RunCost.of(prices, started=started, earlier_usd=earlier_usd)


def this_node_price(config, environ=None, ec2=None, *, started: float | None = None,
                    cluster_start: float | None = None) -> NodePrice:
    """This worker's node's price (in a pod: its labels, as the preflight read the node from the Kubernetes
    API), else the platform's On-Demand price, and since when it is counted (:func:`billed_from`, from the
    node's ``creationTimestamp``: ``started`` is the driver's start). Without the platform's price (a local
    run) and no ``--gpu-usd-per-hour``, nothing is read: no figure comes of it."""
    from ..resilience.faults import NODE_NAME_ENV
    from ..resilience.kube import known_node

    environ = os.environ if environ is None else environ
    on_demand, given = platform_price(environ), getattr(config, "gpu_usd_per_hour", None)
    node: dict = {}
    name = environ.get(NODE_NAME_ENV)
    if name and (given is not None or on_demand is not None):
        try:
            node = known_node(name)
        except Exception as error:  # noqa: BLE001 - the node's kind unknown: priced On-Demand, said
            print(f"[cost] could not read node {name} ({type(error).__name__}: {error}); priced On-Demand, from the "
                  "driver's start", file=sys.stderr, flush=True)
    metadata = node.get("metadata") or {}
    price = node_price(metadata.get("labels") or {}, on_demand=on_demand, given=given, ec2=ec2)
    since = billed_from(_created(metadata), cluster_start, started) if started is not None else None
    return dataclasses.replace(price, since=since)


def _created(metadata: dict) -> float | None:
    """A Kubernetes object's ``creationTimestamp`` (RFC 3339, UTC) as a time, None where absent."""
    import datetime

    try:
        return datetime.datetime.fromisoformat(metadata["creationTimestamp"].replace("Z", "+00:00")).timestamp()
    except (KeyError, ValueError, AttributeError):
        return None


@dataclass
class RunCost:
    """The run's GPU nodes' price an hour together, how they are billed, since when, and what the run's
    earlier invocations cost."""

    usd_per_hour: float
    basis: str
    nodes: int
    started: float
    earlier_usd: float = 0.0
    #: The nodes' time before the driver's start (their launch, boot and image pull: :func:`billed_from`).
    before_start_usd: float = 0.0

    @classmethod
    def of(cls, prices: list[NodePrice | None], *, started: float, earlier_usd: float) -> "RunCost | None":
        """From each node's price (None from ranks that are not a node's first); None where a node's price
        is not known (a local run without the platform's)."""
        found = [price for price in prices if price is not None]
        if not found or any(price.usd_per_hour is None for price in found):
            return None
        bases = sorted({price.basis for price in found})
        before = sum(price.usd_per_hour * (started - price.since) / 3600 for price in found if price.since is not None)
        return cls(sum(price.usd_per_hour for price in found), "; ".join(bases), len(found), started, earlier_usd,
                   round(before, 6))

    def so_far(self, now: float | None = None) -> float:
        """USD spent: the earlier invocations', this one's nodes' before the job started, and since."""
        now = time.time() if now is None else now
        return self.earlier_usd + self.before_start_usd + self.usd_per_hour * max(0.0, now - self.started) / 3600

    def projected(self, *, steps_left: int, step_seconds: list[float], now: float | None = None) -> float | None:
        """USD at the run's end: so far, plus the steps left at the median of the recent step times."""
        recent = sorted(step_seconds[-PACE_STEPS:])
        if not recent:
            return None
        return self.so_far(now) + self.usd_per_hour * steps_left * recent[len(recent) // 2] / 3600

    def record(self) -> dict:
        """What run.json keeps (``cost``), and the reported metrics carry to the driver."""
        return {"usd_per_hour": round(self.usd_per_hour, 4), "basis": self.basis, "nodes": self.nodes,
                "started": self.started, "earlier_usd": round(self.earlier_usd, 4),
                "before_start_usd": round(self.before_start_usd, 4)}

    def continue_from(self, last: dict | None) -> None:
        """A worker group that is not the invocation's first (a restart, an elastic run's resize: other
        nodes, maybe another count): the cost is what the invocation's last step recorded (``last``,
        metrics.jsonl's record) and this group's nodes since; nothing where that step is not this
        invocation's."""
        if last and isinstance(last.get("cost_usd"), (int, float)) and float(last.get("time") or 0) >= self.started:
            self.earlier_usd, self.started = float(last["cost_usd"]), float(last["time"])
            self.before_start_usd = 0.0  # in the last step's figure

    @classmethod
    def from_record(cls, record: dict | None) -> "RunCost | None":
        return cls(**record) if record else None

    def final(self, now: float | None = None) -> dict:
        """summary.json's ``cost``: the run's whole cost, its rate and hours."""
        now = time.time() if now is None else now
        return {"usd": round(self.so_far(now), 4), "usd_per_hour": round(self.usd_per_hour, 4),
                "hours_this_invocation": round(max(0.0, now - self.started) / 3600, 4), "basis": self.basis,
                "earlier_usd": round(self.earlier_usd, 4), "before_start_usd": round(self.before_start_usd, 4)}


def earlier_cost(run_folder: str) -> float:
    """What the run's earlier invocations cost: the last figure it recorded (a step's ``cost_usd`` in
    metrics.jsonl, a finished invocation's ``cost.usd`` in summary.json), 0 for a new run."""
    from ..storage.files import read_text
    from .runlog import METRICS_FILE, parse_lines

    try:
        lines = parse_lines(read_text(f"{run_folder}/{METRICS_FILE}"))
        summary = json.loads(read_text(f"{run_folder}/summary.json") or "{}")
    except Exception:  # noqa: BLE001 - unreadable: counted from 0, as a new run
        return 0.0
    figures = [line["cost_usd"] for line in lines if isinstance(line.get("cost_usd"), (int, float))]
    figures.append((summary.get("cost") or {}).get("usd") or 0.0)
    return float(max(figures))
