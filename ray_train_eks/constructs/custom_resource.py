"""A custom resource whose handler is one function of ``ray_train_eks/handlers`` (Python, boto3
from the Lambda runtime), run by CDK's provider framework: the handler returns to succeed and
raises to fail the deploy, its message becoming the resource's status reason."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any, Mapping, Sequence

from aws_cdk import CustomResource, Duration, RemovalPolicy, Stack, aws_iam as iam, aws_kms as kms, aws_lambda as lambda_
from aws_cdk import aws_logs as logs
from aws_cdk import custom_resources as cr
from constructs import Construct

from ray_train_eks.nag import acknowledge, checkov_skip, managed_policy_rule

#: CloudFormation takes at most 4,096 bytes of response; the framework adds a stack trace
#: and a log pointer to the message, so a handler keeps its message under this.
MAX_REASON_CHARS = 3000


def handlers_directory() -> str:
    """The folder of the handlers, the functions' code asset (it ships in the wheel)."""
    return str(resources.files("ray_train_eks.handlers"))


def handler_function(scope: Construct, *, handler: str, description: str, timeout: Duration,
                     retention: logs.RetentionDays = logs.RetentionDays.ONE_MONTH, log_encryption_key: kms.IKey | None = None,
                     environment: Mapping[str, str] | None = None) -> lambda_.Function:
    """A Lambda function ``Function`` in ``scope`` running ``handler`` (``module.function`` of
    ``ray_train_eks/handlers``), with its log group ``Logs`` (``retention``, deleted with the stack)."""
    return lambda_.Function(
        scope,
        "Function",
        runtime=lambda_.Runtime.PYTHON_3_14,
        handler=handler,
        code=lambda_.Code.from_asset(handlers_directory(), exclude=["__pycache__", "*.pyc"]),
        timeout=timeout,
        description=description,
        environment=dict(environment) if environment else None,
        log_group=logs.LogGroup(scope, "Logs", retention=retention, removal_policy=RemovalPolicy.DESTROY,
                                encryption_key=log_encryption_key),
    )


class PythonCustomResource(Construct):
    """Runs ``handler`` (``module.function`` in ``ray_train_eks/handlers``) on create, update
    and delete of the resource, with ``properties``.

    :param handler: e.g. ``log_groups.on_event``.
    :param properties: the resource's properties (what the handler reads).
    :param statements: the function's permissions, least privilege.
    :param timeout: the function's; at most 14 minutes (the framework's own Lambda stops at 15).
        Default - 2 minutes.
    :param log_encryption_key: of the function's log group (kept a month, deleted with the
        stack). Default - CloudWatch Logs' own encryption.
    """

    def __init__(self, scope: Construct, id: str, *, handler: str, properties: Mapping[str, Any],
                 statements: Sequence[iam.PolicyStatement], description: str,
                 timeout: Duration = Duration.minutes(2), log_encryption_key: kms.IKey | None = None) -> None:
        super().__init__(scope, id)
        self.function = handler_function(self, handler=handler, description=description, timeout=timeout,
                                         log_encryption_key=log_encryption_key)
        for statement in statements:
            self.function.add_to_role_policy(statement)
        self.provider = cr.Provider(
            self, "Provider", on_event_handler=self.function,
            log_group=logs.LogGroup(self, "ProviderLogs", retention=logs.RetentionDays.ONE_MONTH,
                                    removal_policy=RemovalPolicy.DESTROY, encryption_key=log_encryption_key),
        )
        if log_encryption_key is None:
            for group in ("Logs", "ProviderLogs"):
                checkov_skip(self.node.find_child(group),
                             "A deploy-time function's log: what it checked or cleaned up, no secret; CloudWatch Logs "
                             "encrypts it at rest with its own key (pass log_encryption_key for a customer managed one).",
                             "CKV_AWS_158")
        # No service timeout of our own: the function's is shorter than the framework's Lambda, so a
        # function that runs out of time is reported as a failure at once.
        self.resource = CustomResource(self, "Resource", service_token=self.provider.service_token,
                                       properties=dict(properties))
        stack = Stack.of(self)
        function_arn = stack.resolve(self.function.node.default_child.logical_id)
        acknowledge(
            self,
            "A deploy-time function and CDK's provider framework around it: Lambda's basic execution role writes the "
            "functions' logs; the framework may invoke only versions of this function; the framework's runtime is CDK's "
            "choice.",
            managed_policy_rule("AWSLambdaBasicExecutionRole", service_role=True),
            f"AwsSolutions-IAM5[Resource::<{function_arn}.Arn>:*]",
            "AwsSolutions-L1",
        )

    @staticmethod
    def json(value: Any) -> str:
        """A property value CloudFormation passes through unchanged (it turns numbers into strings)."""
        return json.dumps(value)
