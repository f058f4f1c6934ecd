"""The example consumer app synthesizes with our constructs imported from the package."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.synth
ROOT = Path(__file__).resolve().parents[1]


def test_consumer_app_synthesizes_with_existing_vpc_and_cluster(tmp_path):
    env = {**os.environ, "CDK_OUTDIR": str(tmp_path)}
    subprocess.run([sys.executable, str(ROOT / "examples/consumer_app/app.py")], check=True, env=env, cwd=tmp_path, capture_output=True)
    template = json.loads((tmp_path / "ResearchGpuStack.template.json").read_text())
    resources = template["Resources"].values()
    assert sum(r["Type"] == "AWS::EC2::VPC" for r in resources) == 1  # ours reused theirs
    assert sum(r["Type"] == "AWS::EKS::Cluster" for r in resources) == 1
    (efa_template,) = [
        r for r in resources if r["Type"] == "AWS::EC2::LaunchTemplate" and "NetworkInterfaces" in r["Properties"]["LaunchTemplateData"]
    ]
    assert len(efa_template["Properties"]["LaunchTemplateData"]["NetworkInterfaces"]) == 32  # p5.48xlarge: 32 cards
    charts = sorted(r["Properties"]["Chart"] for r in resources if r["Type"] == "Custom::AWSCDK-EKS-HelmChart")
    assert charts == ["aws-efa-k8s-device-plugin", "kuberay-operator", "nvidia-device-plugin"]


def test_constructs_are_importable_from_the_package():
    import ray_train_eks.constructs as public

    assert set(public.__all__) == {
        "EfaDevicePlugin", "EfaNodeGroup", "KubeRayOperator", "NvidiaDevicePlugin",
        "RayServiceAccount", "TrainingBucket", "TrainingCluster", "TrainingNetwork",
    }


def test_efa_node_group_rejects_a_type_without_efa():
    from aws_cdk import App, Stack, aws_ec2 as ec2, aws_eks_v2 as eks

    from ray_train_eks.constructs import EfaNodeGroup

    stack = Stack(App(), "S")
    cluster = eks.Cluster.from_cluster_attributes(stack, "C", cluster_name="c", vpc=ec2.Vpc(stack, "V"))
    with pytest.raises(ValueError, match=r"instance_type='g6.xlarge' is not an EFA-capable GPU type; use one of g5.48xlarge"):
        EfaNodeGroup(stack, "G", cluster=cluster, subnet=cluster.vpc.private_subnets[0], instance_type="g6.xlarge")
