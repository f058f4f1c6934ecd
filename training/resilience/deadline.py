"""A time the run must have checkpointed and stopped by: ``--stop-before``, or, on GPU nodes that run
only on EC2 Capacity Blocks, the earliest block's end less EC2's lead.

EC2 reclaims a Capacity Block's instances at its end: "Forty minutes before your Capacity Block
reservation ends, you receive another EventBridge event that tells you that any instances running in
the reservation will begin to terminate in 10 minutes" (Amazon EC2 User Guide, "Monitor Capacity Blocks
using EventBridge", docs.aws.amazon.com/AWSEC2/latest/UserGuide/capacity-blocks-monitor.html): the
instances go from 30 minutes before the block's ``EndDate``, and a managed node group on a block is
scaled to 0 forty minutes before it (EKS's own scheduled action, "Amazon EKS Node Group Capacity
Scaledown Before Reservation End": EKS User Guide, "Capacity Blocks for ML"), and Karpenter deletes a
block's NodeClaims then on its own timer (karpenter-provider-aws v1.14.1
pkg/controllers/capacityreservation/expiration). So the nodes may go from 40 minutes before the end. A run that reaches that moment mid-step
loses everything since its last checkpoint, and with it the Ray job (a failure, charged against
``--max-failures``, with no node to resume on).

So the driver resolves the stop time (:func:`resolve`; the pods name their blocks in
:data:`CAPACITY_BLOCKS_ENV`, and their role may ``ec2:DescribeCapacityReservations``), and after each
step every rank asks whether the next step and a checkpoint would still end before it
(:func:`should_stop`, agreed by an all-reduce in training/loop.py). If not, the run checkpoints, is
reported, and ends as stopped: resumable (``ray-train-eks submit --resume``), not failed.

A block can be extended while it runs: it keeps its id and gets a later ``EndDate`` (EC2 User Guide,
"Extend Capacity Blocks"). So before the run stops for a block's end, rank 0 reads the end again
(:func:`extended`): one call where the stop comes, none on the way; a later end moves the stop where
Karpenter runs the nodes (its expiration controller reads the block's end each minute). A managed node
group's scale-down is EKS's scheduled action, made with the group from the block's end then, and
neither the EKS nor the EC2 guide says an extension moves it: there the run keeps its stop and says so.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

#: Comma-separated ``cr-...`` ids of the Capacity Blocks the GPU nodes run on (the Ray pods: from the
#: settings ConfigMap's ``capacity_block_ids``, set only where the GPU nodes run on blocks alone).
CAPACITY_BLOCKS_ENV = "RAY_TRAIN_EKS_CAPACITY_BLOCK_IDS"
#: Or the tags that select them (JSON, ``{"key": "value"}``: Karpenter's ``capacityReservationSelectorTerms``).
CAPACITY_BLOCK_TAGS_ENV = "RAY_TRAIN_EKS_CAPACITY_BLOCK_TAGS"
#: What takes the nodes at a block's end: ``karpenter`` (it reads the block's end live, so an extension
#: keeps the nodes) or ``node-group`` (EKS's scheduled scale-down, set when the group was made; the
#: default, where the pods are not told).
CAPACITY_BLOCK_NODES_ENV = "RAY_TRAIN_EKS_CAPACITY_BLOCK_NODES"
#: The nodes may go this long before a block's end (the docs above: EKS's scale-down of a node group
#: and EC2's warning at 40 minutes, its termination from 30).
TERMINATION_LEAD_S = 40 * 60
#: And the run aims to have stopped this long before that, whatever its step and checkpoint times.
SAFETY_MARGIN_S = 5 * 60


class StopTimeError(ValueError):
    """A ``--stop-before`` the run cannot use (said with the field, the value and the fix)."""


@dataclass(frozen=True)
class Deadline:
    """When the run must have checkpointed and stopped (epoch seconds), and why."""

    stop_at: float
    reason: str
    #: The Capacity Block that sets it, and its end (epoch seconds); None for a ``--stop-before``.
    block_id: str | None = None
    block_ends: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict | None) -> "Deadline | None":
        return cls(**values) if values else None

    def record(self) -> dict:
        """What the run's ``run.json`` keeps of it (``ray-train-eks status`` reads it: ray_train_eks/cli/run_records.py)."""
        found = {"stop_before": iso(self.stop_at)}
        if self.block_id:
            found["capacity_block"] = {"id": self.block_id, "ends": iso(self.block_ends)}
        return found

    def stop_reason(self) -> str:
        """Why the run stops, and how to go on."""
        return f"{self.reason}; resume with `ray-train-eks submit --resume <run>` on new capacity"


def iso(epoch: float | None) -> str | None:
    return None if epoch is None else datetime.fromtimestamp(epoch, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str) -> float:
    """An ISO-8601 time with its zone (``2026-12-05T14:00:00Z``, ``...+00:00``) as epoch seconds."""
    try:
        when = datetime.fromisoformat(text.strip().upper())
    except ValueError:
        raise StopTimeError(f"stop_before={text!r} is not an ISO-8601 time; give it in UTC, e.g. "
                            f"--stop-before {datetime.now(timezone.utc):%Y-%m-%dT%H:%M}:00Z") from None
    if when.tzinfo is None:
        raise StopTimeError(f"stop_before={text!r} has no time zone; add Z for UTC, e.g. --stop-before {text.strip()}Z")
    return when.timestamp()


def stop_time_problem(text: str | None, now: float | None = None) -> str | None:
    """What is wrong with a ``--stop-before`` (``none``: no stop time), or None."""
    if text is None or text.strip().lower() in ("", "none"):
        return None
    try:
        at = parse_time(text)
    except StopTimeError as error:
        return str(error)
    now = time.time() if now is None else now
    if at <= now:
        return (f"stop_before={text!r} is in the past (now {iso(now)}); give a later time, or --stop-before none "
                "(a resumed run keeps the options it was submitted with)")
    return None


def resolve(stop_before: str | None, environ=None, client=None, now: float | None = None) -> Deadline | None:
    """The run's stop time: ``--stop-before`` where given (``none``: none at all), else the earliest
    end of the Capacity Blocks in :data:`CAPACITY_BLOCKS_ENV` less :data:`TERMINATION_LEAD_S` and
    :data:`SAFETY_MARGIN_S`, else None. A failed EC2 call is a warning: the run goes on without one."""
    environ = os.environ if environ is None else environ
    if stop_before is not None:
        if stop_before.strip().lower() == "none":
            return None
        at = parse_time(stop_before)
        return Deadline(stop_at=at, reason=f"--stop-before {iso(at)}")
    try:
        return _blocks_deadline(environ, client)
    except Exception as error:  # noqa: BLE001 - the run goes on, without a stop time
        print(f"[train] WARNING: could not read the end of capacity block(s) {_named(environ)} ({_said(error)}); "
              "the run goes on without a stop time, and the nodes go from 40 min before the block's end "
              "(give --stop-before to stop in time)", file=sys.stderr, flush=True)
        return None


def _block_selection(environ) -> tuple[list[str], dict]:
    ids = [part.strip() for part in (environ.get(CAPACITY_BLOCKS_ENV) or "").split(",") if part.strip()]
    return ids, json.loads(environ.get(CAPACITY_BLOCK_TAGS_ENV) or "{}")


def _named(environ) -> str:
    ids, tags = _block_selection(environ)
    return ", ".join(ids) or "tagged " + ",".join(f"{k}={v}" for k, v in tags.items())


def _said(error: Exception) -> str:
    first = str(error).splitlines()[0] if str(error) else ""
    return f"ec2:DescribeCapacityReservations: {type(error).__name__}: {first}"


def _blocks_deadline(environ, client=None) -> Deadline | None:
    """The earliest end of the blocks the pods name, as a stop time (None: none named, or none ends);
    EC2's errors raise."""
    ids, tags = _block_selection(environ)
    if not ids and not tags:
        return None
    client = client or ec2_client(environ)
    query = ({"CapacityReservationIds": ids} if ids else
             {"Filters": [{"Name": f"tag:{k}", "Values": [v]} for k, v in tags.items()]
              + [{"Name": "state", "Values": ["active", "scheduled"]}]})
    reservations = [r for page in client.get_paginator("describe_capacity_reservations").paginate(**query)
                    for r in page["CapacityReservations"]
                    if ids or (r.get("ReservationType") or "default") == "capacity-block"]
    ends = sorted((r["EndDate"].timestamp(), r["CapacityReservationId"]) for r in reservations if r.get("EndDate"))
    if not ends:
        return None
    end, block = ends[0]
    return Deadline(stop_at=end - TERMINATION_LEAD_S - SAFETY_MARGIN_S, block_id=block, block_ends=end,
                    reason=f"the capacity block {block} ends at {iso(end)} (its nodes go from "
                           f"{iso(end - TERMINATION_LEAD_S)})")


def extended(deadline: Deadline, environ=None, client=None) -> Deadline | None:
    """The run's stop time read again from EC2 when ``deadline`` is a Capacity Block's and its blocks now
    end later (an extension keeps the block's id), else None: not a block's, not extended, EC2 not
    reachable, or the nodes on a managed node group (:data:`CAPACITY_BLOCK_NODES_ENV`), whose
    scale-down EKS set at the block's first end. Each but the first is said on stderr."""
    if deadline.block_id is None:
        return None
    environ = os.environ if environ is None else environ
    try:
        later = _blocks_deadline(environ, client)
    except Exception as error:  # noqa: BLE001 - the run stops as planned
        print(f"[train] WARNING: could not read the end of capacity block(s) {_named(environ)} again ({_said(error)}); "
              f"the run stops as planned, by {iso(deadline.stop_at)}", file=sys.stderr, flush=True)
        return None
    if later is None or later.stop_at <= deadline.stop_at:
        return None
    if environ.get(CAPACITY_BLOCK_NODES_ENV, "node-group") != "karpenter":
        print(f"[train] WARNING: {later.reason.replace('the capacity block', 'the capacity block (extended)', 1)}, but "
              "the GPU nodes run in a managed node group, which EKS scales to 0 at 40 min before the block's first end "
              "(its scheduled action 'Amazon EKS Node Group Capacity Scaledown Before Reservation End' is not known to "
              f"move with an extension): the run stops as planned, by {iso(deadline.stop_at)}; resume it with "
              "`ray-train-eks submit --resume <run>` once the group's scheduled action is moved (docs/capacity.md)",
              file=sys.stderr, flush=True)
        return None
    return later


def ec2_client(environ):
    """EC2 in the pods' region: ``AWS_REGION``, else the notification topic's, else boto3's default."""
    import boto3
    from botocore.config import Config

    from ..telemetry.notify import TOPIC_ENV

    topic = (environ.get(TOPIC_ENV) or "").split(":")
    region = environ.get("AWS_REGION") or environ.get("AWS_DEFAULT_REGION") or (topic[3] if len(topic) > 3 else None)
    return boto3.client("ec2", region_name=region or None,
                        config=Config(connect_timeout=3, read_timeout=5, retries={"total_max_attempts": 3, "mode": "standard"}))


def now() -> float:
    """The clock the loop decides by (a test's to set)."""
    return time.time()


def should_stop(now: float, stop_at: float, *, step_seconds: float, checkpoint_seconds: float | None) -> bool:
    """Whether the run must checkpoint and stop now: the next step and a checkpoint (its last
    measured time; unmeasured: as long as a step), with a step's time to spare, would end after
    ``stop_at``."""
    checkpoint = checkpoint_seconds if checkpoint_seconds is not None else step_seconds
    return now + 2 * step_seconds + checkpoint >= stop_at


def time_left(seconds: float) -> str:
    """``2 h 10 min``, ``7 min``."""
    minutes = int(max(0.0, seconds) // 60)
    return f"{minutes // 60} h {minutes % 60} min" if minutes >= 60 else f"{minutes} min"
