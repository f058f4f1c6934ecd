"""Experiment tracking as deployed (ray_train_eks/constructs/tracking.py): a SageMaker MLflow App by
default where the region has them (tests/test_regions.py: elsewhere), an MLflow of the user's by -c mlflowTrackingUri, none by -c mlflowTracking=none; the Ray
pods' access, environment and runtime env; outputs, cost line, what destroy keeps. cfn-lint and
cdk-nag run over the same templates (tests/test_quality_gates.py)."""

from __future__ import annotations

import json

import pytest

from conftest import TEAM_TRACKING_SERVER
from ray_train_eks.config import ConfigError, PlatformConfig

pytestmark = pytest.mark.synth


def _pods_role_statements(platform) -> list[dict]:
    (association,) = [r["Properties"] for r in platform.resources("AWS::EKS::PodIdentityAssociation").values()
                      if r["Properties"]["ServiceAccount"] == "ray-train"]
    role_id = association["RoleArn"]["Fn::GetAtt"][0]
    return [s for p in platform.resources("AWS::IAM::Policy").values() if {"Ref": role_id} in p["Properties"]["Roles"]
            for s in p["Properties"]["PolicyDocument"]["Statement"]]


def _settings(platform) -> list:
    """The settings ConfigMap's manifest as CloudFormation joins it (the bucket's name, the App's ARN: tokens)."""
    (settings,) = [r for r in platform.resources("Custom::AWSCDK-EKS-KubernetesResource").values()
                   if isinstance(r["Properties"]["Manifest"], dict) and "ray-train-eks-settings" in json.dumps(r["Properties"]["Manifest"])]
    return settings["Properties"]["Manifest"]["Fn::Join"][1]


def _env(platform, group: str = "headGroupSpec") -> dict:
    _, job = platform.ray_job()
    spec = job["spec"]["rayClusterSpec"]
    pod = spec[group] if group == "headGroupSpec" else spec[group][0]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in pod["template"]["spec"]["containers"][0]["env"]}


def test_the_default_platform_makes_an_mlflow_app_in_the_bucket_and_the_pods_log_to_it(default_platform):
    (app_id, app), = default_platform.resources("AWS::SageMaker::MlflowApp").items()
    properties = app["Properties"]
    bucket_id = next(iter(default_platform.resources("AWS::S3::Bucket")))
    assert properties["ArtifactStoreUri"] == {"Fn::Join": ["", ["s3://", {"Ref": bucket_id}, "/mlflow"]]}
    assert properties["ModelRegistrationMode"] == "AutoModelRegistrationDisabled"
    assert app["DeletionPolicy"] == "Retain"  # the runs are the user's: kept by cdk destroy
    name = json.dumps(properties["Name"])
    assert "RayTrainEks" in name and "AWS::StackId" in name  # a new name at each create of the stack
    role = default_platform.template["Resources"][properties["RoleArn"]["Fn::GetAtt"][0]]["Properties"]
    assert "sagemaker.amazonaws.com" in json.dumps(role["AssumeRolePolicyDocument"])
    # The Ray pods: on the App and nothing else, the action the Service Authorization Reference names for
    # Apps and the sagemaker-mlflow actions the SageMaker guide names (constructs/tracking.py
    # MLFLOW_APP_ACTIONS); its ARN as their tracking URI, from the settings.
    (on_app,) = [s for s in _pods_role_statements(default_platform) if s["Resource"] == {"Fn::GetAtt": [app_id, "Arn"]}]
    assert on_app["Effect"] == "Allow" and "sagemaker:CallMlflowAppApi" in on_app["Action"]
    assert {"sagemaker-mlflow:CreateRun", "sagemaker-mlflow:LogBatch", "sagemaker-mlflow:CreateModelVersion"} <= set(on_app["Action"])
    assert not [a for a in on_app["Action"] if "Delete" in a or "*" in a]
    parts = _settings(default_platform)
    assert {"Fn::GetAtt": [app_id, "Arn"]} in parts and '"mlflow_tracking_uri":"' in "".join(p for p in parts if isinstance(p, str))
    for group in ("headGroupSpec", "workerGroupSpecs"):
        env = _env(default_platform, group)
        assert env["MLFLOW_TRACKING_URI"] == {"configMapKeyRef": {"name": "ray-train-eks-settings",
                                                                   "key": "mlflow_tracking_uri", "optional": True}}
        assert env["RAY_TRAIN_EKS_MLFLOW_EXPERIMENT"] == "RayTrainEks"
        assert json.loads(env["RAY_TRAIN_EKS_PLATFORM"]) == {"gpu_type": "L4", "image": default_platform.stack.config.ray_image,
                                                              "instance_type": "g6.12xlarge", "node_count": 2,
                                                              "gpu_usd_per_hour": 9.2032}
    _, job = default_platform.ray_job()
    assert "mlflow-skinny==3.17.2" in job["spec"]["runtimeEnvYAML"] and "sagemaker-mlflow==0.5.0" in job["spec"]["runtimeEnvYAML"]
    outputs = default_platform.template["Outputs"]
    assert outputs["MlflowTrackingUri"]["Value"] == {"Fn::GetAtt": [app_id, "Arn"]}
    assert "create-presigned-mlflow-app-url" in json.dumps(outputs["MlflowUiCommand"]["Value"])
    assert "MLflow App 0.00 (serverless, no hourly charge)" in outputs["EstimatedCostUsdPerHour"]["Description"]


def test_with_destroy_data_the_app_goes_with_the_stack(p4d_platform):
    (app,) = p4d_platform.resources("AWS::SageMaker::MlflowApp").values()
    assert app.get("DeletionPolicy", "Delete") == "Delete"


def test_the_users_tracking_server_gets_access_and_no_app_is_made(queued_platform):
    assert queued_platform.resources("AWS::SageMaker::MlflowApp") == {}
    (statement,) = [s for s in _pods_role_statements(queued_platform) if s["Resource"] == TEAM_TRACKING_SERVER]
    assert "sagemaker-mlflow:LogBatch" in statement["Action"] and "sagemaker-mlflow:CreateModelVersion" in statement["Action"]
    assert not [a for a in statement["Action"] if "Delete" in a or "*" in a]
    assert f'"mlflow_tracking_uri":"{TEAM_TRACKING_SERVER}"' in "".join(p for p in _settings(queued_platform) if isinstance(p, str))
    assert "MlflowTrackingUri" not in queued_platform.template["Outputs"]


def test_without_tracking_the_pods_have_no_tracker_and_install_no_client(karpenter_platform):
    assert karpenter_platform.resources("AWS::SageMaker::MlflowApp") == {}
    assert "mlflow_tracking_uri" not in json.dumps(_settings(karpenter_platform))
    assert "MLFLOW_TRACKING_URI" not in _env(karpenter_platform)
    _, job = karpenter_platform.ray_job()
    assert "mlflow" not in job["spec"]["runtimeEnvYAML"]
    assert not [s for s in _pods_role_statements(karpenter_platform) if "mlflow" in json.dumps(s).lower()]


@pytest.mark.parametrize("context, message", [
    ({"mlflowTracking": "server"}, "mlflowTracking='server': use auto (a SageMaker MLflow App where the region has them, "
                                   "else none), app (a SageMaker MLflow App for the runs) or none"),
    ({"mlflowTrackingUri": "mlflow.internal:5000"}, "mlflowTrackingUri='mlflow.internal:5000': give an MLflow server's "
                                                     "http(s):// URL"),
    ({"mlflowTrackingUri": "arn:aws:sagemaker:us-west-2:123456789012:notebook-instance/x"},
     "mlflowTrackingUri='arn:aws:sagemaker:us-west-2:123456789012:notebook-instance/x': give"),
    ({"mlflowTracking": "none", "mlflowTrackingUri": "http://mlflow.internal:5000"}, "mlflowTracking=none with mlflowTrackingUri"),
])
def test_bad_tracking_settings_fail_synth_naming_the_key(context, message):
    with pytest.raises(ConfigError) as raised:
        PlatformConfig.from_context(context.get, environ={})
    assert any(problem.startswith(message) for problem in raised.value.problems), raised.value.problems


def test_an_http_mlflow_needs_no_iam():
    from ray_train_eks.constructs.tracking import tracking_access

    assert tracking_access("http://mlflow.internal:5000") is None
    spec = PlatformConfig.from_context({"mlflowTrackingUri": "http://mlflow.internal:5000"}.get, environ={}).workload_spec()
    assert spec.tracking and spec.tracking_experiment == "RayTrainEks"


def test_a_users_mlflow_app_gets_both_authorizations_aws_names_on_that_app_alone():
    """The Service Authorization Reference authorizes Apps by sagemaker:CallMlflowAppApi; the SageMaker guide
    ("Set up IAM permissions for MLflow Apps") by sagemaker-mlflow actions: with one missing every call
    would be refused, so both, on the one App."""
    from aws_cdk import Stack

    from ray_train_eks.constructs.tracking import TRACKING_SERVER_ACTIONS, tracking_access

    app = "arn:aws:sagemaker:us-west-2:123456789012:mlflow-app/app-ABC123"
    statement = Stack().resolve(tracking_access(app).to_statement_json())
    assert statement["Resource"] == app
    assert statement["Action"] == ["sagemaker:CallMlflowAppApi", *(f"sagemaker-mlflow:{a}" for a in TRACKING_SERVER_ACTIONS)]
