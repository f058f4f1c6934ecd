"""The cluster's running GPU instances, counted from EC2 each minute: the idle-GPU alarm's input
that no agent on the nodes can silence (ray_train_eks/handlers/gpu_instances.py)."""

from __future__ import annotations

from typing import Sequence

from aws_cdk import Duration, aws_cloudwatch as cw, aws_events as events, aws_events_targets as targets, aws_iam as iam
from aws_cdk import aws_kms as kms, aws_logs as logs
from constructs import Construct

from ray_train_eks.constructs.custom_resource import handler_function
from ray_train_eks.constructs.keys import allow_logs_to_use
from ray_train_eks.nag import acknowledge, checkov_skip, managed_policy_rule
from ray_train_eks.observability import TRAINING_METRICS_NAMESPACE

PERIOD = Duration.minutes(1)


class GpuInstanceCounter(Construct):
    """Each minute, the cluster's running instances of ``instance_types``, counted from EC2 by a
    function (ray_train_eks/handlers/gpu_instances.py) and published as ``GpuInstancesRunning``
    (``ClusterName``) in ``namespace``: a count of what bills that no agent on the nodes can
    silence; instances of ``excluded_node_pools`` (Karpenter NodePools: serving's) are not counted. 43,200 calls a month: within Lambda's free tier; one custom metric, 0.30 USD a month,
    and its PutMetricData calls, about 0.43 USD.
    """

    METRIC_NAME = "GpuInstancesRunning"

    def __init__(self, scope: Construct, id: str, *, cluster_name: str, instance_types: Sequence[str],
                 namespace: str = TRAINING_METRICS_NAMESPACE, log_encryption_key: kms.IKey | None = None,
                 excluded_node_pools: Sequence[str] = ()) -> None:
        super().__init__(scope, id)
        if log_encryption_key is not None:
            allow_logs_to_use(log_encryption_key)  # CloudWatch Logs may use the key (its policy)
        self.function = handler_function(
            self, handler="gpu_instances.handler", timeout=Duration.seconds(50), log_encryption_key=log_encryption_key,
            description="ray-train-eks: the cluster's running GPU instances, from EC2", retention=logs.RetentionDays.ONE_WEEK,
            environment={"CLUSTER_NAME": cluster_name, "INSTANCE_TYPES": ",".join(instance_types), "NAMESPACE": namespace,
                         "METRIC": self.METRIC_NAME,
                         **({"EXCLUDED_NODE_POOLS": ",".join(excluded_node_pools)} if excluded_node_pools else {})},
        )
        self.function.add_to_role_policy(iam.PolicyStatement(actions=["ec2:DescribeInstances"], resources=["*"]))
        self.function.add_to_role_policy(iam.PolicyStatement(
            actions=["cloudwatch:PutMetricData"], resources=["*"],
            conditions={"StringEquals": {"cloudwatch:namespace": namespace}}))
        acknowledge(self.function, "DescribeInstances and PutMetricData take no resource (Service Authorization "
                                   "Reference); PutMetricData is held to this namespace by its condition key.",
                    "AwsSolutions-IAM5[Resource::*]")
        acknowledge(self.function, "The function's role has the Lambda basic execution policy, which AWS keeps.",
                    managed_policy_rule("AWSLambdaBasicExecutionRole", service_role=True))
        for check, reason in (
            ("CKV_AWS_115", "One invocation a minute, each a second long; reserved concurrency would take from the "
                            "account's unreserved pool, which a new account (10 in all) cannot spare."),
            ("CKV_AWS_116", "Invoked by EventBridge each minute: a failed count is replaced by the next minute's, and the "
                            "alarm falls back on the agent's GPU count meanwhile; a dead-letter queue would keep nothing "
                            "worth replaying."),
            ("CKV_AWS_117", "Calls the EC2 and CloudWatch APIs only; in the VPC it would need a NAT route or an interface "
                            "endpoint for each."),
            ("CKV_AWS_173", "Its environment holds the cluster's name, the GPU types and a metric's name, no secret; "
                            "Lambda encrypts it at rest with an AWS managed key."),
        ):
            checkov_skip(self.function, reason, check)
        self.rule = events.Rule(self, "EveryMinute", schedule=events.Schedule.rate(Duration.minutes(1)),
                                targets=[targets.LambdaFunction(self.function, retry_attempts=0)])
        self.metric = cw.Metric(namespace=namespace, metric_name=self.METRIC_NAME, dimensions_map={"ClusterName": cluster_name},
                                statistic="Maximum", period=PERIOD, label="the cluster's running GPU instances (EC2)")
