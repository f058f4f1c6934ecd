"""What the GPU nodes are bought as: On-Demand, Spot, or reserved capacity (On-Demand Capacity
Reservations and EC2 Capacity Blocks for ML), and in which order Karpenter falls back from one to
the next. The rules of a managed node group's and Karpenter's props and of the context keys
(``gpuCapacityType``, ``capacityReservationIds``, ``capacityReservationTags``,
``capacityReservationType``). No CDK here.

- A managed node group has one capacity type (EKS ``CreateNodegroup``: ``ON_DEMAND``, ``SPOT`` or
  ``CAPACITY_BLOCK``); its launch template names the reservation (or a capacity reservation group of
  several), so it has no fallback.
- Karpenter 1.14.1 takes the capacity types a NodePool allows in one order, whatever the
  requirement lists: a reserved offering first, then Spot, then On-Demand
  (``karpenter.sh/capacity-type``; reserved offerings are priced near zero so that they win, and
  Karpenter launches into another type only once the reservations in the EC2NodeClass's
  ``capacityReservationSelectorTerms`` have no room). The order a user writes must be that one:
  a subset of it is the choice (``reserved``: the reservations only; ``reserved,on-demand``;
  ``reserved,spot,on-demand``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from ray_train_eks.validation import Prop

#: Karpenter's order of preference among capacity types, which a written order must follow.
CAPACITY_TYPES = ("reserved", "spot", "on-demand")
#: EC2's reservation types (DescribeCapacityReservations ``ReservationType``; Karpenter's
#: ``karpenter.k8s.aws/capacity-reservation-type`` label): an On-Demand Capacity Reservation, or a
#: Capacity Block for ML.
RESERVATION_TYPES = ("default", "capacity-block")
_CAPACITY_RESERVATION = re.compile(r"^cr-[0-9a-f]{17}$")
#: EC2 tag keys and values (``aws:`` keys are AWS's); what the selector term's tags take.
_TAG = re.compile(r"^([^=]{1,128})=(.{0,256})$")


@dataclass(frozen=True)
class GpuCapacityChoice:
    """The GPU nodes' capacity: the types in order of preference, and the reservations."""

    order: tuple[str, ...] = ("on-demand",)
    reservation_ids: tuple[str, ...] = ()
    reservation_tags: Mapping[str, str] = field(default_factory=dict)
    reservation_type: str = "default"

    @property
    def reserved(self) -> bool:
        """Whether the nodes may launch into reservations."""
        return "reserved" in self.order

    @property
    def reserved_only(self) -> bool:
        """Whether every node must come from the reservations (no fallback)."""
        return self.order == ("reserved",)

    @property
    def spot(self) -> bool:
        """Whether Spot nodes may come (their two-minute notice shapes the drain)."""
        return "spot" in self.order

    @property
    def capacity_block(self) -> bool:
        """Whether the reservations are Capacity Blocks (EC2 reclaims their instances at the end)."""
        return self.reserved and self.reservation_type == "capacity-block"


def parse_order(value: str | Sequence[str]) -> tuple[str, ...]:
    """``reserved,spot,on-demand`` as a tuple (a sequence passes through, stripped)."""
    items = value.split(",") if isinstance(value, str) else list(value)
    return tuple(item.strip() for item in items if item.strip())


def resolve_order(value: str | Sequence[str], *, reserved: bool, karpenter: bool) -> tuple[str, ...]:
    """The capacity types in order: empty means ``reserved`` when reservations are named, else
    ``on-demand``; ``spot`` alone with Karpenter keeps its meaning from before reservations, Spot
    then On-Demand (the NodePool always had the fallback)."""
    order = parse_order(value)
    if not order:
        return ("reserved",) if reserved else ("on-demand",)
    if karpenter and order == ("spot",):
        return ("spot", "on-demand")
    return order


def named_reservations(ids: Sequence[str], single: str | None = None) -> tuple[str, ...]:
    """The reservations named by id: ``ids`` (``capacityReservationIds``), or the earlier ``single``
    (``capacityReservationId``)."""
    return tuple(ids) or ((single,) if single else ())


def capacity_choice(order: str | Sequence[str], *, ids: Sequence[str], tags: Sequence[str] | Mapping[str, str],
                    reservation_type: str, karpenter: bool) -> GpuCapacityChoice:
    """What the GPU nodes are bought as, in order (:func:`resolve_order`), and the reservations."""
    parsed = parse_tags(tags)
    return GpuCapacityChoice(order=resolve_order(order, reserved=bool(ids or parsed), karpenter=karpenter),
                             reservation_ids=tuple(ids), reservation_tags=parsed, reservation_type=reservation_type)


def capacity_order_problem(value: str | Sequence[str], prop: Prop = Prop("capacity_types"), *, reserved: bool,
                           karpenter: bool, reservation_prop: Prop = Prop("capacity_reservation_ids")) -> str | None:
    """Why the GPU nodes cannot be bought in the order ``value``, or None."""
    order = parse_order(value)
    shown = ",".join(order)
    unknown = [item for item in order if item not in CAPACITY_TYPES]
    if unknown:
        return (f"{prop(shown)}: {', '.join(map(repr, unknown))} is not a capacity type; use on-demand, spot, or "
                "reserved (with capacity reservations), or an order of them for Karpenter, e.g. "
                f"{prop.example('reserved,on-demand')}")
    if len(set(order)) != len(order):
        return f"{prop(shown)}: a capacity type is named twice; name each once, e.g. {prop.example('reserved,spot,on-demand')}"
    if list(order) != sorted(order, key=CAPACITY_TYPES.index):
        return (f"{prop(shown)}: Karpenter takes reserved capacity first, then Spot, then On-Demand, whatever the "
                f"order written; write them in that order, e.g. {prop.example(','.join(sorted(order, key=CAPACITY_TYPES.index)))}")
    if "reserved" in order and not reserved:
        return (f"{prop(shown)}: reserved needs capacity reservations; name them with "
                f"{reservation_prop.example('cr-0123456789abcdef0')}" + (" or by their tags" if karpenter else "")
                + ", or drop reserved")
    if reserved and order and "reserved" not in order:
        fix = ",".join(("reserved", *order)) if karpenter else "reserved"
        return (f"{prop(shown)} leaves the named capacity reservations out (a reservation holds On-Demand capacity); "
                f"use {prop.example(fix)}, or name no reservation")
    if not karpenter and len(order) > 1:
        return (f"{prop(shown)}: a managed node group has one capacity type, so no fallback; use "
                f"{prop.example(order[0])}, or -c gpuCapacity=karpenter for {shown} in that order")
    return None


def reservation_ids_problem(ids: Sequence[str], prop: Prop = Prop("capacity_reservation_ids")) -> str | None:
    """Why ``ids`` are not capacity reservation ids, or None."""
    bad = [item for item in ids if not _CAPACITY_RESERVATION.match(item)]
    if bad:
        return (f"{prop(','.join(ids))}: {', '.join(map(repr, bad))} is not a capacity reservation id; use the form "
                "cr-0123456789abcdef0 (17 hex digits)")
    repeated = sorted({item for item in ids if list(ids).count(item) > 1})
    if repeated:
        return f"{prop(','.join(ids))}: {', '.join(repeated)} named twice; name each reservation once"
    return None


def parse_tags(items: Sequence[str] | Mapping[str, str]) -> dict[str, str]:
    """``key=value`` items (or a mapping) as a dict; items that are not ``key=value`` are dropped
    (:func:`reservation_tags_problem` names them)."""
    if isinstance(items, Mapping):
        return dict(items)
    return {m.group(1).strip(): m.group(2).strip() for item in items if (m := _TAG.match(item))}


#: Karpenter 1.14.1's EC2NodeClass: at most 20 tags in a selector term, none of them empty (its CEL rule).
MAX_SELECTOR_TAGS = 20
#: Karpenter 1.14.1's EC2NodeClass: at most 30 ``capacityReservationSelectorTerms`` (the CRD's ``maxItems``,
#: karpenter.k8s.aws_ec2nodeclasses.yaml), and the EC2NodeClass has one term per reservation id.
MAX_SELECTOR_TERMS = 30


def reservation_tags_problem(items: Sequence[str] | Mapping[str, str], prop: Prop = Prop("capacity_reservation_tags")) -> str | None:
    """Why ``items`` cannot select reservations by tag, or None: each ``key=value`` with neither
    empty (Karpenter's CRD refuses an empty key or value), at most :data:`MAX_SELECTOR_TAGS`."""
    pairs = [f"{k}={v}" for k, v in items.items()] if isinstance(items, Mapping) else list(items)
    shown = prop(",".join(pairs))
    bad = [item for item in pairs if not (m := _TAG.match(item)) or not m.group(1).strip() or not m.group(2).strip()]
    if bad:
        return (f"{shown}: {', '.join(map(repr, bad))} is not key=value with both set (Karpenter refuses an empty key or "
                f"value); e.g. {prop.example('team=ml,purpose=training')}")
    if len(pairs) > MAX_SELECTOR_TAGS:
        return f"{shown}: {len(pairs)} tags; Karpenter's selector takes at most {MAX_SELECTOR_TAGS}"
    return None


def reservation_type_problem(value: str, prop: Prop = Prop("reservation_type")) -> str | None:
    """Why ``value`` is not a reservation type, or None."""
    if value not in RESERVATION_TYPES:
        return (f"{prop(value)}: use default (On-Demand Capacity Reservations) or capacity-block (EC2 Capacity Blocks "
                "for ML)")
    return None


def reservation_selection_problem(ids: Sequence[str], tags: Mapping[str, str], *, karpenter: bool, reservation_type: str,
                                  ids_prop: Prop = Prop("capacity_reservation_ids"),
                                  tags_prop: Prop = Prop("capacity_reservation_tags")) -> str | None:
    """Why the reservations cannot be selected so, or None: by ids or by tags, not both; by tags
    with Karpenter only (a launch template names its reservations); several Capacity Blocks with
    Karpenter only (a node group launches into one); with Karpenter at most :data:`MAX_SELECTOR_TERMS` ids."""
    if ids and tags:
        return (f"{ids_prop(','.join(ids))} and {tags_prop.name}: select the reservations one way; drop "
                f"{tags_prop.name} or {ids_prop.name}")
    if tags and not karpenter:
        return (f"{tags_prop.name} with gpuCapacity=nodegroup: a node group's launch template names its reservations; "
                f"use {ids_prop.example('cr-0123456789abcdef0')}, or -c gpuCapacity=karpenter to select by tags")
    if karpenter and len(ids) > MAX_SELECTOR_TERMS:
        return (f"{ids_prop.name} names {len(ids)} reservations; Karpenter's EC2NodeClass takes at most "
                f"{MAX_SELECTOR_TERMS} (one selector term each): name at most {MAX_SELECTOR_TERMS}, or tag them and "
                f"select them with {tags_prop.example('team=ml')}")
    if not karpenter and reservation_type == "capacity-block" and len(ids) > 1:
        return (f"{ids_prop(','.join(ids))} with capacity-block: a node group launches into one Capacity Block (its "
                "launch template targets one reservation); name one, or use -c gpuCapacity=karpenter for several")
    return None


def placement_group_problem(name: str | None, prop: Prop = Prop("placement_group_name"), *,
                            reservation_type: str = "default") -> str | None:
    """Why ``name`` cannot name an existing placement group for the nodes, or None (EC2: up to 255
    ASCII characters; none with Capacity Blocks, which sit in one UltraCluster: AWS advises no
    placement group with them, and AWS ParallelCluster's validator warns that one makes launches
    fail for capacity with room left in the block)."""
    if name is None:
        return None
    if not re.match(r"^[\x21-\x7e]{1,255}$", name):
        return (f"{prop(name)}: not a placement group name (1 to 255 printable ASCII characters, no spaces); "
                "aws ec2 describe-placement-groups lists yours")
    if reservation_type == "capacity-block":
        return (f"{prop(name)} with capacity-block: a Capacity Block's instances sit in one EC2 UltraCluster already, and "
                "a placement group makes its launches fail for capacity with room left in it; drop the placement group")
    return None
