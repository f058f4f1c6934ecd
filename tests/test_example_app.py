"""A consumer's CDK app, as a new user runs it: a wheel of this repository installed into a
fresh virtual environment, and the app synthesized from outside the repository, with its
own VPC, cluster (a default node group, none of our labels) and training package.

The environment is cached under .cache/ (keyed by the declared dependencies and the pins),
so only the first run pays for installing aws-cdk-lib and friends; the wheel itself is
rebuilt and reinstalled every session.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.synth
ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "consumer_app"


def _declared_dependencies() -> list[str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> Path:
    """A wheel of the repository, built as `pip wheel .` builds it."""
    out = tmp_path_factory.mktemp("wheel")
    # setuptools builds in ./build and never deletes from it: a module removed since the last
    # build would still be packaged. Start clean, leave clean.
    shutil.rmtree(ROOT / "build", ignore_errors=True)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(out), str(ROOT)],
                   check=True, capture_output=True)
    shutil.rmtree(ROOT / "build", ignore_errors=True)
    (built,) = out.glob("ray_train_eks-*.whl")
    return built


@pytest.fixture(scope="session")
def consumer_python(wheel) -> Path:
    """A fresh venv (no access to this repository or its venv) with the wheel and the
    dependencies it declares, resolved by pip within constraints.txt."""
    key = hashlib.sha256(json.dumps(_declared_dependencies()).encode() + (ROOT / "constraints.txt").read_bytes()).hexdigest()[:12]
    venv = ROOT / ".cache" / f"consumer-venv-{key}"
    python = venv / "bin" / "python"
    # No byte-compiling of every installed file (aws-cdk-lib's are most of it: 24 of the install's 27
    # CPU-seconds here); the consumer's Python writes the bytecode of what it imports, as a user's does.
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-compile"]
    if not (venv / ".dependencies-installed").exists():
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([*pip, "-c", str(ROOT / "constraints.txt"), str(wheel)], check=True, capture_output=True)
        (venv / ".dependencies-installed").touch()
    subprocess.run([*pip, "--no-deps", "--force-reinstall", str(wheel)], check=True, capture_output=True)
    return python


def _consumer_env() -> dict[str, str]:
    """A user's environment for the consumer's Python: nothing of this repository or its venv, and
    bytecode written as a user's Python writes it (the venv is installed without it)."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONDONTWRITEBYTECODE")}


@pytest.fixture(scope="session")
def consumer_out(consumer_python, tmp_path_factory) -> Path:
    """The example consumer app synthesized by the venv's Python in a folder outside the repository."""
    workdir = tmp_path_factory.mktemp("consumer")
    shutil.copytree(EXAMPLE, workdir / "app", ignore=shutil.ignore_patterns("__pycache__"))
    env = _consumer_env()
    env.update({"CDK_OUTDIR": str(workdir / "cdk.out"), "JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION": "20"})
    result = subprocess.run([str(consumer_python), "app.py"], cwd=workdir / "app", env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir / "cdk.out"


@pytest.fixture(scope="session")
def consumer_template(consumer_out) -> dict:
    """The consumer's stack with a GPU node group."""
    return _with_nested(consumer_out, "ResearchGpuStack")


@pytest.fixture(scope="session")
def consumer_on_demand_template(consumer_out) -> dict:
    """The consumer's stack with GPU nodes from Karpenter."""
    return _with_nested(consumer_out, "ResearchOnDemandGpuStack")


def _with_nested(outdir, stack_name: str) -> dict:
    """The stack's template with its nested stacks' resources (the training code's) among its own."""
    from platform_synth import nested_resources

    template = json.loads((outdir / f"{stack_name}.template.json").read_text())
    template["Resources"].update(nested_resources(outdir, stack_name))
    return template


def _manifests(template: dict) -> list[dict]:
    """The Kubernetes objects applied as plain JSON (those with CloudFormation tokens in them are skipped)."""
    manifests = [r["Properties"]["Manifest"] for r in template["Resources"].values() if r["Type"] == "Custom::AWSCDK-EKS-KubernetesResource"]
    return [obj for manifest in manifests if isinstance(manifest, str) for obj in json.loads(manifest)]


def test_the_package_imports_from_the_installed_wheel_not_the_repository(consumer_python):
    probe = ("import ray_train_eks.constructs as c, ray_train_eks.charts as k, ray_train_eks.constructs.ray_workload as w; "
             "print(c.__file__); print(w.bundled_training_code())")
    out = subprocess.run([str(consumer_python), "-c", probe], cwd="/", env=_consumer_env(), capture_output=True, text=True,
                         check=True).stdout.split()
    source = (str(ROOT / "ray_train_eks"), str(ROOT / "training"))
    assert all("site-packages" in path and not path.startswith(source) for path in out)
    assert (Path(out[1]) / "train.py").is_file()  # the bundled training package came with the wheel


def test_consumer_app_synthesizes_with_existing_vpc_and_cluster(consumer_template):
    resources = consumer_template["Resources"].values()
    assert sum(r["Type"] == "AWS::EC2::VPC" for r in resources) == 1  # ours reused theirs
    assert sum(r["Type"] == "AWS::EKS::Cluster" for r in resources) == 1
    (efa_template,) = [
        r for r in resources if r["Type"] == "AWS::EC2::LaunchTemplate" and "NetworkInterfaces" in r["Properties"]["LaunchTemplateData"]
    ]
    assert len(efa_template["Properties"]["LaunchTemplateData"]["NetworkInterfaces"]) == 32  # p5.48xlarge: 32 cards
    charts = sorted(r["Properties"]["Chart"] for r in resources if r["Type"] == "Custom::AWSCDK-EKS-HelmChart")
    assert charts == ["aws-efa-k8s-device-plugin", "kuberay-operator", "nvidia-device-plugin"]


def test_nothing_selects_a_label_the_consumers_cluster_lacks(consumer_template):
    text = json.dumps(consumer_template)
    assert "ray-train-eks/node-role" not in text
    kuberay = [r for r in consumer_template["Resources"].values()
               if r["Type"] == "Custom::AWSCDK-EKS-HelmChart" and r["Properties"]["Chart"] == "kuberay-operator"]
    assert "nodeSelector" not in json.dumps(kuberay)
    (job,) = [o for o in _manifests(consumer_template) if o["kind"] == "RayJob"]
    cluster = job["spec"]["rayClusterSpec"]
    assert "nodeSelector" not in cluster["headGroupSpec"]["template"]["spec"]
    assert "nodeSelector" not in cluster["workerGroupSpecs"][0]["template"]["spec"]


def test_karpenter_capacity_on_the_consumers_cluster_from_the_wheel(consumer_on_demand_template):
    resources = consumer_on_demand_template["Resources"]
    assert not [r for r in resources.values() if r["Type"] == "AWS::EC2::LaunchTemplate" and "NetworkInterfaces" in str(r)]
    charts = sorted(r["Properties"]["Chart"] for r in resources.values() if r["Type"] == "Custom::AWSCDK-EKS-HelmChart")
    assert charts == ["aws-efa-k8s-device-plugin", "karpenter", "karpenter-crd", "kuberay-operator", "nvidia-device-plugin"]
    # The controller's policies came from the reference template packaged in the wheel.
    policies = [r["Properties"]["PolicyDocument"] for r in resources.values() if r["Type"] == "AWS::IAM::ManagedPolicy"]
    assert len(policies) == 6 and any("ec2:DescribePlacementGroups" in json.dumps(p) for p in policies)
    text = json.dumps(consumer_on_demand_template)
    assert "ray-train-eks/node-role" not in text  # neutral labels: only nvidia.com/gpu.present on the nodes
    assert '\\"limits\\":{\\"nvidia.com/gpu\\":\\"16\\"}' in text  # one p5.48xlarge, and room for a replacement
    (job,) = [o for o in _manifests(consumer_on_demand_template) if o["kind"] == "RayJob"]
    assert job["spec"]["preRunningDeadlineSeconds"] == 1800
    workers = job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]
    assert "annotations" not in workers.get("metadata", {})  # nothing blocks Karpenter's drain


def test_observability_on_the_consumers_cluster_from_the_wheel(consumer_template):
    resources = consumer_template["Resources"]
    (addon,) = [r for r in resources.values() if r["Type"] == "AWS::EKS::Addon"
                and r["Properties"]["AddonName"] == "amazon-cloudwatch-observability"]
    (association,) = addon["Properties"]["PodIdentityAssociations"]
    assert association["ServiceAccount"] == "cloudwatch-agent"
    # Pod Identity needs its agent on the cluster: their cluster got it with our service account.
    assert any(resources[d]["Type"] == "AWS::EKS::Addon" and resources[d]["Properties"]["AddonName"] == "eks-pod-identity-agent"
               for d in addon["DependsOn"])
    (groups,) = [r for r in resources.values() if r["Type"] == "AWS::CloudFormation::CustomResource"
                 and "LogGroupNames" in r["Properties"]]
    assert groups["Properties"]["RetentionInDays"] == "14" and len(groups["Properties"]["LogGroupNames"]) == 4
    (alarm,) = [r for r in resources.values() if r["Type"] == "AWS::CloudWatch::Alarm"]
    assert (alarm["Properties"]["EvaluationPeriods"], alarm["Properties"]["DatapointsToAlarm"]) == (63, 60)
    (dashboard,) = [r for r in resources.values() if r["Type"] == "AWS::CloudWatch::Dashboard"]
    parts = dashboard["Properties"]["DashboardBody"]["Fn::Join"][1]
    body = json.loads("".join(p if isinstance(p, str) else "<ref>" for p in parts))
    expressions = [row[-1].get("expression", "") for w in body["widgets"] for row in w.get("properties", {}).get("metrics", [])]
    assert any('MetricName="pod_cpu_utilization"' in e and 'Namespace="ray-train"' in e for e in expressions)
    assert any('{"RayTrainEks/Training",Run} MetricName="Loss"' in e for e in expressions)


def test_the_rayjob_runs_the_consumers_entrypoint_and_code(consumer_template):
    objects = _manifests(consumer_template)
    (job,) = [o for o in objects if o["kind"] == "RayJob"]
    assert job["spec"]["entrypoint"] == "python -m my_trainer.main --epochs 1"
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    assert head["containers"][0]["resources"]["limits"] == {"cpu": "1", "memory": "4Gi"}
    assert {"name": "training-code", "mountPath": "/opt/ray-train-eks/my_trainer", "readOnly": True} in head["containers"][0]["volumeMounts"]
    (code,) = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "ray-train-eks-code"]
    assert set(code["data"]) == {"__init__.py", "main.py"}


def test_runs_served_at_deploy_are_checked_and_staged_by_the_wheels_handler_then_applied(consumer_template):
    """RayServing: a custom resource runs the handler the command runs (ray_train_eks/handlers/serving.py,
    from the wheel's handlers folder) with the runs and the platform; its ServeConfig becomes the
    RayService's serveConfigV2, applied after it."""
    resources = consumer_template["Resources"]
    (runs,) = [r for r in resources.values() if r["Type"] == "AWS::CloudFormation::CustomResource"
               and json.loads(r["Properties"].get("Runs", "null") or "null") == ["dolly-lora", "alpaca-lora"]]
    assert runs["Properties"]["Service"] == "chat" and json.loads(runs["Properties"]["Platform"])["gpus_per_node"] == 8
    (function,) = [r for r in resources.values() if r["Type"] == "AWS::Lambda::Function"
                   and r["Properties"].get("Handler") == "serving.on_event"]
    manifests = [r for r in resources.values() if r["Type"] == "Custom::AWSCDK-EKS-KubernetesResource"
                 and "RayService" in json.dumps(r["Properties"]["Manifest"])]
    assert len(manifests) == 1 and "ServeConfig" in json.dumps(manifests[0]["Properties"]["Manifest"])
    assert function["Properties"]["Runtime"].startswith("python")


#: Sources the package ships to the cluster's images as text (a container's command, a service's
#: ``py_modules``), never importing them itself: their imports are the images'.
SHIPPED_TO_THE_CLUSTER = {"ray_train_eks/workload/stopped_job_watch.py", "ray_train_eks/workload/bearer_ingress.py"}


def test_the_wheel_declares_every_library_it_imports():
    """What broke a consumer: `RayWorkload` imported cdk8s, which the package did not declare."""
    from importlib.metadata import packages_distributions

    imported = set()
    for path in (ROOT / "ray_train_eks").rglob("*.py"):
        if "handlers" in path.parts:
            continue  # Lambda code: boto3 comes with the Lambda runtime, not with the wheel's users
        if path.relative_to(ROOT).as_posix() in SHIPPED_TO_THE_CLUSTER:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    third_party = {name for name in imported - set(sys.stdlib_module_names) if name != "ray_train_eks"}
    distributions = packages_distributions()
    needed = {distributions[name][0].lower().replace("_", "-").replace(".", "-") for name in third_party}
    declared = {dep.split(">")[0].split("=")[0].split("<")[0].strip().lower().replace("_", "-").replace(".", "-")
                for dep in _declared_dependencies()}
    assert needed <= declared, needed - declared


def test_constructs_are_importable_from_the_package():
    import ray_train_eks.constructs as public

    assert set(public.__all__) == {
        "AccountChecks", "CloudWatchObservability", "EfaDevicePlugin", "EfaNodeGroup", "IdleGpuAlarm", "KarpenterGpuCapacity",
        "KubeRayOperator", "KueueQueueing", "NodeMonitoringAgent", "NvidiaDevicePlugin", "RayServiceAccount", "RayServing", "RayWorkload", "TrainerAccess", "MlflowTracking", "TrainingBucket",
        "TrainingCluster", "TrainingDashboard", "TrainingNetwork",
    }


def test_efa_node_group_rejects_a_type_without_efa():
    from aws_cdk import App, Stack, aws_ec2 as ec2, aws_eks_v2 as eks

    from ray_train_eks.constructs import EfaNodeGroup

    stack = Stack(App(), "S")
    cluster = eks.Cluster.from_cluster_attributes(stack, "C", cluster_name="c", vpc=ec2.Vpc(stack, "V"))
    with pytest.raises(ValueError, match=r"^EfaNodeGroup: instance_type='g6.xlarge': does not support EFA \(multi-node NCCL would "
                                         r"fall back to TCP\); use an EFA-capable GPU type: g5.48xlarge"):
        EfaNodeGroup(stack, "G", cluster=cluster, subnet=cluster.vpc.private_subnets[0], instance_type="g6.xlarge")


def test_training_code_too_large_to_kubectl_apply_fails_at_synth_pointing_to_s3(tmp_path):
    from aws_cdk import App, Stack, aws_ec2 as ec2, aws_eks_v2 as eks, aws_s3 as s3

    from ray_train_eks.charts import RayWorkloadSpec
    from ray_train_eks.constructs import RayWorkload

    (tmp_path / "big.py").write_text("DATA = '" + "x" * 300_000 + "'\n")  # under ConfigMap's 1 MiB, over 256 KiB
    stack = Stack(App(), "S")
    cluster = eks.Cluster.from_cluster_attributes(stack, "C", cluster_name="c", vpc=ec2.Vpc(stack, "V"))
    with pytest.raises(ValueError, match=r"ConfigMap ray-train-eks-code is 29\d KiB; kubectl apply keeps the whole object in "
                                         r"the kubectl.kubernetes.io/last-applied-configuration annotation, and an object's "
                                         r"annotations are capped at 256 KiB: ship the code as an S3 object"):
        RayWorkload(stack, "W", cluster=cluster, bucket=s3.Bucket(stack, "B"), training_code_dir=tmp_path,
                    spec=RayWorkloadSpec(entrypoint=("python", "-m", "big"), code_package="big"))


def test_training_code_too_large_for_its_own_template_fails_at_synth_with_the_way_out(tmp_path):
    """Each ConfigMap part fits kubectl apply, but CloudFormation takes 1 MB a template, the training code's
    nested stack's too: said at synth, not as a deploy's failure."""
    from aws_cdk import App, Stack, aws_ec2 as ec2, aws_eks_v2 as eks, aws_s3 as s3

    from ray_train_eks.charts import RayWorkloadSpec
    from ray_train_eks.constructs import RayWorkload

    for index in range(8):  # 8 parts of 130 kB: 1.04 MB
        (tmp_path / f"part{index}.py").write_text("DATA = '" + "x" * 130_000 + "'\n")
    stack = Stack(App(), "S")
    cluster = eks.Cluster.from_cluster_attributes(stack, "C", cluster_name="c", vpc=ec2.Vpc(stack, "V"))
    with pytest.raises(ValueError, match=r"^RayWorkload: the training code's ConfigMaps are 1\.04 MB, more than a CloudFormation "
                                         r"template holds beside them \(0\.98 MB of 1 MB\): trim the package"):
        RayWorkload(stack, "W", cluster=cluster, bucket=s3.Bucket(stack, "B"), training_code_dir=tmp_path,
                    spec=RayWorkloadSpec(entrypoint=("python", "-m", "part0"), code_package="part0"))


def test_karpenter_capacity_rejects_bad_arguments_naming_them():
    from aws_cdk import App, Stack, aws_ec2 as ec2, aws_eks_v2 as eks

    from ray_train_eks.constructs import KarpenterGpuCapacity

    stack = Stack(App(), "S")
    cluster = eks.Cluster.from_cluster_attributes(stack, "C", cluster_name="c", vpc=ec2.Vpc(stack, "V"))
    subnet = cluster.vpc.private_subnets[0]
    with pytest.raises(ValueError, match=r"^KarpenterGpuCapacity: instance_type='g6.xlarge': does not support EFA"):
        KarpenterGpuCapacity(stack, "A", cluster=cluster, subnet=subnet, instance_type="g6.xlarge")
    with pytest.raises(ValueError, match=r"ami_alias='bottlerocket@v1.30.0'; use an AL2023 alias such as al2023@v20260714"):
        KarpenterGpuCapacity(stack, "B", cluster=cluster, subnet=subnet, ami_alias="bottlerocket@v1.30.0")
    with pytest.raises(ValueError, match=r"replicas=0; the controller needs at least 1 replica"):
        KarpenterGpuCapacity(stack, "D", cluster=cluster, subnet=subnet, replicas=0)
