"""Experiment tracking for the runs: SageMaker's managed MLflow, or an MLflow the user has.

Why an MLflow App and not a tracking server: ``AWS::SageMaker::MlflowApp`` is SageMaker's
serverless MLflow, which scales to zero and has no hourly charge ("at no additional cost", AWS
Machine Learning blog, "Scaling MLflow for enterprise AI", December 2025; the SageMaker Developer
Guide, "MLflow App setup", says apps "should be preferred"), and is created in minutes; an
``AWS::SageMaker::MlflowTrackingServer`` bills every hour it exists (Small: about 0.60 USD/h, some
440 USD a month) and takes up to 25 minutes to create (Developer Guide, "Create a tracking server").

What is made here: the App, its artifact store under ``mlflow/`` of the training bucket, and the
role it reads and writes that prefix with (trusted by ``sagemaker.amazonaws.com``). The Ray pods
reach it with the ``sagemaker-mlflow`` plugin, the App's ARN as their tracking URI, signing with
their own Pod Identity credentials: :func:`tracking_access` is what they need on it (see
:data:`MLFLOW_APP_ACTIONS`), and they write the artifacts to the bucket with the access they have
already. The App's name carries a
piece of the stack's id, so an App kept by an earlier ``cdk destroy`` (its runs are the user's)
never collides with the next deploy's.
"""

from __future__ import annotations

from aws_cdk import Fn, RemovalPolicy, Stack, aws_iam as iam, aws_s3 as s3, aws_sagemaker as sagemaker
from constructs import Construct

from ray_train_eks.nag import acknowledge, wildcard_rule

#: The App's artifact store: this prefix of the training bucket.
ARTIFACT_PREFIX = "mlflow"
#: What the training calls on a tracking server (training/telemetry/tracking.py: the experiment, the run, its
#: params, metrics and tags, its status; the registry's model and version, whose creation is polled until
#: READY; a create whose answer did not come is looked for before it is tried again: SearchRuns,
#: SearchModelVersions, training/telemetry/tracker_calls.py), as the Service Authorization Reference names
#: the ``sagemaker-mlflow`` actions; nothing that deletes.
TRACKING_SERVER_ACTIONS = ("GetExperimentByName", "CreateExperiment", "CreateRun", "GetRun", "UpdateRun", "LogBatch", "SetTag",
                           "GetMetricHistory", "SearchRuns", "CreateRegisteredModel", "CreateModelVersion", "GetModelVersion",
                           "SearchModelVersions")


#: What the Ray pods are granted on an MLflow App. AWS's sources name two authorizations, and a call
#: is refused unless the role has what the App checks, so both are granted, on that one App:
#: - ``sagemaker:CallMlflowAppApi``: the Service Authorization Reference's action for Apps (resource
#:   ``mlflow-app``), and the SageMaker API Reference, ``AccessControlConfiguration``: "a principal must
#:   still have sagemaker:CallMlflowAppApi permission to reach the app";
#: - the ``sagemaker-mlflow`` actions of :data:`TRACKING_SERVER_ACTIONS`: the SageMaker Developer Guide,
#:   "Set up IAM permissions for MLflow Apps" (docs.aws.amazon.com/sagemaker/latest/dg/mlflow-app-setup-prerequisites-iam.html):
#:   "You must configure authorization controls for sagemaker-mlflow actions"; and AWS's managed policy
#:   AmazonSageMakerJobFullAccess grants both on ``mlflow-app/*``.
MLFLOW_APP_ACTIONS = ("sagemaker:CallMlflowAppApi", *(f"sagemaker-mlflow:{action}" for action in TRACKING_SERVER_ACTIONS))


def tracking_access(uri: str) -> iam.PolicyStatement | None:
    """What the Ray pods need to log to ``uri``: for a SageMaker MLflow App the :data:`MLFLOW_APP_ACTIONS`
    on it; for a tracking server the :data:`TRACKING_SERVER_ACTIONS` on it; none for any other MLflow
    (an http(s) server the pods reach). A tracking server's artifacts go to its artifact store with the
    pods' own S3 access: a store outside the training bucket needs a grant of yours. (The App this stack
    makes is a token: :meth:`MlflowTracking.grant_logging`.)"""
    if uri.startswith("arn:") and ":mlflow-app/" in uri:
        return iam.PolicyStatement(actions=list(MLFLOW_APP_ACTIONS), resources=[uri])
    if uri.startswith("arn:") and ":mlflow-tracking-server/" in uri:
        return iam.PolicyStatement(actions=[f"sagemaker-mlflow:{action}" for action in TRACKING_SERVER_ACTIONS], resources=[uri])
    return None


class MlflowTracking(Construct):
    """A SageMaker MLflow App for the platform's runs (see the module's text).

    :param bucket: the training bucket; the App keeps its artifacts under ``mlflow/``.
    :param name_prefix: the App's name before the stack-id piece. Default - the stack's name.
    :param removal_policy: of the App (its runs). Default - RETAIN: ``cdk destroy`` keeps the runs.
    """

    def __init__(self, scope: Construct, id: str, *, bucket: s3.IBucket, name_prefix: str | None = None,
                 removal_policy: RemovalPolicy = RemovalPolicy.RETAIN) -> None:
        super().__init__(scope, id)
        stack = Stack.of(self)
        self.artifact_store_uri = f"s3://{bucket.bucket_name}/{ARTIFACT_PREFIX}"
        self.role = iam.Role(self, "Role", assumed_by=iam.ServicePrincipal("sagemaker.amazonaws.com"),
                             description="The MLflow App's access to its artifact store (the training bucket's mlflow/ prefix)")
        self.role.add_to_policy(iam.PolicyStatement(actions=["s3:ListBucket", "s3:GetBucketLocation"],
                                                    resources=[bucket.bucket_arn]))
        objects = bucket.arn_for_objects(f"{ARTIFACT_PREFIX}/*")
        self.role.add_to_policy(iam.PolicyStatement(actions=["s3:GetObject", "s3:PutObject", "s3:DeleteObject"],
                                                    resources=[objects]))
        acknowledge(self.role, "The MLflow App stores each run's artifacts under keys it chooses (experiment and run ids) "
                    "below the bucket's mlflow/ prefix: one wildcard there.", wildcard_rule(self, objects))
        # The first group of the stack id's UUID: a new one at every create of the stack.
        suffix = Fn.select(0, Fn.split("-", Fn.select(2, Fn.split("/", stack.stack_id))))
        self.app = sagemaker.CfnMlflowApp(
            self, "Resource",
            name=Fn.join("-", [name_prefix or stack.stack_name, suffix]),
            artifact_store_uri=self.artifact_store_uri,
            role_arn=self.role.role_arn,
            # Registering is --register-model's, into MLflow's own registry; no copy into SageMaker's.
            model_registration_mode="AutoModelRegistrationDisabled",
        )
        self.app.apply_removal_policy(removal_policy)
        # A kept App keeps the role it reads and writes its artifacts with.
        self.role.apply_removal_policy(removal_policy)
        self.role.node.find_child("DefaultPolicy").node.default_child.apply_removal_policy(removal_policy)
        self.app.node.add_dependency(self.role)
        #: What the pods are given as ``MLFLOW_TRACKING_URI``: the App's ARN (the sagemaker-mlflow plugin's URI).
        self.tracking_uri = self.app.attr_arn

    def grant_logging(self, role: iam.IRole) -> None:
        """Let ``role`` (the Ray pods') log runs to the App: the :data:`MLFLOW_APP_ACTIONS` on it."""
        role.add_to_principal_policy(iam.PolicyStatement(actions=list(MLFLOW_APP_ACTIONS), resources=[self.tracking_uri]))
