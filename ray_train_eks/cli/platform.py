"""The deployed platform as the job command finds it: the cluster (the user's AWS identity through
the stack's ``ClusterName``, or a kubeconfig), the deployed workload's spec and settings from the
settings ConfigMap, the training code installed here and the deployed code's digest, and the S3
client of the run records. Every failure a :class:`CliError` with its fix."""

from __future__ import annotations

import argparse

from ray_train_eks.cli.kube import Cluster, KubeError, from_eks, from_kubeconfig
from ray_train_eks.workload.code import CODE_DIGEST_ANNOTATION, SETTINGS_CONFIGMAP, TRAINING_CODE_CONFIGMAP, package_files
from ray_train_eks.workload.spec import RayWorkloadSpec, spec_from_settings


class CliError(RuntimeError):
    """What went wrong, said to the user (no traceback)."""


def connect(args: argparse.Namespace) -> Cluster:
    """The cluster, from the kubeconfig when one is named, else from the stack (the user's AWS identity)."""
    if args.kubeconfig or args.context:
        return from_kubeconfig(args.kubeconfig, args.context)
    import boto3
    from botocore.exceptions import ClientError

    session = boto3.Session(region_name=args.region)
    if not session.region_name:
        raise CliError("no AWS region: give --region (the stack's), or set AWS_REGION, or aws configure set region REGION")
    try:
        stack = session.client("cloudformation").describe_stacks(StackName=args.stack)["Stacks"][0]
    except ClientError as error:
        if "does not exist" in str(error):
            raise CliError(f"no stack {args.stack} in {session.region_name}: name the deployed stack with --stack NAME, its "
                           "region with --region (aws cloudformation list-stacks lists them)") from None
        raise
    outputs = {o["OutputKey"]: o["OutputValue"] for o in stack.get("Outputs") or []}
    if "ClusterName" not in outputs:
        raise CliError(f"stack {args.stack} has no ClusterName output: is it a ray-train-eks stack? (--stack names it)")
    identity = session.client("sts").get_caller_identity()["Arn"]
    return from_eks(outputs["ClusterName"], session=session, identity=identity)


def read_config_map(cluster: Cluster, namespace: str, name: str) -> dict | None:
    try:
        return cluster.request("CoreV1Api", "read_namespaced_config_map", name, namespace)
    except KubeError as error:
        if error.code == 404:
            return None
        raise


def platform(cluster: Cluster, namespace: str) -> tuple[RayWorkloadSpec, dict]:
    """The deployed workload's spec and the settings ConfigMap's data (the bucket), from the cluster."""
    settings = read_config_map(cluster, namespace, SETTINGS_CONFIGMAP)
    if settings is None:
        raise CliError(f"no ConfigMap {SETTINGS_CONFIGMAP} in namespace {namespace}: deploy the stack first (make "
                       "deploy), or name the Ray namespace with --namespace")
    data = settings.get("data") or {}
    if "workload" not in data:
        raise CliError(f"ConfigMap {namespace}/{SETTINGS_CONFIGMAP} holds no workload settings: the stack was deployed "
                       "by an older ray-train-eks; deploy it again with this one (make deploy)")
    return spec_from_settings(data["workload"]), data


def default_platform_spec() -> RayWorkloadSpec:
    """What ``cdk deploy`` builds with no settings given (ray_train_eks/config.py, whose rules live in
    ray_train_eks/rules/: no CDK is imported, Node.js never starts)."""
    from ray_train_eks.config import PlatformConfig

    return PlatformConfig.from_context({}, environ={}).workload_spec()


def installed_training_code() -> dict[str, str]:
    """The training package this ray-train-eks installed (path -> content), as the stack ships it
    (constructs/ray_workload.py ``bundled_training_code``: found, not imported)."""
    import importlib.util

    found = importlib.util.find_spec("ray_train_eks.training_code")
    if found is None or not found.submodule_search_locations:
        raise CliError("ray_train_eks.training_code is not installed: reinstall ray-train-eks")
    return package_files(list(found.submodule_search_locations)[0])


def deployed_code_digest(cluster: Cluster, namespace: str) -> str | None:
    """The digest of the deployed training code (None: none deployed, a custom entrypoint's platform)."""
    config_map = read_config_map(cluster, namespace, TRAINING_CODE_CONFIGMAP)
    return None if config_map is None else (config_map.get("metadata", {}).get("annotations") or {}).get(CODE_DIGEST_ANNOTATION)


def s3_client(args: argparse.Namespace):
    import boto3

    return boto3.Session(region_name=args.region).client("s3")
