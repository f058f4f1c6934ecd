"""The account checks of the GPU nodes' capacity reservations (ray_train_eks/handlers/
reservation_checks.py), driven through botocore's Stubber as tests/test_handlers.py drives the
rest of the account checks: every call checked against EC2's model, with recorded responses."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest

from ray_train_eks.handlers import account_checks
from ray_train_eks.handlers.reservation_checks import ReservationRequest
from stubbed_aws import stubbed_account_clients

CR = "cr-0123456789abcdef0"
CR2 = "cr-0fedcba9876543210"
QUOTAS = [{"Code": "L-DB2E81BA", "Name": "Running On-Demand G and VT instances", "Vcpus": 96, "Why": "2 x g6.12xlarge"}]
PROPS = {"InstanceType": "g6.12xlarge", "Quotas": json.dumps(QUOTAS), "AvailabilityZone": "us-west-2a",
         "KubernetesVersion": "1.36", "AmiRelease": ""}
AMI = "/aws/service/eks/optimized-ami/1.36/amazon-linux-2023/x86_64/nvidia/recommended/image_id"
NOW = datetime.now(timezone.utc).replace(microsecond=0)


def _props(**request) -> dict:
    """The resource's properties with a ``Reservations`` request (2 nodes, a node group, by id)."""
    spec = {"Ids": [CR], "Tags": {}, "Type": "default", "ReservedOnly": True, "NodeGroup": True, "DeadlineSeconds": None,
            "Nodes": 2, "Spare": 0, **request}
    return {**PROPS, "Reservations": json.dumps(spec)}


def _reservation(rid: str = CR, **fields) -> dict:
    """A DescribeCapacityReservations entry, as the EC2 API Reference shapes it: an active ODCR of
    two g6.12xlarge in us-west-2a, both free."""
    return {"CapacityReservationId": rid, "OwnerId": "123456789012", "InstanceType": "g6.12xlarge",
            "InstancePlatform": "Linux/UNIX", "AvailabilityZone": "us-west-2a", "Tenancy": "default",
            "TotalInstanceCount": 2, "AvailableInstanceCount": 2, "State": "active", "StartDate": NOW - timedelta(days=1),
            "EndDateType": "unlimited", "InstanceMatchCriteria": "targeted", "ReservationType": "default", **fields}


def _block(rid: str = CR, *, days: float = 3, **fields) -> dict:
    """An active Capacity Block ending ``days`` from now."""
    return _reservation(rid, **{"ReservationType": "capacity-block", "EndDateType": "limited",
                                "EndDate": NOW + timedelta(days=days), **fields})


@pytest.fixture
def aws(monkeypatch):
    monkeypatch.setenv("AWS_REGION", "us-west-2")
    with stubbed_account_clients() as clients_and_stubs:
        yield clients_and_stubs


def _account(stubs, *reservations, params=None, error: dict | None = None) -> None:
    """An account whose quota, offerings (us-west-2a and b) and AMI are fine, and whose
    DescribeCapacityReservations (by id ``CR`` unless ``params``) answers ``reservations``, or
    ``error`` (Stubber.add_client_error's arguments)."""
    stubs["quotas"].add_response("get_service_quota", {"Quota": {"QuotaCode": "L-DB2E81BA", "Value": 192.0}},
                                 {"ServiceCode": "ec2", "QuotaCode": "L-DB2E81BA"})
    offerings = [{"InstanceType": "g6.12xlarge", "LocationType": "availability-zone", "Location": az}
                 for az in ("us-west-2a", "us-west-2b")]
    stubs["ec2"].add_response("describe_instance_type_offerings", {"InstanceTypeOfferings": offerings},
                              {"LocationType": "availability-zone",
                               "Filters": [{"Name": "instance-type", "Values": ["g6.12xlarge"]}]})
    stubs["ssm"].add_response("get_parameter", {"Parameter": {"Name": AMI, "Type": "String", "Value": "ami-1"}}, {"Name": AMI})
    params = params or {"CapacityReservationIds": [CR]}
    if error:
        stubs["ec2"].add_client_error("describe_capacity_reservations", expected_params=params, **error)
    else:
        stubs["ec2"].add_response("describe_capacity_reservations", {"CapacityReservations": list(reservations)}, params)


def _create(clients, props: dict) -> dict:
    return account_checks.on_event({"RequestType": "Create", "ResourceProperties": props}, clients=clients)


def _fails(clients, props: dict) -> str:
    with pytest.raises(account_checks.AccountNotReady) as raised:
        _create(clients, props)
    text = str(raised.value)
    assert len(text) <= account_checks.MAX_MESSAGE
    return text


def test_a_reservation_that_holds_the_nodes_passes(aws):
    clients, stubs = aws
    _account(stubs, _reservation())
    result = _create(clients, _props())
    assert result["Data"]["ReservationEnds"] == "none" and result["Data"]["ReservationNote"] == "none"


def test_a_reservation_of_another_type_az_or_reservation_type_fails_with_each_fix(aws):
    clients, stubs = aws
    _account(stubs, _reservation(InstanceType="g5.12xlarge", AvailabilityZone="us-west-2b", ReservationType="capacity-block",
                                 EndDate=NOW + timedelta(days=2)))
    text = _fails(clients, _props())
    assert text.startswith("1 problem(s)")
    assert (f"- capacityReservationIds={CR}: {CR} holds g5.12xlarge, not g6.12xlarge: deploy with -c gpuInstanceType="
            "g5.12xlarge, or name a reservation of g6.12xlarge; it is in us-west-2b, not in us-west-2a (the GPU nodes' AZ): "
            "deploy with -c availabilityZones=us-west-2b,us-west-2a (the GPU nodes use the first); it is a Capacity Block "
            "(ReservationType capacity-block), not an On-Demand Capacity Reservation: deploy with "
            "-c capacityReservationType=capacity-block") in text


def test_a_reservation_for_another_platform_or_tenancy_holds_none_of_the_nodes(aws):
    clients, stubs = aws
    _account(stubs, _reservation(InstancePlatform="Windows", Tenancy="dedicated"))
    assert (f"{CR} is for Windows instances of dedicated tenancy; the nodes boot Amazon Linux 2023 (Linux/UNIX) with "
            "default tenancy: name a reservation of those") in _fails(clients, _props())


def test_an_odcr_declared_as_a_capacity_block_names_the_context_value(aws):
    clients, stubs = aws
    _account(stubs, _reservation())
    assert "(ReservationType default), not a Capacity Block: deploy with -c capacityReservationType=default" in _fails(
        clients, _props(Type="capacity-block"))


def test_too_few_instances_fail_reserved_only_and_pass_with_a_fallback_and_a_note(aws):
    clients, stubs = aws
    busy = _reservation(AvailableInstanceCount=1)  # an instance already runs in it
    _account(stubs, busy)
    assert (f"capacityReservationIds={CR}: the reservations have room for 1 g6.12xlarge instance(s) ({CR} 1 of 2), the "
            "job needs 2 GPU node(s) (instances already running in a reservation take its room): add instances to a "
            "reservation or name another, deploy with -c gpuNodeCount=1, or let the rest fall back: "
            "-c gpuCapacity=karpenter -c gpuCapacityType=reserved,on-demand") in _fails(clients, _props())
    # Karpenter, reserved then On-Demand: the rest comes from On-Demand.
    _account(stubs, busy)
    result = _create(clients, _props(ReservedOnly=False, NodeGroup=False, Spare=1))
    assert result["Data"]["ReservationNote"] == (
        "the reservations have room for 1 of the 2 nodes; the other 1 come from the capacity types after reserved (Spot "
        "or On-Demand)")


def test_a_reservation_of_exactly_the_nodes_holds_karpenters_run_and_says_the_spare_waits(aws):
    """A block of 2 for 2 nodes, reserved only: Karpenter's spare is room in the NodePool's limit, not an
    instance the reservation must hold (a replacement takes the slot its predecessor frees)."""
    clients, stubs = aws
    _account(stubs, _block())
    result = _create(clients, _props(Type="capacity-block", NodeGroup=False, Spare=1))
    assert result["Data"]["ReservationNote"] == (
        f"the reservations have room for the 2 GPU node(s) but not for Karpenter's spare ({CR} 2 of 2): a node taken out "
        "of a run is replaced once it is gone and its slot free")


def test_an_update_counts_the_nodes_already_running_in_the_reservation_as_room(aws):
    """An ODCR of 4 with our 2 nodes in it (2 free), the node group grown to 4: room for 4, not 2."""
    clients, stubs = aws
    props = _props(Nodes=4)
    _account(stubs, _reservation(TotalInstanceCount=4, AvailableInstanceCount=2))
    event = {"RequestType": "Update", "ResourceProperties": props, "OldResourceProperties": _props()}
    assert account_checks.on_event(event, clients=clients)["Data"]["ReservationNote"] == "none"
    # A create with the same facts: only 2 are free.
    _account(stubs, _reservation(TotalInstanceCount=4, AvailableInstanceCount=2))
    assert "the reservations have room for 2 g6.12xlarge instance(s)" in _fails(clients, props)


def test_an_odcr_made_in_a_placement_group_needs_that_group(aws):
    clients, stubs = aws
    arn = "arn:aws:ec2:us-west-2:123456789012:placement-group/ml-cluster-pg"
    _account(stubs, _reservation(PlacementGroupArn=arn))
    assert (f"{CR} was made in the cluster placement group ml-cluster-pg: deploy with -c gpuPlacementGroup=ml-cluster-pg"
            in _fails(clients, _props()))
    _account(stubs, _reservation(PlacementGroupArn=arn))
    assert _create(clients, _props(PlacementGroup="ml-cluster-pg"))["Data"]["ReservationNote"] == "none"


def test_an_expired_reservation_fails(aws):
    clients, stubs = aws
    _account(stubs, _block(State="expired", days=-1))
    assert f"{CR} is expired: create or buy another and deploy with its id" in _fails(clients, _props(Type="capacity-block"))


def test_a_block_past_its_end_date_fails_even_before_ec2_marks_it_expired(aws):
    clients, stubs = aws
    end = NOW - timedelta(minutes=5)
    _account(stubs, _block(EndDate=end))
    assert f"{CR} ended at {end:%Y-%m-%dT%H:%M:%SZ}: create or buy another" in _fails(clients, _props(Type="capacity-block"))


def test_a_scheduled_block_is_accepted_for_a_node_group_and_a_scheduled_odcr_is_not(aws):
    """EKS user guide, "Create a managed node group with Capacity Blocks for ML": a group created before
    its block is active launches its nodes "whenever the reservation becomes active". An On-Demand Capacity
    Reservation's node group (capacity type ON_DEMAND) has no such promise: EKS waits for nodes that cannot come."""
    clients, stubs = aws
    start = NOW + timedelta(hours=6)
    scheduled = _block(State="scheduled", StartDate=start, AvailableInstanceCount=0, days=4)
    _account(stubs, scheduled)
    result = _create(clients, _props(Type="capacity-block"))
    assert result["Data"]["ReservationNote"] == (f"{CR} starts at {start:%Y-%m-%dT%H:%M:%SZ}: the node group is made now, "
                                                 "and EKS launches its nodes when the block starts")
    assert result["Data"]["ReservationEnds"] == f"{NOW + timedelta(days=4):%Y-%m-%dT%H:%M:%SZ}"
    _account(stubs, _reservation(State="scheduled", StartDate=start, AvailableInstanceCount=0))
    assert (f"{CR} starts at {start:%Y-%m-%dT%H:%M:%SZ} (scheduled): a managed node group cannot launch into it before; "
            "deploy after it starts, or with -c gpuCapacity=karpenter, which waits for it") in _fails(clients, _props())
    # Karpenter: its whole size counts (none of it is free until it starts), and nothing to say.
    _account(stubs, scheduled)
    result = _create(clients, _props(Type="capacity-block", NodeGroup=False))
    assert result["Data"]["ReservationNote"] == "none"


def test_a_reservation_shared_from_another_account_is_refused_only_in_a_node_groups_reservation_group(aws):
    """A capacity reservation group names its members by ARN, which the stack builds in its own account;
    one reservation (a launch template's target) or Karpenter's selector name it by id, which works shared."""
    clients, stubs = aws
    shared = {"OwnerId": "210987654321"}
    _account(stubs, _reservation(**shared), _reservation(CR2), params={"CapacityReservationIds": [CR, CR2]})
    text = _fails(clients, {**_props(Ids=[CR, CR2], Nodes=4), "Account": "123456789012"})
    assert (f"{CR} is shared with this account by 210987654321: the node group launches into a capacity reservation group "
            "of the reservations, whose members are named by ARN in this account (123456789012), where EC2 has no such "
            "reservation; name it alone (a launch template targets a shared reservation by its id), or use "
            "-c gpuCapacity=karpenter, which selects shared reservations by id") in text
    assert f"{CR2} is" not in text  # this account's own is fine
    _account(stubs, _reservation(**shared))
    assert _create(clients, {**_props(), "Account": "123456789012"})["Data"]["ReservationNote"] == "none"
    _account(stubs, _reservation(**shared), _reservation(CR2), params={"CapacityReservationIds": [CR, CR2]})
    assert _create(clients, {**_props(Ids=[CR, CR2], Nodes=4, NodeGroup=False), "Account": "123456789012"})


def test_an_interruptible_reservation_is_refused_with_the_reason_by_id_and_by_tags(aws):
    """EC2's interruptible Capacity Reservations: the owner reclaims the instances with two minutes' warning.
    Selected by tags, Karpenter would launch into it once the others are full, so it is not left out quietly."""
    clients, stubs = aws
    reclaimable = {"Interruptible": True, "OwnerId": "210987654321"}
    _account(stubs, _reservation(**reclaimable))
    assert (f"{CR} is interruptible: its owner may reclaim its instances with two minutes' warning, too short for the GPU "
            "workers' checkpoint at the notice (they drain for up to their 300-s grace), so a reclaim would count as a "
            "failure; name a reservation that is not interruptible, or use Spot (-c gpuCapacityType=spot), whose "
            "two-minute notice the run is built for") in _fails(clients, _props(NodeGroup=False))
    by_tags = {"Filters": [{"Name": "tag:team", "Values": ["ml"]}]}
    _account(stubs, _reservation(), _reservation(CR2, **reclaimable), params=by_tags)
    assert (f"capacityReservationTags=team=ml: {CR2} is interruptible: its owner may reclaim") in _fails(
        clients, _props(Ids=[], Tags={"team": "ml"}, NodeGroup=False))


def test_a_block_ending_before_the_deadline_passes_and_says_when_it_ends(aws):
    """Karpenter, two blocks: one starts in an hour and ends 9 hours later, before the 12-hour
    deadline counted from its start; the run checkpoints and stops before it ends."""
    clients, stubs = aws
    start, end = NOW + timedelta(hours=1), NOW + timedelta(hours=10)
    _account(stubs, _block(State="scheduled", StartDate=start, EndDate=end), _block(CR2, days=7),
             params={"CapacityReservationIds": [CR, CR2]})
    result = _create(clients, _props(Ids=[CR, CR2], Type="capacity-block", NodeGroup=False, DeadlineSeconds=12 * 3600))
    assert result["Data"]["ReservationEnds"] == f"{end:%Y-%m-%dT%H:%M:%SZ}"  # the earliest end
    assert result["Data"]["ReservationNote"] == (
        f"the Capacity Block {CR} ends at {end:%Y-%m-%dT%H:%M:%SZ} (its nodes go from "
        f"{end - timedelta(minutes=40):%Y-%m-%dT%H:%M:%SZ}), before the job's deadline (43200 s from "
        f"{start:%Y-%m-%dT%H:%M:%SZ}): the run checkpoints and stops before then; extend the block to run to the deadline")
    # A deadline the block outlasts: its end is told, nothing more.
    _account(stubs, _block(days=2), params={"CapacityReservationIds": [CR]})
    result = _create(clients, _props(Type="capacity-block", NodeGroup=False, DeadlineSeconds=3600))
    assert result["Data"] | {"QuotaVcpus": ""} == {"QuotaVcpus": "", "UpdateNeeds": "none short", "ReservationNote": "none",
                                                   "ReservationEnds": f"{NOW + timedelta(days=2):%Y-%m-%dT%H:%M:%SZ}"}


def test_reservations_selected_by_tags_leave_out_what_karpenter_would(aws):
    clients, stubs = aws
    by_tags = {"Filters": [{"Name": "tag:purpose", "Values": ["training"]}, {"Name": "tag:team", "Values": ["ml"]}]}
    _account(stubs, _reservation(), _reservation(CR2, InstanceType="g6.48xlarge"), params=by_tags)
    result = _create(clients, _props(Ids=[], Tags={"purpose": "training", "team": "ml"}, NodeGroup=False))
    assert result["Data"]["ReservationNote"] == (
        f"left out (as Karpenter leaves them out): {CR2} holds g6.48xlarge, not g6.12xlarge: deploy with "
        "-c gpuInstanceType=g6.48xlarge, or name a reservation of g6.12xlarge")
    # Tags that select none usable, or none at all, fail.
    _account(stubs, _reservation(CR2, State="cancelled"), params=by_tags)
    assert (f"capacityReservationTags=purpose=training,team=ml: none of the 1 reservation(s) these tags select can hold "
            f"the nodes: {CR2} is cancelled: create or buy another and deploy with its id; or select others by their "
            "tags") in _fails(clients, _props(Ids=[], Tags={"purpose": "training", "team": "ml"},
                                                                        NodeGroup=False))
    _account(stubs, params={"Filters": [{"Name": "tag:team", "Values": ["ml"]}]})
    assert ("capacityReservationTags=team=ml: no capacity reservation of this account and region has these tags: tag the "
            "reservations (aws ec2 create-tags), or name them with -c capacityReservationIds") in _fails(
        clients, _props(Ids=[], Tags={"team": "ml"}, NodeGroup=False))


def test_an_id_ec2_does_not_know_fails_with_ec2s_message(aws):
    clients, stubs = aws
    _account(stubs, error={"service_error_code": "InvalidCapacityReservationId.NotFound",
                           "service_message": f"The capacity reservation ID '{CR}' does not exist"})
    assert (f"capacityReservationIds={CR}: InvalidCapacityReservationId.NotFound: The capacity reservation ID '{CR}' does "
            "not exist; check the ids in this account and region") in _fails(clients, _props())


def test_a_refused_describe_is_a_problem_with_the_skip_hint(aws):
    clients, stubs = aws
    _account(stubs, error={"service_error_code": "UnauthorizedOperation",
                           "service_message": "explicit deny in a service control policy"})
    text = _fails(clients, _props())
    assert text.startswith("1 problem(s)")
    assert ("EC2 DescribeCapacityReservations: An error occurred (UnauthorizedOperation) when calling the "
            "DescribeCapacityReservations operation: explicit deny in a service control policy (its function has the "
            "permission") in text and "deploy with -c skipAccountChecks=true" in text


def test_an_update_fails_on_reservations_only_when_it_changes_them(aws):
    clients, stubs = aws
    expired = _reservation(State="expired")
    _account(stubs, expired)  # the same reservations (an update of something else, or a rollback): logged
    assert account_checks.on_event({"RequestType": "Update", "ResourceProperties": _props(),
                                    "OldResourceProperties": _props()}, clients=clients)["PhysicalResourceId"]
    _account(stubs, expired)
    with pytest.raises(account_checks.AccountNotReady, match=f"{CR} is expired"):
        account_checks.on_event({"RequestType": "Update", "ResourceProperties": _props(),
                                 "OldResourceProperties": PROPS}, clients=clients)


# ---------------------------------------------------------------- the construct's side (no AWS)


def test_the_request_names_each_wrong_prop_with_its_fix():
    assert ReservationRequest(ids=(CR,)).problems() == []
    assert ReservationRequest().problems() == [
        "reservations ids=[] tags={}: select the reservations one way, ids=('cr-0123456789abcdef0',) or tags={'team': 'ml'}"]
    assert ReservationRequest(tags={"team": "ml"}, reservation_type="block", deadline_seconds=0).problems() == [
        "reservations tags={'team': 'ml'} with node_group=True: a node group's launch template names its reservations; "
        "give ids, or use Karpenter (node_group=False)",
        "reservations reservation_type='block': use 'default' (On-Demand Capacity Reservations) or 'capacity-block'",
        "reservations deadline_seconds=0: give the job's activeDeadlineSeconds (> 0), or None"]


def test_the_function_finds_the_reservation_checks_beside_it():
    """Lambda loads ``account_checks`` as a top-level module of the handlers folder: no package."""
    import subprocess
    import sys

    from ray_train_eks.constructs.custom_resource import handlers_directory

    done = subprocess.run([sys.executable, "-c", "import account_checks; print(account_checks.reservation_checks.__name__)"],
                          cwd=handlers_directory(), capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": handlers_directory()})
    assert done.stdout.strip() == "reservation_checks", done.stderr


def test_a_scheduled_block_counts_the_size_its_tag_gives_while_its_counts_read_zero(aws):
    """EC2 User Guide, "View Capacity Blocks": before a block begins its available capacity reads
    zero, and the tag aws:ec2capacityreservation:incrementalRequestedQuantity says what it holds."""
    clients, stubs = aws
    start = NOW + timedelta(hours=2)
    tags = [{"Key": "aws:ec2capacityreservation:incrementalRequestedQuantity", "Value": "2"}]
    _account(stubs, _block(State="scheduled", StartDate=start, TotalInstanceCount=0, AvailableInstanceCount=0, Tags=tags))
    assert _create(clients, _props(Type="capacity-block", NodeGroup=False))["Data"]["ReservationNote"] == "none"
    # Without the tag, zero is zero: too few for the two nodes.
    _account(stubs, _block(State="scheduled", StartDate=start, TotalInstanceCount=0, AvailableInstanceCount=0))
    assert "the reservations have room for 0 g6.12xlarge instance(s)" in _fails(clients, _props(Type="capacity-block", NodeGroup=False))


def test_a_node_groups_block_starting_more_than_twenty_hours_away_is_refused_and_karpenter_waits(aws):
    """EC2 Auto Scaling User Guide, "Suspend and resume processes": a group whose launches have failed
    for about a day is suspended, and a node group made on a block days before its start launches
    (and fails) from the moment it is made. Karpenter asks EC2 for a block only once it is active."""
    clients, stubs = aws
    start = NOW + timedelta(days=2)
    scheduled = _block(State="scheduled", StartDate=start, AvailableInstanceCount=0, days=4)
    _account(stubs, scheduled)
    assert (f"{CR} starts at {start:%Y-%m-%dT%H:%M:%SZ}, more than a day from now: the node group's launches fail until "
            "then, and Auto Scaling suspends a group whose launches fail for a day, after which no node comes; deploy "
            "within 20 hours of its start, or with -c gpuCapacity=karpenter, which waits for it") in _fails(
        clients, _props(Type="capacity-block"))
    _account(stubs, scheduled)
    assert _create(clients, _props(Type="capacity-block", NodeGroup=False))["Data"]["ReservationNote"] == "none"


def _update(clients, props: dict, old: dict) -> dict:
    return account_checks.on_event({"RequestType": "Update", "ResourceProperties": props,
                                    "OldResourceProperties": old}, clients=clients)


def test_the_next_block_is_refused_while_the_current_one_still_runs_the_nodes(aws):
    """The node group is named after its block, and CloudFormation deletes a replaced resource in the
    update's clean-up, as soon as the new one exists: deploying next week's block while this week's
    runs the nodes would end the run and the rest of the paid block at once (EKS empties a block's
    group only 40 minutes before its end)."""
    clients, stubs = aws
    old, new = _props(Type="capacity-block"), _props(Type="capacity-block", Ids=[CR2])
    next_block = _block(CR2, State="scheduled", StartDate=NOW + timedelta(hours=6), AvailableInstanceCount=0, days=4)
    running = _block(days=2, AvailableInstanceCount=0)
    _account(stubs, next_block, params={"CapacityReservationIds": [CR2]})
    stubs["ec2"].add_response("describe_capacity_reservations", {"CapacityReservations": [running]},
                              {"CapacityReservationIds": [CR]})
    with pytest.raises(account_checks.AccountNotReady) as raised:
        _update(clients, new, old)
    end = NOW + timedelta(days=2)
    assert (f"the Capacity Block {CR} still runs 2 of the GPU nodes (it ends at {end:%Y-%m-%dT%H:%M:%SZ}): deploying {CR2} "
            f"replaces its node group at once, ending the run on it and the rest of the block; deploy the next block after "
            f"{end - timedelta(minutes=40):%Y-%m-%dT%H:%M:%SZ}") in str(raised.value)
    # Its nodes already gone (EKS scaled the group to 0 at end - 40 min, or nothing ever ran): the move goes ahead.
    for old_block in (_block(days=30 / (24 * 60), AvailableInstanceCount=0), _block(days=2)):
        _account(stubs, next_block, params={"CapacityReservationIds": [CR2]})
        stubs["ec2"].add_response("describe_capacity_reservations", {"CapacityReservations": [old_block]},
                                  {"CapacityReservationIds": [CR]})
        assert _update(clients, new, old)["Data"]["ReservationNote"].startswith(f"{CR2} starts at")
    # The same block (another change): the old one is not read again.
    _account(stubs, running)
    assert _update(clients, old, old)["PhysicalResourceId"]
