"""Which MLflow the runs log to, as the platform's settings say it (no CDK here: the command and the
config read it too): an MLflow server's http(s) URL, or a SageMaker MLflow App's or tracking
server's ARN, which the ``sagemaker-mlflow`` plugin takes as a tracking URI."""

from __future__ import annotations

import re

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
