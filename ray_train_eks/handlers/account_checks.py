"""Custom resource: the facts about the account that synth cannot see, checked in the deploy's
first minute, before the VPC and the cluster are built.

The commonest ways a first GPU deploy fails otherwise surface 15 to 40 minutes in (a node
group that never creates, a NodeClaim that never launches, a rollback of the whole stack):

- the regional vCPU quota of the GPU family (Service Quotas, ``GetServiceQuota``; EC2's
  instance quotas count vCPUs) is below what the GPU nodes need; it can be 0 on a new account;
- the GPU type is not offered in the GPU subnet's AZ (``DescribeInstanceTypeOfferings``; AZ
  names map to different zones in each account);
- the AL2023 NVIDIA AMI release the nodes boot (the EKS AMI's public SSM parameter, the one
  Karpenter resolves for ``al2023@<release>``) does not exist for the Kubernetes version in
  the region.

Every problem is gathered and the deploy fails once, with each problem's fix. Properties:
``InstanceType``, ``InstanceCount``, ``VcpusPerInstance``, ``QuotaCode``, ``QuotaName``,
``AvailabilityZone``, ``KubernetesVersion``, ``AmiRelease`` (``v20260714``, ``latest``, or empty
when EKS picks the release, as for a managed node group).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field

LOG = logging.getLogger()
LOG.setLevel(logging.INFO)

#: CloudFormation takes a 4,096-byte response; the provider framework adds a trace to the message.
MAX_MESSAGE = 3000
#: The EKS AL2023 NVIDIA AMIs' public parameters (EKS user guide, "Retrieve recommended Amazon
#: Linux AMI IDs"; the path Karpenter 1.14's al2023.go resolves an alias to).
AMI_PATH = "/aws/service/eks/optimized-ami/{k8s}/amazon-linux-2023/x86_64/nvidia"
_RELEASE = re.compile(r"amazon-eks-node-al2023-x86_64-nvidia-[\d.]+-(v\d{8})/image_id$")


@dataclass
class Facts:
    """What the account says (None: not asked, or the call was refused: see ``refused``)."""

    quota_vcpus: float | None = None
    offered_in: list[str] | None = None
    ami_found: bool | None = None
    releases: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)


def ami_parameter(k8s: str, release: str) -> str:
    """The SSM parameter of an AL2023 NVIDIA AMI release (``latest``: the recommended one)."""
    name = "recommended" if release in ("", "latest") else f"amazon-eks-node-al2023-x86_64-nvidia-{k8s}-{release}"
    return f"{AMI_PATH.format(k8s=k8s)}/{name}/image_id"


def gather(props: dict, *, quotas, ec2, ssm) -> Facts:
    """Ask Service Quotas, EC2 and SSM (boto3 clients)."""
    facts = Facts()
    try:
        try:
            quota = quotas.get_service_quota(ServiceCode="ec2", QuotaCode=props["QuotaCode"])
        except quotas.exceptions.NoSuchResourceException:  # no applied value: the default one
            quota = quotas.get_aws_default_service_quota(ServiceCode="ec2", QuotaCode=props["QuotaCode"])
        facts.quota_vcpus = float(quota["Quota"]["Value"])
    except quotas.exceptions.ClientError as error:
        facts.refused.append(f"Service Quotas: {error}")
    offered = []
    paginator = ec2.get_paginator("describe_instance_type_offerings")
    for page in paginator.paginate(LocationType="availability-zone",
                                   Filters=[{"Name": "instance-type", "Values": [props["InstanceType"]]}]):
        offered.extend(o["Location"] for o in page["InstanceTypeOfferings"])
    facts.offered_in = sorted(set(offered))
    release = props.get("AmiRelease", "")
    try:
        ssm.get_parameter(Name=ami_parameter(props["KubernetesVersion"], release))
        facts.ami_found = True
    except ssm.exceptions.ParameterNotFound:
        facts.ami_found = False
        for page in ssm.get_paginator("get_parameters_by_path").paginate(
                Path=AMI_PATH.format(k8s=props["KubernetesVersion"]), Recursive=True):
            facts.releases.extend(m.group(1) for p in page["Parameters"] if (m := _RELEASE.search(p["Name"])))
        facts.releases = sorted(set(facts.releases))
    return facts


def problems(props: dict, facts: Facts, *, region: str) -> list[str]:
    """Every problem the facts show, each with its fix."""
    found: list[str] = []
    instance_type, count = props["InstanceType"], int(props["InstanceCount"])
    needed = count * int(props["VcpusPerInstance"])
    code, name = props["QuotaCode"], props["QuotaName"]
    if facts.quota_vcpus is not None and facts.quota_vcpus < needed:
        found.append(
            f"the quota '{name}' ({code}) of {region} is {facts.quota_vcpus:.0f} vCPUs; {count} x {instance_type} need "
            f"{needed} (instances already running count against it too): request at least {needed} in Service Quotas "
            f"(aws service-quotas request-service-quota-increase --service-code ec2 --quota-code {code} "
            f"--desired-value {needed} --region {region}), or deploy fewer nodes with -c gpuNodeCount"
        )
    az = props["AvailabilityZone"]
    if facts.offered_in is not None and az not in facts.offered_in:
        if facts.offered_in:
            other = next((z for z in facts.offered_in if z != az), facts.offered_in[0])
            second = next((z for z in sorted({*facts.offered_in, az}) if z != other), az)
            found.append(
                f"{instance_type} is not offered in {az}, the GPU nodes' AZ (AZ names map to different zones in each "
                f"account); it is offered in {', '.join(facts.offered_in)}: deploy with "
                f"-c availabilityZones={other},{second} (the GPU nodes use the first)"
            )
        else:
            found.append(f"{instance_type} is not offered in any AZ of {region}; choose another -c gpuInstanceType or region")
    if facts.ami_found is False:
        release, k8s = props.get("AmiRelease", ""), props["KubernetesVersion"]
        what = f"the AL2023 NVIDIA AMI release {release}" if release not in ("", "latest") else "an AL2023 NVIDIA AMI"
        latest = facts.releases[-5:]
        fix = (f"releases that exist: {', '.join(latest)}; deploy with -c gpuAmiVersion={latest[-1]}" if latest
               else f"none exists in {region}: check that EKS offers Kubernetes {k8s} GPU nodes here")
        found.append(f"{what} for Kubernetes {k8s} does not exist in {region} ({ami_parameter(k8s, release)}); {fix}")
    for refusal in facts.refused:
        found.append(f"{refusal} (its function has the permission: a service control policy may deny it); the quota "
                     "cannot be checked: deploy with -c skipAccountChecks=true where Service Quotas is not reachable")
    return found


def message(found: list[str]) -> str:
    """The deploy's failure reason: every problem, within what CloudFormation shows."""
    text = (f"{len(found)} problem(s) with this account for the GPU nodes (checked before anything was built; "
            "-c skipAccountChecks=true skips this):\n" + "\n".join(f"- {p}" for p in found))
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 20] + "\n... (see the log)"


class AccountNotReady(RuntimeError):
    """The account cannot run the GPU nodes as configured."""


def on_event(event: dict, context=None, *, clients=None) -> dict:
    """The custom resource's handler: on create and update, check; on delete, nothing."""
    if event["RequestType"] == "Delete":
        return {"PhysicalResourceId": event.get("PhysicalResourceId", "account-checks")}
    props = event["ResourceProperties"]
    if clients is None:
        import boto3

        clients = {"quotas": boto3.client("service-quotas"), "ec2": boto3.client("ec2"), "ssm": boto3.client("ssm")}
    facts = gather(props, **clients)
    found = problems(props, facts, region=os.environ.get("AWS_REGION", "this region"))
    LOG.info("facts %s, problems %s", facts, found)
    if found:
        raise AccountNotReady(message(found))
    return {"PhysicalResourceId": "account-checks", "Data": {"QuotaVcpus": str(facts.quota_vcpus)}}
