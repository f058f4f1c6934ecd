"""Custom resource: on delete, whatever Karpenter launched for this cluster and left behind.

``cdk destroy`` deletes the NodePool, then the EC2NodeClass (whose finalizer waits for its
instances, then deletes its launch templates and instance profiles), then the controller. But
CDK's kubectl handler swallows every delete error (aws-eks kubectl-handler ``apply``:
``except Exception as e: logger.info("delete error: %s" % e)``) and so does its Helm handler, so
a delete that fails fast (the API server unreachable, a webhook down) leaves GPU instances
running with nothing left to terminate them, and their launch templates and instance profiles
keep the subnet, the security group and the node role from going. This resource is deleted
after every Karpenter object and before the VPC and the node role; it finds what Karpenter
created for this cluster by the tags and path Karpenter 1.14.1 gives it, and removes it:

- instances: ``tag:eks:eks-cluster-name=<cluster>`` and a ``karpenter.sh/nodepool`` tag, not yet
  terminated (pkg/providers/instance/instance.go ``List``); terminated, and polled until every one
  reads ``terminated``. Not boto3's ``instance_terminated`` waiter: its acceptors fail at once on
  any ``pending`` or ``stopping`` (botocore ``ec2/2016-11-15/waiters-2.json``
  ``InstanceTerminated``), which an instance terminated while it launched can report for a moment;
- launch templates: ``tag:eks:eks-cluster-name=<cluster>`` and a ``karpenter.k8s.aws/ec2nodeclass``
  tag (pkg/providers/launchtemplate ``DeleteAll``);
- instance profiles under the path ``/karpenter/<region>/<cluster>/``
  (pkg/controllers/nodeclass/garbagecollection): their role removed, then deleted.

Properties: ``ClusterName``, ``Region``, ``WaitSeconds`` (for the instances' termination).
"""

from __future__ import annotations

import logging
import time

LOG = logging.getLogger()
LOG.setLevel(logging.INFO)

CLUSTER_TAG = "eks:eks-cluster-name"
NODEPOOL_TAG = "karpenter.sh/nodepool"
NODECLASS_TAG = "karpenter.k8s.aws/ec2nodeclass"
LIVE_STATES = ["pending", "running", "stopping", "stopped", "shutting-down"]
#: Seconds between looks at the instances' states.
POLL_SECONDS = 15


def _clients(region: str):
    import boto3

    return boto3.client("ec2", region_name=region), boto3.client("iam")


def instances(ec2, cluster: str) -> list[str]:
    """Ids of this cluster's Karpenter instances not yet terminated."""
    found = []
    for page in ec2.get_paginator("describe_instances").paginate(Filters=[
            {"Name": f"tag:{CLUSTER_TAG}", "Values": [cluster]}, {"Name": "tag-key", "Values": [NODEPOOL_TAG]},
            {"Name": "instance-state-name", "Values": LIVE_STATES}]):
        found += [i["InstanceId"] for r in page["Reservations"] for i in r["Instances"]]
    return sorted(found)


def launch_templates(ec2, cluster: str) -> list[str]:
    """Ids of this cluster's Karpenter launch templates."""
    found = []
    for page in ec2.get_paginator("describe_launch_templates").paginate(Filters=[
            {"Name": f"tag:{CLUSTER_TAG}", "Values": [cluster]}, {"Name": "tag-key", "Values": [NODECLASS_TAG]}]):
        found += [t["LaunchTemplateId"] for t in page["LaunchTemplates"]]
    return sorted(found)


def instance_profiles(iam, cluster: str, region: str) -> list[dict]:
    """This cluster's Karpenter instance profiles (name and roles)."""
    found = []
    for page in iam.get_paginator("list_instance_profiles").paginate(PathPrefix=f"/karpenter/{region}/{cluster}/"):
        found += page["InstanceProfiles"]
    return found


def wait_terminated(ec2, ids: list[str], *, wait_seconds: float, sleep=time.sleep, clock=time.monotonic) -> None:
    """Poll until every instance of ``ids`` is ``terminated`` (or gone from ``DescribeInstances``);
    raise naming those that are not after ``wait_seconds``."""
    deadline = clock() + wait_seconds
    while True:
        states = {}
        for page in ec2.get_paginator("describe_instances").paginate(Filters=[{"Name": "instance-id", "Values": ids}]):
            states.update({i["InstanceId"]: i["State"]["Name"] for r in page["Reservations"] for i in r["Instances"]})
        left = {instance: state for instance, state in sorted(states.items()) if state != "terminated"}
        if not left:
            return
        if clock() >= deadline:
            raise RuntimeError(f"{len(left)} GPU instance(s) not terminated after {wait_seconds:.0f} s: "
                               + ", ".join(f"{i} ({state})" for i, state in left.items())
                               + "; terminate them in the EC2 console (they bill until then), then run cdk destroy again")
        sleep(POLL_SECONDS)


def cleanup(ec2, iam, *, cluster: str, region: str, wait_seconds: int, sleep=time.sleep, clock=time.monotonic) -> list[str]:
    """Terminate the instances (and wait), delete the launch templates and the instance
    profiles; returns what it did. Raises when an instance will not terminate in time: the
    stack's delete then fails, naming them, rather than leave GPUs billing."""
    done = []
    ids = instances(ec2, cluster)
    if ids:
        ec2.terminate_instances(InstanceIds=ids)
        done.append(f"terminated {', '.join(ids)}")
        wait_terminated(ec2, ids, wait_seconds=wait_seconds, sleep=sleep, clock=clock)
    for template in launch_templates(ec2, cluster):
        ec2.delete_launch_template(LaunchTemplateId=template)
        done.append(f"deleted launch template {template}")
    for profile in instance_profiles(iam, cluster, region):
        for role in profile.get("Roles", []):
            iam.remove_role_from_instance_profile(InstanceProfileName=profile["InstanceProfileName"], RoleName=role["RoleName"])
        iam.delete_instance_profile(InstanceProfileName=profile["InstanceProfileName"])
        done.append(f"deleted instance profile {profile['InstanceProfileName']}")
    return done


def on_event(event: dict, context=None, *, ec2=None, iam=None, sleep=time.sleep, clock=time.monotonic) -> dict:
    """The custom resource's handler: nothing on create and update; the clean-up on delete."""
    props = event["ResourceProperties"]
    cluster, region = props["ClusterName"], props["Region"]
    physical_id = event.get("PhysicalResourceId") or f"karpenter-leftovers:{cluster}"
    if event["RequestType"] != "Delete":
        return {"PhysicalResourceId": f"karpenter-leftovers:{cluster}"}
    if ec2 is None or iam is None:
        ec2, iam = _clients(region)
    done = cleanup(ec2, iam, cluster=cluster, region=region, wait_seconds=int(props.get("WaitSeconds", 600)),
                   sleep=sleep, clock=clock)
    LOG.info("Karpenter's leftovers for %s: %s", cluster, "; ".join(done) or "none")
    return {"PhysicalResourceId": physical_id}
