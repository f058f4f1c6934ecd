"""Launch-template pieces every node group of the platform shares."""

from __future__ import annotations

from aws_cdk import aws_ec2 as ec2

#: AL2023 EKS AMIs boot from this device.
ROOT_DEVICE = "/dev/xvda"


def node_metadata_options() -> ec2.CfnLaunchTemplate.MetadataOptionsProperty:
    """IMDSv2 only, one hop: pods get AWS credentials from EKS Pod Identity, so nothing
    in a container needs the node's instance role through IMDS."""
    return ec2.CfnLaunchTemplate.MetadataOptionsProperty(
        http_endpoint="enabled",
        http_tokens="required",
        http_put_response_hop_limit=1,
    )


def encrypted_root_volume(size_gib: int) -> ec2.CfnLaunchTemplate.BlockDeviceMappingProperty:
    """An encrypted gp3 root volume of ``size_gib`` GiB, deleted with the instance."""
    return ec2.CfnLaunchTemplate.BlockDeviceMappingProperty(
        device_name=ROOT_DEVICE,
        ebs=ec2.CfnLaunchTemplate.EbsProperty(
            volume_size=size_gib,
            volume_type="gp3",
            encrypted=True,
            delete_on_termination=True,
        ),
    )
