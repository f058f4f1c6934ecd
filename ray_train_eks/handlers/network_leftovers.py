"""Custom resource: on delete, the network interfaces left in the GPU nodes' security groups.

The VPC CNI creates an interface, then attaches it to its node, and only then sets
DeleteOnTermination (aws/amazon-vpc-cni-k8s ``pkg/awsutils/awsutils.go`` ``AllocENI``: a failed
attach is followed by a delete, whose own failure is only logged: "Failed to delete newly created
untagged ENI!"). An interface created and never attached (the node gone between the calls, an
attach and then a delete that failed) stays ``available`` in its security groups, nothing deletes it:
the EFA security group and the GPU subnet then fail to delete ("has a dependent object", "has
dependencies") and ``cdk destroy`` stops. This resource is deleted after the GPU capacity (the node
group, or Karpenter's leftover clean-up) and before the security groups and the subnet.

On delete it deletes every ``available`` interface in ``SecurityGroupIds``, and waits, up to
``WaitSeconds``, until no interface of ``EmptyGroupIds`` (groups only the GPU nodes use: the EFA
group) is left in use: an interface still detaching from a terminated node turns ``available``
and is deleted in turn. One that stays in use fails the delete, naming it and what holds it.
"""

from __future__ import annotations

import logging
import time

LOG = logging.getLogger()
LOG.setLevel(logging.INFO)

#: Seconds between looks.
POLL_SECONDS = 10


def interfaces(ec2, groups: list[str]) -> list[dict]:
    """The network interfaces in any of ``groups``."""
    found = []
    for page in ec2.get_paginator("describe_network_interfaces").paginate(
            Filters=[{"Name": "group-id", "Values": sorted(groups)}]):
        found += page["NetworkInterfaces"]
    return sorted(found, key=lambda eni: eni["NetworkInterfaceId"])


def _holder(eni: dict) -> str:
    attachment = eni.get("Attachment") or {}
    held_by = attachment.get("InstanceId") or attachment.get("InstanceOwnerId") or "nothing"
    return f"{eni['NetworkInterfaceId']} ({eni.get('Status')}, attached to {held_by}: {eni.get('Description') or 'no description'})"


def cleanup(ec2, *, groups: list[str], empty_groups: list[str], wait_seconds: float,
            sleep=time.sleep, clock=time.monotonic) -> list[str]:
    """Delete the ``available`` interfaces of ``groups`` until none of ``empty_groups`` is left;
    returns what it deleted. Raises, naming them, when interfaces of ``empty_groups`` are still in
    use after ``wait_seconds``."""
    from botocore.exceptions import ClientError

    deleted: list[str] = []
    deadline = clock() + wait_seconds
    while True:
        found = interfaces(ec2, groups)
        for eni in found:
            if eni.get("Status") != "available":
                continue
            try:
                ec2.delete_network_interface(NetworkInterfaceId=eni["NetworkInterfaceId"])
            except ClientError as error:
                if error.response["Error"]["Code"] != "InvalidNetworkInterfaceID.NotFound":
                    raise
            deleted.append(eni["NetworkInterfaceId"])
        busy = [eni for eni in found if eni.get("Status") != "available"
                and {g["GroupId"] for g in eni.get("Groups", [])} & set(empty_groups)]
        if not busy:
            return deleted
        if clock() >= deadline:
            raise RuntimeError(f"{len(busy)} network interface(s) of the GPU nodes' security group still in use after "
                               f"{wait_seconds:.0f} s, so the group and the subnet cannot be deleted: "
                               + "; ".join(_holder(eni) for eni in busy)
                               + ". Terminate or detach what holds them, then run cdk destroy again.")
        sleep(POLL_SECONDS)


def on_event(event: dict, context=None, *, ec2=None, sleep=time.sleep, clock=time.monotonic) -> dict:
    """The custom resource's handler: nothing on create and update; the clean-up on delete."""
    props = event["ResourceProperties"]
    physical_id = event.get("PhysicalResourceId") or "network-leftovers"
    if event["RequestType"] != "Delete":
        return {"PhysicalResourceId": "network-leftovers"}
    if ec2 is None:
        import boto3

        ec2 = boto3.client("ec2", region_name=props["Region"])
    deleted = cleanup(ec2, groups=list(props["SecurityGroupIds"]), empty_groups=list(props["EmptyGroupIds"]),
                      wait_seconds=float(props.get("WaitSeconds", 300)), sleep=sleep, clock=clock)
    LOG.info("leftover network interfaces deleted: %s", ", ".join(deleted) or "none")
    return {"PhysicalResourceId": physical_id}
