"""The deploy-time functions (ray_train_eks/handlers), driven through botocore's Stubber: every
call is checked against the AWS service model (names, shapes), with recorded responses."""

from __future__ import annotations

import json

import boto3
import pytest
from botocore.stub import Stubber

from ray_train_eks.handlers import log_groups

NAMES = [f"/aws/containerinsights/c/{kind}" for kind in ("application", "dataplane", "host", "performance")]
KEY = "arn:aws:kms:us-west-2:123456789012:key/0a1b2c3d-0000-4000-8000-000000000000"


def _event(request_type: str, **props) -> dict:
    properties = {"LogGroupNames": NAMES[:2], "RetentionInDays": "30", "KmsKeyArn": KEY, "DeleteOnRemoval": "false", **props}
    event = {"RequestType": request_type, "ResourceProperties": properties}
    if request_type != "Create":
        event["PhysicalResourceId"] = "log-groups:" + ",".join(sorted(properties["LogGroupNames"]))
    return event


@pytest.fixture
def logs():
    client = boto3.client("logs", region_name="us-west-2", aws_access_key_id="x", aws_secret_access_key="x")
    with Stubber(client) as stubber:
        yield client, stubber
        stubber.assert_no_pending_responses()


def test_a_missing_group_is_created_with_the_key_and_given_the_retention(logs):
    client, stub = logs
    for name in NAMES[:2]:
        stub.add_response("create_log_group", {}, {"logGroupName": name, "kmsKeyId": KEY})
        stub.add_response("put_retention_policy", {}, {"logGroupName": name, "retentionInDays": 30})
    result = log_groups.on_event(_event("Create"), logs=client)
    assert result == {"PhysicalResourceId": "log-groups:" + ",".join(sorted(NAMES[:2]))}


def test_a_group_a_redeploy_finds_retained_is_adopted_not_an_error(logs):
    """observability=false, then true again: the retained group exists; its key and retention are set."""
    client, stub = logs
    name = NAMES[0]
    stub.add_client_error("create_log_group", service_error_code="ResourceAlreadyExistsException",
                          expected_params={"logGroupName": name, "kmsKeyId": KEY})
    stub.add_response("associate_kms_key", {}, {"logGroupName": name, "kmsKeyId": KEY})
    stub.add_response("put_retention_policy", {}, {"logGroupName": name, "retentionInDays": 90})
    log_groups.on_event(_event("Update", LogGroupNames=[name], RetentionInDays="90"), logs=client)


def test_without_a_key_an_adopted_group_loses_its_old_key(logs):
    client, stub = logs
    name = NAMES[1]
    stub.add_client_error("create_log_group", service_error_code="ResourceAlreadyExistsException",
                          expected_params={"logGroupName": name})
    stub.add_response("disassociate_kms_key", {}, {"logGroupName": name})
    stub.add_response("put_retention_policy", {}, {"logGroupName": name, "retentionInDays": 30})
    log_groups.on_event(_event("Update", LogGroupNames=[name], KmsKeyArn=""), logs=client)


def test_removal_deletes_the_groups_only_with_destroy_data(logs):
    client, stub = logs
    log_groups.on_event(_event("Delete"), logs=client)  # kept: no call at all
    stub.add_response("delete_log_group", {}, {"logGroupName": NAMES[0]})
    stub.add_client_error("delete_log_group", service_error_code="ResourceNotFoundException",
                          expected_params={"logGroupName": NAMES[1]})
    result = log_groups.on_event(_event("Delete", DeleteOnRemoval="true"), logs=client)
    assert result["PhysicalResourceId"] == "log-groups:" + ",".join(sorted(NAMES[:2]))


def test_any_other_error_fails_the_deploy_with_its_message(logs):
    client, stub = logs
    stub.add_client_error("create_log_group", service_error_code="AccessDeniedException",
                          service_message="not authorized to perform: logs:CreateLogGroup")
    with pytest.raises(client.exceptions.ClientError, match="not authorized to perform: logs:CreateLogGroup"):
        log_groups.on_event(_event("Create", LogGroupNames=NAMES[:1]), logs=client)


# ---------------------------------------------------------------- account checks

from ray_train_eks.handlers import account_checks  # noqa: E402
from stubbed_aws import stubbed_account_clients  # noqa: E402

QUOTAS = [{"Code": "L-DB2E81BA", "Name": "Running On-Demand G and VT instances", "Vcpus": 96, "Why": "2 x g6.12xlarge"}]
PROPS = {"InstanceType": "g6.12xlarge", "Quotas": json.dumps(QUOTAS), "AvailabilityZone": "us-west-2a",
         "KubernetesVersion": "1.36", "AmiRelease": "v20260714"}
AMI = "/aws/service/eks/optimized-ami/1.36/amazon-linux-2023/x86_64/nvidia"


def _quota(value: float) -> dict:
    """GetServiceQuota's response, as the Service Quotas API reference shapes it."""
    return {"Quota": {"ServiceCode": "ec2", "ServiceName": "Amazon Elastic Compute Cloud (Amazon EC2)",
                      "QuotaArn": "arn:aws:servicequotas:us-west-2:123456789012:ec2/L-DB2E81BA", "QuotaCode": "L-DB2E81BA",
                      "QuotaName": "Running On-Demand G and VT instances", "Value": value, "Unit": "None",
                      "Adjustable": True, "GlobalQuota": False}}


def _offerings(*azs: str, next_token: str | None = None) -> dict:
    page = {"InstanceTypeOfferings": [{"InstanceType": "g6.12xlarge", "LocationType": "availability-zone", "Location": az}
                                      for az in azs]}
    if next_token:
        page["NextToken"] = next_token
    return page


@pytest.fixture
def aws():
    with stubbed_account_clients() as clients_and_stubs:
        yield clients_and_stubs


def _offered(stubs, *pages):
    filters = [{"Name": "instance-type", "Values": ["g6.12xlarge"]}]
    for index, page in enumerate(pages):
        params = {"LocationType": "availability-zone", "Filters": filters}
        if index:
            params["NextToken"] = pages[index - 1]["NextToken"]
        stubs["ec2"].add_response("describe_instance_type_offerings", page, params)


def test_an_account_that_can_run_the_nodes_passes(aws, monkeypatch):
    clients, stubs = aws
    monkeypatch.setenv("AWS_REGION", "us-west-2")
    stubs["quotas"].add_response("get_service_quota", _quota(192.0), {"ServiceCode": "ec2", "QuotaCode": "L-DB2E81BA"})
    _offered(stubs, _offerings("us-west-2b", next_token="t1"), _offerings("us-west-2a", "us-west-2c"))
    stubs["ssm"].add_response("get_parameter", {"Parameter": {"Name": f"{AMI}/x", "Type": "String", "Value": "ami-0123"}},
                              {"Name": f"{AMI}/amazon-eks-node-al2023-x86_64-nvidia-1.36-v20260714/image_id"})
    result = account_checks.on_event({"RequestType": "Create", "ResourceProperties": PROPS}, clients=clients)
    assert result["Data"] == {"QuotaVcpus": '{"L-DB2E81BA": 192.0}', "UpdateNeeds": "none short"}


def test_every_problem_fails_the_deploy_at_once_with_its_fix(aws, monkeypatch):
    """A new account: quota 0; the type not in the AZ that us-west-2a is in this account; a release that never was."""
    clients, stubs = aws
    monkeypatch.setenv("AWS_REGION", "us-west-2")
    stubs["quotas"].add_client_error("get_service_quota", service_error_code="NoSuchResourceException")
    stubs["quotas"].add_response("get_aws_default_service_quota", _quota(0.0), {"ServiceCode": "ec2", "QuotaCode": "L-DB2E81BA"})
    _offered(stubs, _offerings("us-west-2b", "us-west-2c"))
    stubs["ssm"].add_client_error("get_parameter", service_error_code="ParameterNotFound")
    stubs["ssm"].add_response("get_parameters_by_path", {"Parameters": [
        {"Name": f"{AMI}/amazon-eks-node-al2023-x86_64-nvidia-1.36-v20260801/image_id", "Type": "String", "Value": "ami-1"},
        {"Name": f"{AMI}/amazon-eks-node-al2023-x86_64-nvidia-1.36-v20260901/image_id", "Type": "String", "Value": "ami-2"},
        {"Name": f"{AMI}/recommended/image_id", "Type": "String", "Value": "ami-2"},
    ]}, {"Path": AMI, "Recursive": True})
    with pytest.raises(account_checks.AccountNotReady) as raised:
        account_checks.on_event({"RequestType": "Create", "ResourceProperties": {**PROPS, "AmiRelease": "v20250101"}},
                                clients=clients)
    assert str(raised.value) == (
        "3 problem(s) with this account for the GPU nodes (checked before anything was built; -c skipAccountChecks=true "
        "skips this):\n"
        "- the quota 'Running On-Demand G and VT instances' (L-DB2E81BA) of us-west-2 is 0 vCPUs; 2 x g6.12xlarge need 96 "
        "(instances already running count against it too): request at least 96 in Service Quotas (aws service-quotas "
        "request-service-quota-increase --service-code ec2 --quota-code L-DB2E81BA --desired-value 96 --region us-west-2), "
        "or deploy fewer nodes\n"
        "- g6.12xlarge is not offered in us-west-2a, the GPU nodes' AZ (AZ names map to different zones in each account); "
        "it is offered in us-west-2b, us-west-2c: deploy with -c availabilityZones=us-west-2b,us-west-2a (the GPU nodes "
        "use the first)\n"
        f"- the AL2023 NVIDIA AMI release v20250101 for Kubernetes 1.36 does not exist in us-west-2 "
        f"({AMI}/amazon-eks-node-al2023-x86_64-nvidia-1.36-v20250101/image_id); releases that exist: v20260801, "
        "v20260901; deploy with -c gpuAmiVersion=v20260901"
    )


def test_service_quotas_out_of_reach_says_how_to_skip(aws, monkeypatch):
    clients, stubs = aws
    monkeypatch.setenv("AWS_REGION", "us-west-2")
    stubs["quotas"].add_client_error("get_service_quota", service_error_code="AccessDeniedException",
                                     service_message="explicit deny in a service control policy")
    _offered(stubs, _offerings("us-west-2a"))
    stubs["ssm"].add_response("get_parameter", {"Parameter": {"Name": "n", "Type": "String", "Value": "ami-1"}},
                              {"Name": f"{AMI}/recommended/image_id"})
    with pytest.raises(account_checks.AccountNotReady, match=r"explicit deny in a service control policy \(its function has the "
                                                             r"permission: a service control policy may deny it, or the service "
                                                             r"is out of reach\); the account cannot be checked: deploy with "
                                                             r"-c skipAccountChecks=true"):
        account_checks.on_event({"RequestType": "Create", "ResourceProperties": {**PROPS, "AmiRelease": ""}}, clients=clients)


def _all_good(stubs, *, quota=192.0):
    stubs["quotas"].add_response("get_service_quota", _quota(quota), {"ServiceCode": "ec2", "QuotaCode": "L-DB2E81BA"})
    _offered(stubs, _offerings("us-west-2a"))
    stubs["ssm"].add_response("get_parameter", {"Parameter": {"Name": "n", "Type": "String", "Value": "ami-1"}},
                              {"Name": f"{AMI}/amazon-eks-node-al2023-x86_64-nvidia-1.36-v20260714/image_id"})


def test_a_quota_service_quotas_cannot_read_and_failing_ec2_and_ssm_calls_are_problems_not_tracebacks(aws, monkeypatch):
    clients, stubs = aws
    monkeypatch.setenv("AWS_REGION", "us-west-2")
    unreadable = _quota(0.0)
    del unreadable["Quota"]["Value"]
    unreadable["Quota"]["ErrorReason"] = {"ErrorCode": "DEPENDENCY_THROTTLING_ERROR", "ErrorMessage": "EC2 throttled the call"}
    stubs["quotas"].add_response("get_service_quota", unreadable, {"ServiceCode": "ec2", "QuotaCode": "L-DB2E81BA"})
    stubs["ec2"].add_client_error("describe_instance_type_offerings", service_error_code="UnauthorizedOperation",
                                  service_message="not authorized by an SCP")
    stubs["ssm"].add_client_error("get_parameter", service_error_code="ThrottlingException", service_message="Rate exceeded")
    with pytest.raises(account_checks.AccountNotReady) as raised:
        account_checks.on_event({"RequestType": "Create", "ResourceProperties": PROPS}, clients=clients)
    text = str(raised.value)
    assert text.startswith("3 problem(s)") and text.count("deploy with -c skipAccountChecks=true") == 3
    assert "Service Quotas could not read the quota L-DB2E81BA (DEPENDENCY_THROTTLING_ERROR: EC2 throttled the call)" in text
    assert "EC2 DescribeInstanceTypeOfferings: An error occurred (UnauthorizedOperation)" in text
    assert "SSM GetParameter: An error occurred (ThrottlingException)" in text


def test_every_quota_the_nodes_count_against_is_checked(aws, monkeypatch):
    clients, stubs = aws
    monkeypatch.setenv("AWS_REGION", "us-west-2")
    quotas = [{"Code": "L-3819A6DF", "Name": "All G and VT Spot Instance Requests", "Vcpus": 96, "Why": "2 x g6.12xlarge"},
              {"Code": "L-DB2E81BA", "Name": "Running On-Demand G and VT instances", "Vcpus": 96,
               "Why": "2 x g6.12xlarge on-demand (Karpenter's fallback when Spot has no capacity)"},
              {"Code": "L-1216C47A", "Name": "Running On-Demand Standard (A, C, D, H, I, M, R, T, Z) instances", "Vcpus": 20,
               "Why": "1 x m7i.xlarge system node(s) and the 4 a node-group update launches first"}]
    for code, value in (("L-3819A6DF", 96.0), ("L-DB2E81BA", 0.0), ("L-1216C47A", 5.0)):
        stubs["quotas"].add_response("get_service_quota", _quota(value), {"ServiceCode": "ec2", "QuotaCode": code})
    _offered(stubs, _offerings("us-west-2a"))
    stubs["ssm"].add_response("get_parameter", {"Parameter": {"Name": "n", "Type": "String", "Value": "ami-1"}},
                              {"Name": f"{AMI}/amazon-eks-node-al2023-x86_64-nvidia-1.36-v20260714/image_id"})
    with pytest.raises(account_checks.AccountNotReady) as raised:
        account_checks.on_event({"RequestType": "Create", "ResourceProperties": {**PROPS, "Quotas": json.dumps(quotas)}},
                                clients=clients)
    text = str(raised.value)
    assert text.startswith("2 problem(s)")
    assert "(L-DB2E81BA) of us-west-2 is 0 vCPUs; 2 x g6.12xlarge on-demand (Karpenter's fallback" in text
    assert ("(L-1216C47A) of us-west-2 is 5 vCPUs; 1 x m7i.xlarge system node(s) and the 4 a node-group update launches "
            "first need 20") in text


def test_an_update_fails_only_when_it_asks_for_more(aws, monkeypatch):
    clients, stubs = aws
    monkeypatch.setenv("AWS_REGION", "us-west-2")
    more = json.dumps([{**QUOTAS[0], "Vcpus": 144, "Why": "3 x g6.12xlarge"}])
    # The same demand (an update of something else, or CloudFormation rolling back to these
    # properties): a refused or short quota is logged, not a failed update (UPDATE_ROLLBACK_FAILED).
    _all_good(stubs, quota=0.0)
    assert account_checks.on_event({"RequestType": "Update", "ResourceProperties": PROPS,
                                    "OldResourceProperties": {**PROPS, "Quotas": more}}, clients=clients)["PhysicalResourceId"]
    # A third node: checked, and refused.
    _all_good(stubs, quota=96.0)
    with pytest.raises(account_checks.AccountNotReady, match="is 96 vCPUs; 3 x g6.12xlarge need 144"):
        account_checks.on_event({"RequestType": "Update", "ResourceProperties": {**PROPS, "Quotas": more},
                                 "OldResourceProperties": PROPS}, clients=clients)


SURGE = [{**QUOTAS[0], "UpdateVcpus": 192, "UpdateWhy": "2 x g6.12xlarge and the 2 a node-group update launches first"}]


def test_a_create_fails_only_on_what_it_launches_and_says_what_an_update_will_need(aws, monkeypatch):
    """A new account's Standard quota (5 vCPUs) holds the one system node a create launches, not
    the surge of its first update: the create passes, and the output says what to request."""
    clients, stubs = aws
    monkeypatch.setenv("AWS_REGION", "us-west-2")
    props = {**PROPS, "Quotas": json.dumps(SURGE)}
    _all_good(stubs, quota=96.0)
    result = account_checks.on_event({"RequestType": "Create", "ResourceProperties": props}, clients=clients)
    assert result["Data"]["UpdateNeeds"] == ("L-DB2E81BA is 96 vCPUs, an update needs 192 (2 x g6.12xlarge and the 2 a "
                                             "node-group update launches first): request it before updating")
    # An update that asks for more (a third node) is held to what an update launches.
    more = json.dumps([{**SURGE[0], "Vcpus": 144, "UpdateVcpus": 240, "Why": "3 x g6.12xlarge",
                        "UpdateWhy": "3 x g6.12xlarge and the 2 a node-group update launches first"}])
    _all_good(stubs, quota=192.0)
    with pytest.raises(account_checks.AccountNotReady,
                       match="is 192 vCPUs; 3 x g6.12xlarge and the 2 a node-group update launches first need 240"):
        account_checks.on_event({"RequestType": "Update", "ResourceProperties": {**props, "Quotas": more},
                                 "OldResourceProperties": props}, clients=clients)


def test_delete_checks_nothing():
    assert account_checks.on_event({"RequestType": "Delete", "PhysicalResourceId": "account-checks",
                                    "ResourceProperties": PROPS}, clients={}) == {"PhysicalResourceId": "account-checks"}


def test_the_message_stays_within_what_cloudformation_shows():
    text = account_checks.message(["x" * 2000, "y" * 2000])
    assert len(text) <= account_checks.MAX_MESSAGE and text.endswith("(see the log)")
