"""Which MLflow the runs log to, as the platform's settings say it (no CDK here: the command and the
config read it too): an MLflow server's http(s) URL, or a SageMaker MLflow App's or tracking
server's ARN, which the ``sagemaker-mlflow`` plugin takes as a tracking URI."""

from __future__ import annotations

import re

from ray_train_eks.regions import MLFLOW_APP_REGIONS
from ray_train_eks.validation import Prop

#: An MLflow App's or tracking server's ARN (the pattern of the App's CloudFormation schema, and the
#: Service Authorization Reference's resource types ``mlflow-app`` and ``mlflow-tracking-server``).
SAGEMAKER_MLFLOW_ARN = re.compile(r"^arn:aws[a-z-]*:sagemaker:[a-z0-9-]+:\d{12}:(mlflow-app|mlflow-tracking-server)/[A-Za-z0-9-]+$")
#: The settings ConfigMap's key for the tracking URI (the Ray pods' ``MLFLOW_TRACKING_URI``).
TRACKING_URI_KEY = "mlflow_tracking_uri"


def tracking_uri_problem(uri: str | None, prop: Prop = Prop("tracking_uri")) -> str | None:
    """A tracking URI the pods can use: an MLflow server's http(s) URL or a SageMaker MLflow ARN."""
    if uri is None or uri.startswith(("http://", "https://")) or SAGEMAKER_MLFLOW_ARN.match(uri):
        return None
    return (f"{prop(uri)}: give an MLflow server's http(s):// URL the Ray pods reach, or the ARN of a "
            "SageMaker MLflow App (arn:aws:sagemaker:<region>:<account>:mlflow-app/app-...) or tracking server "
            "(...:mlflow-tracking-server/<name>)")


#: ``mlflowTracking``: ``auto``, an MLflow App where the region has them (:data:`MLFLOW_APP_REGIONS`) and
#: none elsewhere, said at synth; ``app``, an App (refused at synth where the region has none); ``none``.
TRACKING_CHOICES = ("auto", "app", "none")


def mlflow_app_made(choice: str, region: str) -> bool:
    """Whether the stack makes an MLflow App for ``mlflowTracking=choice`` in ``region`` (without a URI of the user's)."""
    return choice == "app" or (choice == "auto" and region in MLFLOW_APP_REGIONS)


def tracking_choice_problem(choice: str, *, region: str, uri: str | None) -> str | None:
    """Why ``mlflowTracking=choice`` cannot be, in ``region`` and with ``mlflowTrackingUri=uri``, or None."""
    if choice not in TRACKING_CHOICES:
        return (f"mlflowTracking={choice!r}: use auto (a SageMaker MLflow App where the region has them, else none), app "
                "(a SageMaker MLflow App for the runs) or none")
    if choice == "none" and uri:
        return f"mlflowTracking=none with mlflowTrackingUri={uri!r}: drop one (a URI is tracking to an MLflow of yours)"
    if choice == "app" and not uri and region not in MLFLOW_APP_REGIONS:
        return (f"mlflowTracking=app in {region}: CloudFormation has no SageMaker MLflow App "
                f"(AWS::SageMaker::MlflowApp) there and refuses a template with one; use -c mlflowTracking=auto "
                "(no tracking there), -c mlflowTrackingUri=<a SageMaker tracking server's ARN, or an http(s) MLflow the "
                f"Ray pods reach>, or a region with Apps: {', '.join(sorted(MLFLOW_APP_REGIONS))}")
    return None


def untracked_note(region: str) -> str:
    """What synth says where ``mlflowTracking=auto`` makes no App: the region has none."""
    return (f"mlflowTracking=auto in {region}: CloudFormation has no SageMaker MLflow App (AWS::SageMaker::MlflowApp) "
            "there, so the runs are not tracked in MLflow (metrics.jsonl, the curves and CloudWatch stay); to track "
            "them, give -c mlflowTrackingUri=<a SageMaker tracking server's ARN, or an http(s) MLflow the Ray pods reach>")
