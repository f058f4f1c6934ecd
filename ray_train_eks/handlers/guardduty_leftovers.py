"""Custom resource: on delete, what GuardDuty's automated agent put in the stack's VPC.

With GuardDuty Runtime Monitoring's automated agent configuration on (an account setting, not the
stack's), GuardDuty creates, for a VPC with an EKS cluster, an interface VPC endpoint for
``com.amazonaws.<region>.guardduty-data`` tagged ``GuardDutyManaged: true``, and a security group
``GuardDutyManagedSecurityGroup-<vpc id>``, tagged alike (GuardDuty User Guide, "How Runtime Monitoring works with
Amazon EKS clusters"; "Validating VPC endpoint configuration"). It does not delete them when the
cluster goes: the endpoint's interfaces keep the private subnets, and the group the VPC, from being
deleted, and ``cdk destroy`` stops. This resource is deleted after the cluster and before the
subnets and the VPC: it deletes the endpoints so tagged in ``VpcId``, waits until they are gone, then
deletes the group (retried while its interfaces detach).
"""

from __future__ import annotations

import logging
import time

LOG = logging.getLogger()
LOG.setLevel(logging.INFO)

POLL_SECONDS = 10
MANAGED_TAG = "GuardDutyManaged"
GROUP_PREFIX = "GuardDutyManagedSecurityGroup-"


def endpoints(ec2, vpc_id: str) -> list[dict]:
    """GuardDuty's endpoints in the VPC that are not deleted yet."""
    found = ec2.describe_vpc_endpoints(Filters=[{"Name": "vpc-id", "Values": [vpc_id]},
                                                {"Name": f"tag:{MANAGED_TAG}", "Values": ["true"]}])["VpcEndpoints"]
    return [e for e in found if e.get("State", "").lower() not in ("deleted", "deleting")]


def cleanup(ec2, *, vpc_id: str, wait_seconds: float, sleep=time.sleep, clock=time.monotonic) -> list[str]:
    """Delete GuardDuty's endpoints and security group in ``vpc_id``; what was deleted."""
    from botocore.exceptions import ClientError

    deleted: list[str] = []
    found = endpoints(ec2, vpc_id)
    if found:
        ids = [e["VpcEndpointId"] for e in found]
        ec2.delete_vpc_endpoints(VpcEndpointIds=ids)
        deleted += ids
    deadline = clock() + wait_seconds
    in_vpc = ec2.describe_security_groups(Filters=[{"Name": "vpc-id", "Values": [vpc_id]}])["SecurityGroups"]
    groups = [g for g in in_vpc if g.get("GroupName", "").startswith(GROUP_PREFIX)
              or {"Key": MANAGED_TAG, "Value": "true"} in (g.get("Tags") or [])]
    for group in groups:
        while True:
            try:
                ec2.delete_security_group(GroupId=group["GroupId"])
                deleted.append(group["GroupId"])
                break
            except ClientError as error:
                code = error.response["Error"]["Code"]
                if code == "InvalidGroup.NotFound":
                    break
                if code != "DependencyViolation" or clock() >= deadline:
                    raise RuntimeError(f"GuardDuty's security group {group['GroupId']} ({group.get('GroupName')}) in "
                                       f"{vpc_id} could not be deleted ({code}: {error.response['Error'].get('Message')}); "
                                       "delete its VPC endpoint and the group, then run cdk destroy again") from None
                sleep(POLL_SECONDS)  # the endpoint's interfaces are still detaching
    return deleted


def on_event(event: dict, context=None, *, ec2=None, sleep=time.sleep, clock=time.monotonic) -> dict:
    """The custom resource's handler: nothing on create and update; the clean-up on delete."""
    props = event["ResourceProperties"]
    if event["RequestType"] != "Delete":
        return {"PhysicalResourceId": "guardduty-leftovers"}
    if ec2 is None:
        import boto3

        ec2 = boto3.client("ec2", region_name=props["Region"])
    deleted = cleanup(ec2, vpc_id=props["VpcId"], wait_seconds=float(props.get("WaitSeconds", 600)), sleep=sleep, clock=clock)
    LOG.info("GuardDuty's leftovers deleted: %s", ", ".join(deleted) or "none")
    return {"PhysicalResourceId": event.get("PhysicalResourceId") or "guardduty-leftovers"}
