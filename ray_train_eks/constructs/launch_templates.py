"""Launch-template pieces every node group of the platform shares: IMDSv2, the root volume, and
the node's disks.

A node's image pull and unpack (the Ray Train DLC is tens of GB), its pods' emptyDir volumes
and their writable layers (a container's /tmp) go where containerd and kubelet keep their
state. On a type with local NVMe instance storage, AL2023's ``nodeadm`` puts that state on a
RAID0 of the NVMe disks (``NodeConfig`` ``spec.instance.localStorage.strategy: RAID0``:
``/var/lib/kubelet``, ``/var/lib/containerd``, ``/var/lib/soci-snapshotter-grpc`` and
``/var/log/pods`` are bind-mounted from ``/mnt/k8s-disks/0``; awslabs/amazon-eks-ami
``setup-local-disks``), and the root volume only holds the OS and its logs. On a type without,
the gp3 root volume holds it all, so it gets throughput and IOPS for a pull instead of gp3's
baseline 125 MiB/s and 3,000 IOPS.
"""

from __future__ import annotations

from dataclasses import dataclass

from aws_cdk import Fn, aws_ec2 as ec2

from ray_train_eks.instances import INSTANCE_TYPES
from ray_train_eks.validation import Prop

#: AL2023 EKS AMIs boot from this device.
ROOT_DEVICE = "/dev/xvda"
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
#: nodeadm's NodeConfig that puts containerd and kubelet on a RAID0 of the instance store. A
#: managed node group merges it with the NodeConfig EKS writes (cluster name, endpoint, CA):
#: launch-template user data must be MIME multipart, without a custom AMI (EKS user guide,
#: "Customizing managed nodes with launch templates").
MIME_BOUNDARY = "==RAYTRAINEKS=="
LOCAL_STORAGE_NODE_CONFIG = """\
---
apiVersion: node.eks.aws/v1alpha1
kind: NodeConfig
spec:
  instance:
    localStorage:
      strategy: RAID0
"""


def local_storage_user_data() -> str:
    """The launch-template user data (MIME multipart) carrying :data:`LOCAL_STORAGE_NODE_CONFIG`."""
    return (
        "MIME-Version: 1.0\n"
        f'Content-Type: multipart/mixed; boundary="{MIME_BOUNDARY}"\n\n'
        f"--{MIME_BOUNDARY}\n"
        "Content-Type: application/node.eks.aws\n\n"
        f"{LOCAL_STORAGE_NODE_CONFIG}\n"
        f"--{MIME_BOUNDARY}--\n"
    )


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


def node_metadata_options() -> ec2.CfnLaunchTemplate.MetadataOptionsProperty:
    """IMDSv2 only, one hop: pods get AWS credentials from EKS Pod Identity, so nothing
    in a container needs the node's instance role through IMDS."""
    return ec2.CfnLaunchTemplate.MetadataOptionsProperty(
        http_endpoint="enabled",
        http_tokens="required",
        http_put_response_hop_limit=1,
    )


def encrypted_root_volume(disks: NodeDisks) -> ec2.CfnLaunchTemplate.BlockDeviceMappingProperty:
    """An encrypted gp3 root volume of the size (and throughput and IOPS) of ``disks``, deleted with the instance."""
    return ec2.CfnLaunchTemplate.BlockDeviceMappingProperty(
        device_name=ROOT_DEVICE,
        ebs=ec2.CfnLaunchTemplate.EbsProperty(
            volume_size=disks.root_volume_gib,
            volume_type="gp3",
            encrypted=True,
            delete_on_termination=True,
            throughput=disks.throughput_mibps,
            iops=disks.iops,
        ),
    )


def launch_template_storage(disks: NodeDisks) -> dict:
    """The launch-template data of ``disks``: the root volume, and the NodeConfig for NVMe."""
    data = {"block_device_mappings": [encrypted_root_volume(disks)]}
    if disks.instance_store:
        data["user_data"] = Fn.base64(local_storage_user_data())
    return data
