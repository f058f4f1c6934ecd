"""Custom resource: the facts about the account that synth cannot see, checked in the deploy's
first minute, before the VPC and the cluster are built.

The commonest ways a first GPU deploy fails otherwise surface 15 to 40 minutes in (a node
group that never creates, a NodeClaim that never launches, a rollback of the whole stack):

- a regional vCPU quota (Service Quotas, ``GetServiceQuota``; EC2's instance quotas count vCPUs)
  is below what a create launches: the GPU family's (On-Demand, or Spot, and with Karpenter's
  fallback On-Demand too, Karpenter's spare node in both), the system nodes' (Standard, 5 vCPUs
  on a new account); a quota can be 0 on a new account. The nodes a managed node group's rolling
  update launches before it drains the old ones (``UpdateVcpus``) do not fail a create: they are
  reported (the ``UpdateNeeds`` attribute, the stack's output) and bind the updates;
- the GPU type is not offered in the GPU subnet's AZ (``DescribeInstanceTypeOfferings``; AZ
  names map to different zones in each account);
- the AL2023 NVIDIA AMI release the nodes boot (the EKS AMI's public SSM parameter, the one
  Karpenter resolves for ``al2023@<release>``) does not exist for the Kubernetes version in
  the region;
- a capacity reservation the nodes launch into is missing, not active or scheduled, of another
  type, AZ or reservation type, or too small (``reservation_checks.py``).

Every problem is gathered and the deploy fails once, with each problem's fix; a call refused or
failing (a service control policy, an endpoint out of reach, a quota Service Quotas cannot read:
its ``ErrorReason``) is a problem too, with the ``skipAccountChecks`` hint, never a traceback.
A stack update checks again but fails only when it asks for more than before (more vCPUs of a
quota, another type, AZ or AMI release): an update that changes nothing the checks read, and the
update CloudFormation makes when it rolls one back (the old properties as the new), never fail
here, so a refused call cannot leave the stack in UPDATE_ROLLBACK_FAILED.

Properties: ``InstanceType``, ``AvailabilityZone``, ``KubernetesVersion``, ``AmiRelease``
(``v20260714``, ``latest``, or empty when EKS picks the release, as for a managed node group),
``Quotas`` (JSON: a list of ``{"Code", "Name", "Vcpus", "Why", "UpdateVcpus", "UpdateWhy"}``),
and ``Reservations`` where the nodes use capacity reservations (JSON:
``ReservationRequest.property``) with ``Account``, the stack's (a shared reservation's owner is
another); then the attributes ``ReservationEnds`` (the earliest end of a
Capacity Block, ISO-8601 UTC, or "none") and ``ReservationNote`` (what the deploy should know:
a block ending before the job's deadline, nodes the reservations leave to Spot or On-Demand; or
"none").
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone

try:  # the package (the CDK app, the tests)
    from . import reservation_checks
except ImportError:  # the Lambda function: the handlers folder is its code root
    import reservation_checks

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

    quota_vcpus: dict[str, float] = field(default_factory=dict)
    offered_in: list[str] | None = None
    ami_found: bool | None = None
    releases: list[str] = field(default_factory=list)
    #: The reservations the request selects (None: no request, or the call was refused), and
    #: EC2's message when an id is not found.
    reservations: list[dict] | None = None
    reservations_missing: str | None = None
    checked_at: datetime = field(default_factory=lambda: datetime.now(timezone.utc))
    refused: list[str] = field(default_factory=list)


def quotas_of(props: dict) -> list[dict]:
    """The quotas to check: ``{"Code", "Name", "Vcpus", "Why"}`` each."""
    return json.loads(props.get("Quotas") or "[]")


def ami_parameter(k8s: str, release: str) -> str:
    """The SSM parameter of an AL2023 NVIDIA AMI release (``latest``: the recommended one)."""
    name = "recommended" if release in ("", "latest") else f"amazon-eks-node-al2023-x86_64-nvidia-{k8s}-{release}"
    return f"{AMI_PATH.format(k8s=k8s)}/{name}/image_id"


def _failures():
    """What a boto3 call raises when it is refused or cannot be made."""
    from botocore.exceptions import BotoCoreError, ClientError

    return (ClientError, BotoCoreError)


def quota_value(quotas, code: str) -> float:
    """A quota's applied value (its default where none is applied). Raises RuntimeError when
    Service Quotas answers without one (``ErrorReason``: the EC2 side refused or failed)."""
    try:
        quota = quotas.get_service_quota(ServiceCode="ec2", QuotaCode=code)["Quota"]
    except quotas.exceptions.NoSuchResourceException:  # no applied value: the default one
        quota = quotas.get_aws_default_service_quota(ServiceCode="ec2", QuotaCode=code)["Quota"]
    reason = quota.get("ErrorReason")
    if reason or "Value" not in quota:
        raise RuntimeError(f"Service Quotas could not read the quota {code} "
                           f"({(reason or {}).get('ErrorCode', 'no value')}: {(reason or {}).get('ErrorMessage', '')})")
    return float(quota["Value"])


def gather(props: dict, *, quotas, ec2, ssm) -> Facts:
    """Ask Service Quotas, EC2 and SSM (boto3 clients); a refused or failed call is noted."""
    facts = Facts()
    failures = _failures()
    for quota in quotas_of(props):
        try:
            facts.quota_vcpus[quota["Code"]] = quota_value(quotas, quota["Code"])
        except (*failures, RuntimeError) as error:
            facts.refused.append(f"Service Quotas, {quota['Code']}: {error}")
    try:
        offered = []
        paginator = ec2.get_paginator("describe_instance_type_offerings")
        for page in paginator.paginate(LocationType="availability-zone",
                                       Filters=[{"Name": "instance-type", "Values": [props["InstanceType"]]}]):
            offered.extend(o["Location"] for o in page["InstanceTypeOfferings"])
        facts.offered_in = sorted(set(offered))
    except failures as error:
        facts.refused.append(f"EC2 DescribeInstanceTypeOfferings: {error}")
    release = props.get("AmiRelease", "")
    try:
        try:
            ssm.get_parameter(Name=ami_parameter(props["KubernetesVersion"], release))
            facts.ami_found = True
        except ssm.exceptions.ParameterNotFound:
            facts.ami_found = False
            for page in ssm.get_paginator("get_parameters_by_path").paginate(
                    Path=AMI_PATH.format(k8s=props["KubernetesVersion"]), Recursive=True):
                facts.releases.extend(m.group(1) for p in page["Parameters"] if (m := _RELEASE.search(p["Name"])))
            facts.releases = sorted(set(facts.releases))
    except failures as error:
        facts.refused.append(f"SSM GetParameter: {error}")
    request = reservation_checks.request_of(props)
    if request is not None:
        try:
            facts.reservations, facts.reservations_missing = reservation_checks.describe(ec2, request)
        except failures as error:
            facts.refused.append(f"EC2 DescribeCapacityReservations: {error}")
    return facts


def reservations(props: dict, facts: Facts, *, update: bool = False) -> reservation_checks.Assessment:
    """What the capacity reservations mean for the deploy (nothing without a request); on an update
    the nodes already running in them count as room (they hold it)."""
    request = reservation_checks.request_of(props)
    if request is None:
        return reservation_checks.Assessment()
    return reservation_checks.assess(request, facts.reservations, facts.reservations_missing,
                                     instance_type=props["InstanceType"], availability_zone=props["AvailabilityZone"],
                                     offered_in=facts.offered_in, now=facts.checked_at, update=update,
                                     account=props.get("Account"))


def _needed(quota: dict, *, update: bool) -> tuple[int, str]:
    """vCPUs a create (or an update) needs of ``quota``, and why."""
    if update:
        return int(quota.get("UpdateVcpus", quota["Vcpus"])), quota.get("UpdateWhy", quota["Why"])
    return int(quota["Vcpus"]), quota["Why"]


def problems(props: dict, facts: Facts, *, region: str, update: bool = False) -> list[str]:
    """Every problem the facts show for a create (``update``: for an update), each with its fix."""
    found: list[str] = []
    instance_type = props["InstanceType"]
    for quota in quotas_of(props):
        have, code, name = facts.quota_vcpus.get(quota["Code"]), quota["Code"], quota["Name"]
        needed, why = _needed(quota, update=update)
        if have is not None and have < needed:
            found.append(
                f"the quota '{name}' ({code}) of {region} is {have:.0f} vCPUs; {why} need {needed} (instances "
                f"already running count against it too): request at least {needed} in Service Quotas (aws "
                f"service-quotas request-service-quota-increase --service-code ec2 --quota-code {code} "
                f"--desired-value {needed} --region {region}), or deploy fewer nodes"
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
    found += reservations(props, facts, update=update).problems
    for refusal in facts.refused:
        found.append(f"{refusal} (its function has the permission: a service control policy may deny it, or the "
                     "service is out of reach); the account cannot be checked: deploy with -c skipAccountChecks=true "
                     "where these calls are refused")
    return found


def update_needs(props: dict, facts: Facts) -> str:
    """The account's quotas against what an update of the node groups will need: each quota short
    of it, or "none short"."""
    short = []
    for quota in quotas_of(props):
        have, (needed, why) = facts.quota_vcpus.get(quota["Code"]), _needed(quota, update=True)
        if have is not None and have < needed:
            short.append(f"{quota['Code']} is {have:.0f} vCPUs, an update needs {needed} ({why}): request it before updating")
    return "; ".join(short) or "none short"


def grew(props: dict, old: dict) -> bool:
    """Whether an update asks for more than the properties it replaces: more vCPUs of any quota,
    or another type, AZ, Kubernetes version, AMI release or capacity reservations (what the checks read)."""
    before = {q["Code"]: _needed(q, update=True)[0] for q in quotas_of(old)}
    if any(_needed(q, update=True)[0] > before.get(q["Code"], 0) for q in quotas_of(props)):
        return True
    return any(props.get(key) != old.get(key) for key in ("InstanceType", "AvailabilityZone", "KubernetesVersion", "AmiRelease",
                                                          "Reservations"))


def handover(props: dict, old: dict, ec2, facts: Facts) -> list[str]:
    """An update that moves a node group off a Capacity Block that still runs it (reservation_checks.py
    ``handover_problems``); the old blocks read from EC2 (a refused call: said with the others)."""
    old_spec, spec = reservation_checks.request_of(old), reservation_checks.request_of(props)
    if spec is None or old_spec is None or set(old_spec.get("Ids") or ()) == set(spec["Ids"]):
        return []
    try:
        found, _ = reservation_checks.describe(ec2, old_spec)
    except _failures() as error:
        return [f"EC2 DescribeCapacityReservations of the blocks the nodes run on now: {error}; the account cannot be "
                "checked: deploy with -c skipAccountChecks=true where these calls are refused"]
    return reservation_checks.handover_problems(old_spec, spec, found, now=facts.checked_at)


def message(found: list[str]) -> str:
    """The deploy's failure reason: every problem, within what CloudFormation shows."""
    text = (f"{len(found)} problem(s) with this account for the GPU nodes (checked before anything was built; "
            "-c skipAccountChecks=true skips this):\n" + "\n".join(f"- {p}" for p in found))
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 20] + "\n... (see the log)"


class AccountNotReady(RuntimeError):
    """The account cannot run the GPU nodes as configured."""


def on_event(event: dict, context=None, *, clients=None) -> dict:
    """The custom resource's handler: on create, and on an update that asks for more, check; on
    any other update check and log only; on delete, nothing."""
    if event["RequestType"] == "Delete":
        return {"PhysicalResourceId": event.get("PhysicalResourceId", "account-checks")}
    props = event["ResourceProperties"]
    if clients is None:
        import boto3

        clients = {"quotas": boto3.client("service-quotas"), "ec2": boto3.client("ec2"), "ssm": boto3.client("ssm")}
    facts = gather(props, **clients)
    update = event["RequestType"] == "Update"
    region = os.environ.get("AWS_REGION", "this region")
    found = problems(props, facts, region=region, update=update)
    needs = update_needs(props, facts)
    reserved = reservations(props, facts, update=update)
    LOG.info("facts %s, problems %s, for an update: %s, reservations: %s", facts, found, needs, reserved.notes)
    old = event.get("OldResourceProperties") or {}
    if update:
        found += handover(props, old, clients["ec2"], facts)
    binding = not update or grew(props, old)
    if found and binding:
        raise AccountNotReady(message(found))
    if found:
        LOG.warning("not failing an update that asks for nothing more (or a rollback): %s", found)
    data = {"QuotaVcpus": json.dumps({code: value for code, value in sorted(facts.quota_vcpus.items())}),
            "UpdateNeeds": needs}
    if "Reservations" in props:
        note, limit = "; ".join(reserved.notes) or "none", reservation_checks.MAX_NOTE
        data.update(ReservationEnds=reserved.ends,
                    ReservationNote=note if len(note) <= limit else note[: limit - 20] + " ... (see the log)")
    return {"PhysicalResourceId": "account-checks", "Data": data}
