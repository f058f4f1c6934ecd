"""The rules of a node's disks: where containerd and kubelet keep their state (NVMe instance
storage or the gp3 root volume, ray_train_eks/constructs/launch_templates.py), the root
volume's size, and gp3's throughput and IOPS."""

from __future__ import annotations

from dataclasses import dataclass

from ray_train_eks.instances import INSTANCE_TYPES
from ray_train_eks.validation import Prop

#: The root volume when containerd and kubelet live on NVMe: the AL2023 OS takes a few GB; the
#: rest is room for the journal and the host's logs, and a margin.
ROOT_GIB_WITH_INSTANCE_STORE = 50
MIN_ROOT_GIB_WITH_INSTANCE_STORE = 20
#: The gp3 root volume's throughput and IOPS on a type without instance storage: an unpack of
#: ~30 GB takes about 75 s at 400 MiB/s instead of 4 minutes at gp3's baseline 125 MiB/s
#: (the extra 275 MiB/s and 1,000 IOPS bill about 16 USD a month per node; gp3 goes to 2,000
#: MiB/s and 80,000 IOPS).
PULL_THROUGHPUT_MIBPS = 400
PULL_IOPS = 4000


@dataclass(frozen=True)
class NodeDisks:
    """How a node of one type keeps its state: on NVMe (``instance_store``) or on the root volume."""

    instance_store: bool
    root_volume_gib: int
    #: gp3 throughput and IOPS of the root volume; None: gp3's baseline (the root holds the OS only).
    throughput_mibps: int | None = None
    iops: int | None = None


#: The root volume of a GPU node without instance storage: the DLC image (tens of GB unpacked,
#: plus its compressed layers while pulling), the model cache and checkpoint staging.
GPU_ROOT_GIB_WITHOUT_INSTANCE_STORE = 200


def node_disks(instance_type: str, *, root_volume_gib: int | None = None,
               without_instance_store_gib: int = GPU_ROOT_GIB_WITHOUT_INSTANCE_STORE,
               throughput_mibps: int = PULL_THROUGHPUT_MIBPS, iops: int = PULL_IOPS) -> NodeDisks:
    """The disks of ``instance_type`` nodes, chosen from the instance table: NVMe when the type
    has it (a 50 GiB root), else a root of ``without_instance_store_gib`` with pull throughput.
    ``root_volume_gib`` overrides the size only."""
    spec = INSTANCE_TYPES.get(instance_type)
    if spec is not None and spec.instance_store_gb:
        return NodeDisks(True, root_volume_gib or ROOT_GIB_WITH_INSTANCE_STORE)
    return NodeDisks(False, root_volume_gib or without_instance_store_gib, throughput_mibps, iops)


def root_volume_problem(size_gib: int | None, instance_type: str, *, minimum_without_instance_store: int,
                        default_without_instance_store: int, prop: Prop, what: str) -> str | None:
    """Why a root volume of ``size_gib`` is too small for ``instance_type`` nodes, or None (the
    fix it suggests is the default of the nodes' kind)."""
    if size_gib is None:
        return None
    spec = INSTANCE_TYPES.get(instance_type)
    if spec is not None and spec.instance_store_gb:
        if size_gib < MIN_ROOT_GIB_WITH_INSTANCE_STORE:
            return (f"{prop(size_gib)}: below {MIN_ROOT_GIB_WITH_INSTANCE_STORE}, too small for the OS and its logs "
                    f"(containerd and kubelet are on {instance_type}'s NVMe); use {ROOT_GIB_WITH_INSTANCE_STORE}")
        return None
    if size_gib < minimum_without_instance_store:
        return f"{prop(size_gib)}: below {minimum_without_instance_store}, too small for {what}; use {default_without_instance_store}"
    return None


def gp3_throughput_problem(mibps: int, prop: Prop = Prop("root_volume_throughput_mibps"), *, iops: int,
                           iops_prop: Prop = Prop("root_volume_iops")) -> str | None:
    """Why a gp3 throughput of ``mibps`` cannot be, with ``iops`` provisioned, or None (gp3: 125 to
    2,000 MiB/s, at most 0.25 MiB/s per provisioned IOPS; EBS user guide, "General Purpose SSD volumes")."""
    if not 125 <= mibps <= 2000:
        return f"{prop(mibps)}: gp3 takes 125 to 2000 MiB/s; e.g. {PULL_THROUGHPUT_MIBPS}"
    if mibps > iops / 4:
        return (f"{prop(mibps)} with {iops_prop(iops)}: gp3 allows 0.25 MiB/s per IOPS; use "
                f"{iops_prop.name}={mibps * 4} or more")
    return None


def gp3_iops_problem(iops: int, prop: Prop = Prop("root_volume_iops")) -> str | None:
    """Why ``iops`` gp3 IOPS cannot be, or None."""
    if not 3000 <= iops <= 80000:
        return f"{prop(iops)}: gp3 takes 3000 to 80000 IOPS; e.g. {PULL_IOPS}"
    return None
