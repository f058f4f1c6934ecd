"""The deploy-time functions (ray_train_eks/handlers), driven through botocore's Stubber: every
call is checked against the AWS service model (names, shapes), with recorded responses."""

from __future__ import annotations

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
