"""The account checks of the GPU nodes' capacity reservations (On-Demand Capacity Reservations
and EC2 Capacity Blocks for ML), run by ``account_checks.py`` when its resource has the
``Reservations`` property. No CDK here: :class:`ReservationRequest` is what the construct is
given, and the rest runs in the function.

What synth cannot see and a launch would find 15 to 40 minutes in: a reservation that does not
exist in this account and region (``DescribeCapacityReservations``), is not ``active`` or
``scheduled``, holds another instance type, lies in another AZ (a reservation is zonal), is of
the other reservation type (a launch names the market type: ``capacity-block`` or not), or holds
fewer instances than the job's nodes (Karpenter's spare node is a note: its replacement takes the
slot the node it replaces frees); a managed node group cannot launch into an On-Demand Capacity
Reservation before its start date (Karpenter waits for it; a Capacity Block's node group is made
before its block and launches when it starts: EKS user guide, "Create a managed node group with
Capacity Blocks for ML"); an On-Demand Capacity Reservation made in a cluster placement group is
launched into in that group (``gpuPlacementGroup``); a reservation shared from another account
(its ``OwnerId``) cannot be a member of the node group's capacity reservation group, which names
members by ARN in this account; an interruptible reservation is refused (:data:`INTERRUPTIBLE`).
A Capacity Block's nodes go from 40 minutes before its end (EKS's scale-down of a node group,
Karpenter's own drain; EC2 terminates from 30: EC2 User Guide, "Work with Capacity Blocks"): a
block that ends before the job's deadline does not fail the deploy; its end is told
(``ReservationEnds``), and the run checkpoints and stops before it.

Selected by tags (Karpenter's ``capacityReservationSelectorTerms``), a reservation that cannot
hold the nodes is left out, as Karpenter leaves it out, and noted; the deploy fails only when
none can. Named by id, each must hold them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

#: The states a reservation can take the nodes in: now, or from its start date.
USABLE_STATES = ("active", "scheduled")
#: What to do about a reservation in each other state (what the state means: EC2 API Reference,
#: ``CapacityReservation`` ``State``).
STATE_FIXES = {
    "expired": "create or buy another and deploy with its id",
    "cancelled": "create or buy another and deploy with its id",
    "cancelling": "create or buy another and deploy with its id",
    "pending": "EC2 is still provisioning it; deploy again once it is active",
    "failed": "EC2 could not fulfil it (capacity or instance limits); create another and deploy with its id",
    "payment-pending": "its upfront payment is not processed yet; deploy again once it is scheduled or active",
    "payment-failed": "EC2 released it; buy another and deploy with its id",
    "assessing": "EC2 is assessing the future-dated request; deploy again once it is scheduled",
    "delayed": "EC2 cannot deliver it by its start date; deploy again once it is active, or use another",
    "unsupported": "EC2 will not deliver it; create another and deploy with its id",
    "unavailable": "use another reservation",
}
#: The platform of the nodes' AMI (Amazon Linux 2023): a reservation of another platform takes none of them.
PLATFORM = "Linux/UNIX"
#: The longest ``ReservationNote`` (CloudFormation takes a 4,096-byte response; the log has all of it).
MAX_NOTE = 1000
#: A Capacity Block's nodes go from 40 minutes before its end date: EKS scales a node group on it to 0
#: then, Karpenter drains its nodes then (pkg/controllers/capacityreservation/expiration), and EC2
#: terminates what is left from 30 minutes before.
BLOCK_WIND_DOWN = timedelta(minutes=40)
#: DescribeCapacityReservations' answers for ids that are not this account's and region's.
NOT_FOUND = ("InvalidCapacityReservationId.NotFound", "InvalidCapacityReservationId.Malformed")
RESERVATION_TYPES = {"default": "an On-Demand Capacity Reservation", "capacity-block": "a Capacity Block"}
#: Why an interruptible reservation (DescribeCapacityReservations ``Interruptible``) is refused. Its owner
#: reclaims its instances with two minutes' warning (EC2 User Guide, "Interruptible Capacity
#: Reservations"; the "EC2 Capacity Reservation Instance Interruption Warning" event). Karpenter 1.14.1
#: launches into one with market type ``interruptible-capacity-reservation``, after every other
#: reservation, and drains the node at the warning (launchtemplate/types.go, instance/filter/filter.go,
#: the interruption controller); but the GPU workers' preStop drain runs up to their grace period (300 s
#: by default) to checkpoint, and a reclaim two minutes in would cut it off and count as a failure, not
#: a preemption (ray_train_eks/workload/drain_hook.py). A node group's launch template names no such
#: market type at all. Spot's two-minute notice is what the run is built for (a 90-s drain deadline).
INTERRUPTIBLE = ("is interruptible: its owner may reclaim its instances with two minutes' warning, too short for the "
                 "GPU workers' checkpoint at the notice (they drain for up to their 300-s grace), so a reclaim would "
                 "count as a failure; name a reservation that is not interruptible, or use Spot (-c "
                 "gpuCapacityType=spot), whose two-minute notice the run is built for")


@dataclass(frozen=True)
class ReservationRequest:
    """The reservations the GPU nodes launch into, as the account checks read them.

    :param ids: ``cr-...`` ids (empty when selecting by ``tags``).
    :param tags: select the reservations by these tags (Karpenter only; empty when ``ids`` are given).
    :param reservation_type: ``default`` (On-Demand Capacity Reservations) or ``capacity-block``.
    :param reserved_only: no fallback to Spot or On-Demand: the reservations must hold every node.
    :param node_group: the nodes are a managed node group (which cannot launch before a reservation
        starts), not Karpenter's (which waits for it).
    :param deadline_seconds: the job's ``activeDeadlineSeconds``, against a Capacity Block's end.
    :param placement_group: the placement group the nodes launch in, against an ODCR's own.
    """

    ids: tuple[str, ...] = ()
    tags: dict[str, str] = field(default_factory=dict)
    reservation_type: str = "default"
    reserved_only: bool = True
    node_group: bool = True
    deadline_seconds: int | None = None
    #: The existing cluster placement group the nodes launch in (``gpuPlacementGroup``), or None.
    placement_group: str | None = None

    def problems(self) -> list[str]:
        """Why the checks cannot read the reservations so (each with its fix), or none."""
        found = []
        if bool(self.ids) == bool(self.tags):
            found.append(f"reservations ids={list(self.ids)} tags={dict(self.tags)}: select the reservations one way, "
                         "ids=('cr-0123456789abcdef0',) or tags={'team': 'ml'}")
        if self.tags and self.node_group:
            found.append(f"reservations tags={dict(self.tags)} with node_group=True: a node group's launch template "
                         "names its reservations; give ids, or use Karpenter (node_group=False)")
        if self.reservation_type not in RESERVATION_TYPES:
            found.append(f"reservations reservation_type={self.reservation_type!r}: use 'default' (On-Demand Capacity "
                         "Reservations) or 'capacity-block'")
        if self.deadline_seconds is not None and self.deadline_seconds <= 0:
            found.append(f"reservations deadline_seconds={self.deadline_seconds}: give the job's activeDeadlineSeconds "
                         "(> 0), or None")
        return found

    def property(self, *, nodes: int, spare: int) -> dict:
        """The resource's ``Reservations`` property: the request, and the nodes the reservations
        are to hold (the GPU nodes, and Karpenter's ``spare``)."""
        return {"Ids": list(self.ids), "Tags": dict(sorted(self.tags.items())), "Type": self.reservation_type,
                "ReservedOnly": self.reserved_only, "NodeGroup": self.node_group,
                "DeadlineSeconds": self.deadline_seconds, "Nodes": nodes, "Spare": spare,
                **({"PlacementGroup": self.placement_group} if self.placement_group else {})}


@dataclass
class Assessment:
    """What the reservations mean for the deploy: problems fail it; notes and the earliest end
    of a Capacity Block are told (``ReservationNote``, ``ReservationEnds``)."""

    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    ends: str = "none"


def request_of(props: dict) -> dict | None:
    """The ``Reservations`` property (None: the nodes use no reservation)."""
    value = props.get("Reservations")
    return json.loads(value) if value else None


def selection(spec: dict) -> str:
    """How the deploy named the reservations, as the context key that did."""
    if spec["Ids"]:
        return "capacityReservationIds=" + ",".join(spec["Ids"])
    return "capacityReservationTags=" + ",".join(f"{k}={v}" for k, v in spec["Tags"].items())


def describe(ec2, spec: dict) -> tuple[list[dict], str | None]:
    """The reservations the request selects, and EC2's message when an id is not found
    (other errors raise: a refused call)."""
    from botocore.exceptions import ClientError

    if spec["Ids"]:
        params = {"CapacityReservationIds": spec["Ids"]}
    else:
        params = {"Filters": [{"Name": f"tag:{k}", "Values": [v]} for k, v in spec["Tags"].items()]}
    found: list[dict] = []
    try:
        for page in ec2.get_paginator("describe_capacity_reservations").paginate(**params):
            found.extend(page["CapacityReservations"])
    except ClientError as error:
        if error.response.get("Error", {}).get("Code") not in NOT_FOUND:
            raise
        return [], f"{error.response['Error']['Code']}: {error.response['Error'].get('Message', '')}"
    return found, None


def _utc(value: datetime | None) -> datetime | None:
    if value is None:
        return None
    return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)


def iso(value: datetime) -> str:
    """``2026-12-05T11:30:00Z``."""
    return _utc(value).strftime("%Y-%m-%dT%H:%M:%SZ")


def faults(reservation: dict, spec: dict, *, instance_type: str, availability_zone: str, offered_in: list[str] | None,
           now: datetime, account: str | None = None) -> list[str]:
    """Why ``reservation`` cannot hold the GPU nodes, each with its fix (``account``: the stack's)."""
    found = []
    state, start, end = reservation.get("State", ""), _utc(reservation.get("StartDate")), _utc(reservation.get("EndDate"))
    kind = reservation.get("ReservationType") or "default"
    if state not in USABLE_STATES:
        found.append(f"is {state}: {STATE_FIXES.get(state, 'use an active or scheduled reservation')}")
    elif end is not None and end <= now:
        found.append(f"ended at {iso(end)}: create or buy another and deploy with its id")
    elif state == "scheduled" and spec["NodeGroup"] and kind != "capacity-block":
        found.append(f"starts at {iso(start) if start else 'its start date'} (scheduled): a managed node group cannot "
                     "launch into it before; deploy after it starts, or with -c gpuCapacity=karpenter, which waits for it")
    elif state == "scheduled" and spec["NodeGroup"] and start is not None and start - now > SCHEDULED_LEAD:
        # The group's launches fail until the block starts (EKS user guide, Capacity Blocks for ML), and
        # Auto Scaling suspends a group whose launches have failed for about a day (EC2 Auto Scaling
        # User Guide, "Suspend and resume processes": "trying to launch instances for over 24 hours").
        found.append(f"starts at {iso(start)}, more than a day from now: the node group's launches fail until then, and "
                     "Auto Scaling suspends a group whose launches fail for a day, after which no node comes; deploy "
                     f"within {SCHEDULED_LEAD.total_seconds() / 3600:.0f} hours of its start, or with "
                     "-c gpuCapacity=karpenter, which waits for it")
    owner = reservation.get("OwnerId")
    if spec["NodeGroup"] and len(spec["Ids"]) > 1 and account and owner and owner != account:
        found.append(f"is shared with this account by {owner}: the node group launches into a capacity reservation group "
                     f"of the reservations, whose members are named by ARN in this account ({account}), where EC2 has "
                     "no such reservation; name it alone (a launch template targets a shared reservation by its id), "
                     "or use -c gpuCapacity=karpenter, which selects shared reservations by id")
    if reservation.get("Interruptible"):
        found.append(INTERRUPTIBLE)
    held = reservation.get("InstanceType")
    if held != instance_type:
        found.append(f"holds {held}, not {instance_type}: deploy with -c gpuInstanceType={held}, or name a "
                     f"reservation of {instance_type}")
    zone = reservation.get("AvailabilityZone")
    if zone != availability_zone:
        other = next((z for z in sorted(offered_in or []) if z != zone), "<another AZ>")
        found.append(f"is in {zone}, not in {availability_zone} (the GPU nodes' AZ): deploy with "
                     f"-c availabilityZones={zone},{other} (the GPU nodes use the first)")
    platform, tenancy = reservation.get("InstancePlatform", PLATFORM), reservation.get("Tenancy", "default")
    if platform != PLATFORM or tenancy != "default":
        found.append(f"is for {platform} instances of {tenancy} tenancy; the nodes boot Amazon Linux 2023 ({PLATFORM}) with "
                     "default tenancy: name a reservation of those")
    group = (reservation.get("PlacementGroupArn") or "").rpartition("placement-group/")[2]
    if group and group != spec.get("PlacementGroup"):
        found.append(f"was made in the cluster placement group {group}: deploy with -c gpuPlacementGroup={group}, so that "
                     "the nodes launch into it in that group (a launch in another group finds no room in it)")
    if kind != spec["Type"]:
        found.append(f"is {RESERVATION_TYPES.get(kind, kind)} (ReservationType {kind}), not "
                     f"{RESERVATION_TYPES.get(spec['Type'], spec['Type'])}: deploy with -c capacityReservationType={kind}")
    return found


#: How early a node group may be made before its Capacity Block starts (see ``faults``).
SCHEDULED_LEAD = timedelta(hours=20)
#: Before a Capacity Block starts its available capacity reads zero; this tag holds what it will
#: hold (EC2 User Guide, "View Capacity Blocks"; AWS ParallelCluster sizes a block the same way).
BLOCK_SIZE_TAG = "aws:ec2capacityreservation:incrementalRequestedQuantity"


def _room(reservation: dict, update: bool = False) -> int:
    """Instances the nodes can take in ``reservation``: what is free of an active one (on an update all
    of it: the nodes running there are ours), all of a scheduled one (a scheduled Capacity Block's size
    from its tag when its counts read zero)."""
    if update and reservation.get("State") == "active":
        return int(reservation.get("TotalInstanceCount", 0))
    if reservation.get("State") == "scheduled":
        tagged = [t.get("Value", "") for t in reservation.get("Tags", []) if t.get("Key") == BLOCK_SIZE_TAG]
        size = int(tagged[0]) if tagged and tagged[0].isdigit() else 0
        return max(int(reservation.get("TotalInstanceCount", 0)), size)
    return int(reservation.get("AvailableInstanceCount", 0))


def _count(spec: dict, usable: list[dict], *, instance_type: str, update: bool = False) -> tuple[list[str], list[str]]:
    """Problems and notes about the instances the usable reservations hold against the nodes: fewer
    than the nodes fails a run on the reservations alone; no room for Karpenter's spare is a note (its
    replacement takes the slot the node taken out frees, once that node is gone)."""
    nodes, spare = int(spec["Nodes"]), int(spec.get("Spare", 0))
    have = sum(_room(r, update) for r in usable)
    detail = ", ".join(f"{r['CapacityReservationId']} {_room(r, update)} of {r.get('TotalInstanceCount', 0)}" for r in usable)
    if have >= nodes + spare:
        return [], []
    if have >= nodes:
        return [], [f"the reservations have room for the {nodes} GPU node(s) but not for Karpenter's spare ({detail}): a "
                    "node taken out of a run is replaced once it is gone and its slot free"]
    if spec["ReservedOnly"]:
        fewer = f"deploy with -c gpuNodeCount={have}, " if have >= 1 else ""
        return [f"{selection(spec)}: the reservations have room for {have} {instance_type} instance(s) ({detail or 'none'}), "
                f"the job needs {nodes} GPU node(s) (instances already running in a reservation take its room): add "
                f"instances to a reservation or name another, {fewer}or let the rest fall back: -c gpuCapacity=karpenter "
                "-c gpuCapacityType=reserved,on-demand"], []
    return [], [f"the reservations have room for {have} of the {nodes} nodes; the other {nodes - have} come from the "
                "capacity types after reserved (Spot or On-Demand)"]


def _block_end(spec: dict, usable: list[dict], now: datetime) -> tuple[str, list[str]]:
    """The earliest end of the usable Capacity Blocks, and a note when it comes before the deadline."""
    blocks = [r for r in usable if (r.get("ReservationType") or "default") == "capacity-block" and r.get("EndDate")]
    if not blocks:
        return "none", []
    first = min(blocks, key=lambda r: _utc(r["EndDate"]))
    end, start = _utc(first["EndDate"]), max(now, _utc(first.get("StartDate")) or now)
    deadline = spec.get("DeadlineSeconds")
    if deadline and end - BLOCK_WIND_DOWN < start + timedelta(seconds=int(deadline)):
        return iso(end), [f"the Capacity Block {first['CapacityReservationId']} ends at {iso(end)} (its nodes go "
                          f"from {iso(end - BLOCK_WIND_DOWN)}), before the job's deadline ({deadline} s from "
                          f"{iso(start)}): the run checkpoints and stops before then; extend the block to run to the deadline"]
    return iso(end), []


def assess(spec: dict, found: list[dict] | None, missing: str | None, *, instance_type: str, availability_zone: str,
           offered_in: list[str] | None, now: datetime, update: bool = False, account: str | None = None) -> Assessment:
    """Every problem and note of the reservations ``found`` (None: the call was refused), for the stack's ``account``."""
    result = Assessment()
    if found is None:
        return result
    if missing:
        result.problems.append(f"{selection(spec)}: {missing}; check the ids in this account and region (aws ec2 "
                               "describe-capacity-reservations), or share the reservation with this account")
        return result
    if not found:
        result.problems.append(f"{selection(spec)}: no capacity reservation of this account and region has these tags: "
                               "tag the reservations (aws ec2 create-tags), or name them with -c capacityReservationIds")
        return result
    checked = {r["CapacityReservationId"]: faults(r, spec, instance_type=instance_type, availability_zone=availability_zone,
                                                  offered_in=offered_in, now=now, account=account) for r in found}
    usable = [r for r in found if not checked[r["CapacityReservationId"]]]
    unusable = "; ".join(f"{rid} {', and '.join(why)}" for rid, why in checked.items() if why)
    interruptible = [rid for rid, why in checked.items() if INTERRUPTIBLE in why]
    if spec["Tags"] and interruptible:
        # Karpenter does not leave these out: it launches into them once the others are full.
        result.problems.append(f"{selection(spec)}: {', '.join(interruptible)} {INTERRUPTIBLE}; untag them, or name "
                               "the others with -c capacityReservationIds")
    if spec["Ids"] and unusable:
        result.problems.extend(f"{selection(spec)}: {rid} {'; it '.join(why)}" for rid, why in checked.items() if why)
    elif not usable:
        result.problems.append(f"{selection(spec)}: none of the {len(found)} reservation(s) these tags select can "
                               f"hold the nodes: {unusable}; or select others by their tags")
    else:
        if unusable:
            result.notes.append(f"left out (as Karpenter leaves them out): {unusable}")
        count_problems, count_notes = _count(spec, usable, instance_type=instance_type, update=update)
        result.problems += count_problems
        result.notes += count_notes
        result.ends, end_notes = _block_end(spec, usable, now)
        result.notes += end_notes
        result.notes += [f"{r['CapacityReservationId']} starts at {iso(_utc(r['StartDate']))}: the node group is made now, "
                         "and EKS launches its nodes when the block starts" for r in usable
                         if spec["NodeGroup"] and r.get("State") == "scheduled" and r.get("StartDate")]
    return result


def handover_problems(old_spec: dict | None, spec: dict, found: list[dict] | None, *, now: datetime) -> list[str]:
    """A node group moved to another Capacity Block while its current one still runs its nodes: the
    new block's group replaces the current one, which CloudFormation deletes as soon as the new one
    exists (a replacement's clean-up), ending the run and the rest of the paid block. ``found``: the
    old blocks as EC2 describes them now."""
    if not old_spec or not spec["NodeGroup"] or old_spec.get("Type") != "capacity-block" or not found:
        return []
    if set(old_spec.get("Ids") or ()) == set(spec["Ids"]):
        return []
    problems = []
    for block in found:
        end = _utc(block.get("EndDate"))
        used = int(block.get("TotalInstanceCount", 0)) - int(block.get("AvailableInstanceCount", 0))
        if block.get("State") == "active" and end is not None and end - BLOCK_WIND_DOWN > now and used > 0:
            problems.append(f"the Capacity Block {block['CapacityReservationId']} still runs {used} of the GPU nodes (it "
                            f"ends at {iso(end)}): deploying {', '.join(spec['Ids'])} replaces its node group at once, ending "
                            f"the run on it and the rest of the block; deploy the next block after "
                            f"{iso(end - BLOCK_WIND_DOWN)} (when EKS empties the old group), or, to give up the rest of "
                            "it, stop the run (ray-train-eks stop) and deploy with -c skipAccountChecks=true")
    return problems
