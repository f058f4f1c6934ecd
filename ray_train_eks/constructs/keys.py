"""The platform's customer managed KMS keys: one recipe, and the grant CloudWatch Logs needs."""

from __future__ import annotations

from aws_cdk import Duration, RemovalPolicy, Stack, aws_iam as iam, aws_kms as kms
from constructs import Construct


def customer_managed_key(scope: Construct, id: str, *, description: str, removal_policy: RemovalPolicy) -> kms.Key:
    """A rotating customer managed key whose deletion, when it goes, waits KMS's shortest period
    (7 days; ``kms.Key`` defaults to Retain, so ``removal_policy`` is always stated)."""
    return kms.Key(scope, id, enable_key_rotation=True, description=description, removal_policy=removal_policy,
                   pending_window=Duration.days(7))


def allow_logs_to_use(key: kms.IKey) -> None:
    """Let CloudWatch Logs encrypt and decrypt this account's log groups in this region with
    ``key`` (CloudWatch Logs guide, "Encrypt log data in CloudWatch Logs using AWS KMS": the
    regional service principal, a log group's ARN as encryption context)."""
    stack = Stack.of(key)
    key.add_to_resource_policy(iam.PolicyStatement(
        actions=["kms:Encrypt*", "kms:Decrypt*", "kms:ReEncrypt*", "kms:GenerateDataKey*", "kms:Describe*"],
        principals=[iam.ServicePrincipal(f"logs.{stack.region}.amazonaws.com")],
        resources=["*"],
        conditions={"ArnLike": {"kms:EncryptionContext:aws:logs:arn":
                                f"arn:{stack.partition}:logs:{stack.region}:{stack.account}:log-group:*"}},
    ))
