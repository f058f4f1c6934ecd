"""Where data sets, checkpoints and models live, and who may touch them."""

from __future__ import annotations

import cdk8s
from aws_cdk import Duration, Stack, RemovalPolicy, aws_eks_v2 as eks, aws_iam as iam, aws_s3 as s3
from constructs import Construct

from ray_train_eks.charts.ray_workload_chart import NamespaceChart
from ray_train_eks.nag import acknowledge, checkov_skip
from ray_train_eks.scheduling import RAY_NAMESPACE, RAY_SERVICE_ACCOUNT


class TrainingBucket(Construct):
    """One S3 bucket for data sets, checkpoints and final models.

    Encrypted, public access blocked, TLS only, versioned. It outlives ``cdk destroy``
    (checkpoints are the user's work) unless ``destroy_data`` is set, which deletes the
    bucket and every object in it.

    :param destroy_data: Default - False: the bucket is retained.
    :param existing_bucket: use this bucket instead of creating one. Default - a new bucket.
    """

    def __init__(self, scope: Construct, id: str, *, destroy_data: bool = False, existing_bucket: s3.IBucket | None = None) -> None:
        super().__init__(scope, id)
        if existing_bucket is not None and destroy_data:
            raise ValueError("TrainingBucket: destroy_data applies to a bucket this construct creates, not to existing_bucket")
        if existing_bucket is not None:
            self.bucket = existing_bucket
            return
        self.bucket = s3.Bucket(
            self,
            "Resource",
            encryption=s3.BucketEncryption.S3_MANAGED,
            block_public_access=s3.BlockPublicAccess.BLOCK_ALL,
            enforce_ssl=True,
            versioned=True,
            removal_policy=RemovalPolicy.DESTROY if destroy_data else RemovalPolicy.RETAIN,
            auto_delete_objects=destroy_data,
            lifecycle_rules=[
                # Checkpoints are rewritten every few hundred steps; old versions pile up.
                s3.LifecycleRule(noncurrent_version_expiration=Duration.days(30)),
                s3.LifecycleRule(abort_incomplete_multipart_upload_after=Duration.days(7)),
            ],
        )
        no_access_logs = ("Server access logs would need a second retained bucket; CloudTrail S3 data events are the "
                          "audit path for this bucket, which only the Ray pods' Pod Identity role can reach.")
        acknowledge(self.bucket, no_access_logs, "AwsSolutions-S1")
        checkov_skip(self.bucket, no_access_logs, "CKV_AWS_18")


class RayServiceAccount(Construct):
    """The Kubernetes service account of the Ray pods, in its own namespace, bound by EKS
    Pod Identity to a role that can read and write the training bucket and nothing else.

    :param namespace: Default - ray-train (created here).
    :param name: Default - ray-train.
    :param metrics_namespace: a CloudWatch namespace the pods may put metrics into (the
        training metrics of ``RayWorkloadSpec.metrics_namespace``), and no other. Default - none.
    """

    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        cluster: eks.ICluster,
        bucket: s3.IBucket,
        namespace: str = RAY_NAMESPACE,
        name: str = RAY_SERVICE_ACCOUNT,
        metrics_namespace: str | None = None,
    ) -> None:
        super().__init__(scope, id)
        self.namespace = namespace
        # The service account itself is aws_eks_v2's (it wires Pod Identity); the namespace is ours.
        # "manifest-RayNamespace": the id add_manifest gave it before; a new logical id would
        # make CloudFormation delete the old manifest, and with it the namespace and its pods.
        self.namespace_manifest = namespace_manifest = cluster.add_cdk8s_chart(
            "manifest-RayNamespace", NamespaceChart(cdk8s.App(), "RayNamespace", name=namespace)
        )
        self.service_account = eks.ServiceAccount(
            self,
            "Resource",
            cluster=cluster,
            name=name,
            namespace=namespace,
            identity_type=eks.IdentityType.POD_IDENTITY,
        )
        self.service_account.node.add_dependency(namespace_manifest)
        self.role = self.service_account.role
        # Exact actions instead of grant_read_write's wildcards: what Ray Train's pyarrow S3
        # filesystem and the Hugging Face uploads need, on this bucket only.
        self.role.add_to_principal_policy(
            iam.PolicyStatement(
                actions=["s3:ListBucket", "s3:GetBucketLocation", "s3:ListBucketMultipartUploads"],
                resources=[bucket.bucket_arn],
            )
        )
        self.role.add_to_principal_policy(
            iam.PolicyStatement(
                actions=["s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload", "s3:ListMultipartUploadParts"],
                resources=[bucket.arn_for_objects("*")],
            )
        )
        acknowledge(
            self.role,
            "Checkpoints and models are written under run-specific keys decided at run time: the role needs every "
            "object of the training bucket, and of that bucket only.",
            _objects_rule(bucket),
        )
        if metrics_namespace:
            self.role.add_to_principal_policy(
                iam.PolicyStatement(
                    actions=["cloudwatch:PutMetricData"],
                    resources=["*"],
                    conditions={"StringEquals": {"cloudwatch:namespace": metrics_namespace}},
                )
            )
            acknowledge(
                self.role,
                "cloudwatch:PutMetricData has no resource-level permissions (Resource must be *); the "
                "cloudwatch:namespace condition limits it to the training metrics' namespace.",
                "AwsSolutions-IAM5[Resource::*]",
            )


def _objects_rule(bucket: s3.IBucket) -> str:
    """cdk-nag's id for a wildcard over ``bucket``'s objects, as it names it."""
    cfn = bucket.node.default_child
    if isinstance(cfn, s3.CfnBucket):
        return f"AwsSolutions-IAM5[Resource::<{Stack.of(bucket).resolve(cfn.logical_id)}.Arn>/*]"
    return f"AwsSolutions-IAM5[Resource::{bucket.bucket_arn}/*]"
