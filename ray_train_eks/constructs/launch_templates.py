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

from aws_cdk import Fn, aws_ec2 as ec2

# The disks' rules and defaults live in ray_train_eks/rules/disks.py (no CDK import); imported
# back so that they stay importable from here.
from ray_train_eks.rules.disks import (
    GPU_ROOT_GIB_WITHOUT_INSTANCE_STORE,
    MIN_ROOT_GIB_WITH_INSTANCE_STORE,
    PULL_IOPS,
    PULL_THROUGHPUT_MIBPS,
    ROOT_GIB_WITH_INSTANCE_STORE,
    NodeDisks,
    gp3_iops_problem,
    gp3_throughput_problem,
    node_disks,
    root_volume_problem,
)

#: AL2023 EKS AMIs boot from this device.
ROOT_DEVICE = "/dev/xvda"
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
#: nodeadm's ``FastImagePull`` feature gate: containerd pulls through the SOCI snapshotter in its
#: parallel pull and unpack mode (awslabs/amazon-eks-ami#2352), the layers of a multi-GB image
#: fetched and unpacked concurrently instead of one after another. Its state,
#: ``/var/lib/soci-snapshotter-grpc``, is one of the directories the RAID0 layout bind-mounts from
#: the instance store (docs/capacity.md, "Faster node starts").
FAST_IMAGE_PULL_GATE = "FastImagePull"


def node_config(*, local_storage: bool, fast_image_pull: bool) -> str:
    """The nodes' own NodeConfig (YAML): the RAID0 of the instance store, the fast image pull."""
    spec = []
    if fast_image_pull:
        spec += ["  featureGates:", f"    {FAST_IMAGE_PULL_GATE}: true"]
    if local_storage:
        spec += ["  instance:", "    localStorage:", "      strategy: RAID0"]
    return "---\napiVersion: node.eks.aws/v1alpha1\nkind: NodeConfig\nspec:\n" + "\n".join(spec) + "\n"


def node_config_user_data(*, local_storage: bool = True, fast_image_pull: bool = False) -> str:
    """User data (MIME multipart) carrying :func:`node_config`, which nodeadm merges with the
    NodeConfig EKS (a managed node group) or Karpenter writes."""
    return (
        "MIME-Version: 1.0\n"
        f'Content-Type: multipart/mixed; boundary="{MIME_BOUNDARY}"\n\n'
        f"--{MIME_BOUNDARY}\n"
        "Content-Type: application/node.eks.aws\n\n"
        f"{node_config(local_storage=local_storage, fast_image_pull=fast_image_pull)}\n"
        f"--{MIME_BOUNDARY}--\n"
    )


def local_storage_user_data() -> str:
    """The launch-template user data (MIME multipart) carrying :data:`LOCAL_STORAGE_NODE_CONFIG`."""
    return node_config_user_data(local_storage=True, fast_image_pull=False)


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


def launch_template_storage(disks: NodeDisks, *, fast_image_pull: bool = False) -> dict:
    """The launch-template data of ``disks``: the root volume, and the NodeConfig for NVMe (and
    for the fast image pull, when asked)."""
    data = {"block_device_mappings": [encrypted_root_volume(disks)]}
    if disks.instance_store or fast_image_pull:
        data["user_data"] = Fn.base64(node_config_user_data(local_storage=disks.instance_store,
                                                            fast_image_pull=fast_image_pull))
    return data
