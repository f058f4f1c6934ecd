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
  what the run's earlier invocations cost (:func:`earlier_cost`); after a restart or an elastic run's
  resize, what the last step recorded plus the new group's nodes since (:meth:`RunCost.continue_from`). Rank 0 puts ``cost_usd`` (so far) and
  ``cost_usd_projected`` (so far, plus the steps left at the median step time) in each step's
  metrics.jsonl record, the rate in run.json (``cost``); the driver the final figure in summary.json
  (``cost``) and the tracker."""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from dataclasses import dataclass

from .notify import PLATFORM_ENV

#: Node labels (see the module's text).
KARPENTER_CAPACITY_TYPE = "karpenter.sh/capacity-type"
KARPENTER_RESERVATION_TYPE = "karpenter.k8s.aws/capacity-reservation-type"
EKS_CAPACITY_TYPE = "eks.amazonaws.com/capacityType"
INSTANCE_TYPE, ZONE = "node.kubernetes.io/instance-type", "topology.kubernetes.io/zone"
#: Steps whose median time projects the rest.
PACE_STEPS = 20


@dataclass(frozen=True)
class NodePrice:
    """One node's price an hour (None: not known) and how it is billed."""

    usd_per_hour: float | None
    basis: str


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


def run_cost(config, rank: int, world: int, *, started: float, earlier_usd: float) -> RunCost | None:
    """The run's cost (collective): each node priced once, by its lowest rank (two all-gathers of a few
    bytes, once per invocation); every rank gets the same."""
    import socket

    import torch.distributed as dist

    from ..resilience.faults import NODE_NAME_ENV

    node = os.environ.get(NODE_NAME_ENV) or socket.gethostname()
    nodes: list = [None] * world
    dist.all_gather_object(nodes, node)
    mine = this_node_price(config) if nodes.index(node) == rank else None
    prices: list = [None] * world
    dist.all_gather_object(prices, mine)
    return RunCost.of(prices, started=started, earlier_usd=earlier_usd)


def this_node_price(config, environ=None, ec2=None) -> NodePrice:
    """This worker's node's price (in a pod: its labels, as the preflight read the node from the Kubernetes
    API), else the platform's On-Demand price. Without the platform's price (a local run) and no
    ``--gpu-usd-per-hour``, nothing is read: no figure comes of it."""
    from ..resilience.faults import NODE_NAME_ENV
    from ..resilience.kube import node_labels

    environ = os.environ if environ is None else environ
    on_demand, given = platform_price(environ), getattr(config, "gpu_usd_per_hour", None)
    labels: dict = {}
    name = environ.get(NODE_NAME_ENV)
    if name and given is None and on_demand is not None:
        try:
            labels = node_labels(name)
        except Exception as error:  # noqa: BLE001 - the node's kind unknown: priced On-Demand, said
            print(f"[cost] could not read node {name}'s labels ({type(error).__name__}: {error}); priced On-Demand",
                  file=sys.stderr, flush=True)
    return node_price(labels, on_demand=on_demand, given=given, ec2=ec2)


@dataclass
class RunCost:
    """The run's GPU nodes' price an hour together, how they are billed, since when, and what the run's
    earlier invocations cost."""

    usd_per_hour: float
    basis: str
    nodes: int
    started: float
    earlier_usd: float = 0.0

    @classmethod
    def of(cls, prices: list[NodePrice | None], *, started: float, earlier_usd: float) -> "RunCost | None":
        """From each node's price (None from ranks that are not a node's first); None where a node's price
        is not known (a local run without the platform's)."""
        found = [price for price in prices if price is not None]
        if not found or any(price.usd_per_hour is None for price in found):
            return None
        bases = sorted({price.basis for price in found})
        return cls(sum(price.usd_per_hour for price in found), "; ".join(bases), len(found), started, earlier_usd)

    def so_far(self, now: float | None = None) -> float:
        """USD spent: the earlier invocations', and this one's since the job started."""
        now = time.time() if now is None else now
        return self.earlier_usd + self.usd_per_hour * max(0.0, now - self.started) / 3600

    def projected(self, *, steps_left: int, step_seconds: list[float], now: float | None = None) -> float | None:
        """USD at the run's end: so far, plus the steps left at the median of the recent step times."""
        recent = sorted(step_seconds[-PACE_STEPS:])
        if not recent:
            return None
        return self.so_far(now) + self.usd_per_hour * steps_left * recent[len(recent) // 2] / 3600

    def record(self) -> dict:
        """What run.json keeps (``cost``), and the reported metrics carry to the driver."""
        return {"usd_per_hour": round(self.usd_per_hour, 4), "basis": self.basis, "nodes": self.nodes,
                "started": self.started, "earlier_usd": round(self.earlier_usd, 4)}

    def continue_from(self, last: dict | None) -> None:
        """A worker group that is not the invocation's first (a restart, an elastic run's resize: other
        nodes, maybe another count): the cost is what the invocation's last step recorded (``last``,
        metrics.jsonl's record) and this group's nodes since; nothing where that step is not this
        invocation's."""
        if last and isinstance(last.get("cost_usd"), (int, float)) and float(last.get("time") or 0) >= self.started:
            self.earlier_usd, self.started = float(last["cost_usd"]), float(last["time"])

    @classmethod
    def from_record(cls, record: dict | None) -> "RunCost | None":
        return cls(**record) if record else None

    def final(self, now: float | None = None) -> dict:
        """summary.json's ``cost``: the run's whole cost, its rate and hours."""
        now = time.time() if now is None else now
        return {"usd": round(self.so_far(now), 4), "usd_per_hour": round(self.usd_per_hour, 4),
                "hours_this_invocation": round(max(0.0, now - self.started) / 3600, 4), "basis": self.basis,
                "earlier_usd": round(self.earlier_usd, 4)}


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
