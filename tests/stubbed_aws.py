"""botocore Stubbers on the account checks' three clients (Service Quotas, EC2, SSM): every call
checked against the service's model, answered with recorded responses, none left unanswered."""

from __future__ import annotations

from contextlib import contextmanager

import boto3
from botocore.stub import Stubber


@contextmanager
def stubbed_account_clients(region: str = "us-west-2"):
    """``(clients, stubs)``: the handler's clients by name, and a Stubber on each, active."""
    kwargs = dict(region_name=region, aws_access_key_id="x", aws_secret_access_key="x")
    clients = {"quotas": boto3.client("service-quotas", **kwargs), "ec2": boto3.client("ec2", **kwargs),
               "ssm": boto3.client("ssm", **kwargs)}
    stubs = {name: Stubber(client) for name, client in clients.items()}
    for stub in stubs.values():
        stub.activate()
    yield clients, stubs
    for stub in stubs.values():
        stub.assert_no_pending_responses()
        stub.deactivate()
