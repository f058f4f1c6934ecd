"""Releases rendered by the helm the deploy runs, from the pinned chart packages, with the values
of the synthesized template, checked against the nodes they must run on; and the deploy's other
way to install a chart, as a CDK asset of its package.

The packages are upstream files: ``make upstream`` downloads them into ``.cache/upstream/``
(tests/upstream.py says where else they are looked for). Without them these renders are skipped;
the asset path is tested with a chart the test writes itself."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from helm import helm, helm_template
from ray_train_eks.helm_charts import (
    EFA_DEVICE_PLUGIN,
    KARPENTER,
    KARPENTER_CRD,
    KUBERAY_OPERATOR,
    NVIDIA_DEVICE_PLUGIN,
    PinnedChart,
    sha256_of,
)
from ray_train_eks.constructs.chart_packages import chart_source
from upstream import chart_package

pytestmark = pytest.mark.synth


def release_values(platform, chart: str) -> dict:
    """A release's values exactly as the template hands them to Helm, with the CloudFormation
    references they hold filled in with stand-ins."""
    ((props),) = [r["Properties"] for r in platform.resources("Custom::AWSCDK-EKS-HelmChart").values()
                  if r["Properties"].get("Chart") == chart]
    values = props.get("Values")
    if values is None:
        return {}
    if isinstance(values, str):
        return json.loads(values)
    return json.loads("".join(p if isinstance(p, str) else "stand-in" for p in values["Fn::Join"][1]))


def cpu_millicores(quantity) -> int:
    """A Kubernetes CPU quantity (``1``, ``500m``) in millicores."""
    text = str(quantity)
    return int(text[:-1]) if text.endswith("m") else int(float(text) * 1000)


def _tolerates(tolerations: list[dict], taint: dict) -> bool:
    for t in tolerations or []:
        if t.get("effect") not in (None, "", taint["effect"]):
            continue
        if t.get("operator", "Equal") == "Exists" and t.get("key") in (None, "", taint["key"]):
            return True
        if t.get("key") == taint["key"] and t.get("value") == taint.get("value"):
            return True
    return False


GPU_TAINT = {"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}


@pytest.mark.parametrize("pin, platform_name, namespace", [
    (NVIDIA_DEVICE_PLUGIN, "default_platform", "nvidia-device-plugin"),
    (EFA_DEVICE_PLUGIN, "default_platform", "kube-system"),
    (KUBERAY_OPERATOR, "default_platform", "kuberay"),
    (KARPENTER_CRD, "karpenter_platform", "kube-system"),
], ids=lambda value: getattr(value, "chart", None) or str(value))
def test_each_pinned_chart_renders_with_the_synthesized_values(pin, platform_name, namespace, request):
    package = chart_package(pin)
    platform = request.getfixturevalue(platform_name)
    objects = helm_template(package, release=pin.chart, namespace=namespace, values=release_values(platform, pin.chart))
    assert objects, f"{pin.chart} {pin.version} rendered nothing"
    if pin in (NVIDIA_DEVICE_PLUGIN, EFA_DEVICE_PLUGIN):
        # Every DaemonSet of a device plugin reaches the tainted GPU nodes...
        daemonsets = [o for o in objects if o["kind"] == "DaemonSet"]
        assert daemonsets and all(_tolerates(d["spec"]["template"]["spec"].get("tolerations"), GPU_TAINT) for d in daemonsets)
    if pin is EFA_DEVICE_PLUGIN:
        # ... and the EFA plugin's affinity admits the GPU type (its allowlist, which we set).
        (daemonset,) = daemonsets
        assert "g6.12xlarge" in json.dumps(daemonset["spec"]["template"]["spec"]["affinity"])


@pytest.fixture(scope="module")
def karpenter_objects(karpenter_platform):
    return helm_template(chart_package(KARPENTER), release="karpenter", namespace="kube-system",
                         values=release_values(karpenter_platform, "karpenter"))


def test_the_controller_lands_on_a_system_node_and_asks_what_capacity_py_budgets(karpenter_objects, karpenter_platform):
    from ray_train_eks.capacity import CPU_REQUESTS_M

    (deployment,) = [o for o in karpenter_objects if o["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    system_labels = {"ray-train-eks/node-role": "system", "kubernetes.io/os": "linux"}
    assert set(pod["nodeSelector"].items()) <= set(system_labels.items())
    # The system nodes carry no taint; the GPU nodes' taint keeps the controller off them.
    assert not _tolerates(pod.get("tolerations"), GPU_TAINT)
    requests_m = sum(cpu_millicores(c["resources"]["requests"]["cpu"]) for c in pod["containers"])
    assert requests_m == CPU_REQUESTS_M["karpenter"][0]
    assert deployment["spec"]["replicas"] == karpenter_platform.stack.config.karpenter_replicas


def test_the_controller_gets_its_region_from_the_values_not_imds(karpenter_objects):
    (deployment,) = [o for o in karpenter_objects if o["kind"] == "Deployment"]
    (controller,) = deployment["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in controller["env"]}
    assert env["AWS_REGION"] == "us-west-2"
    assert env["CLUSTER_NAME"] == "stand-in" and env["INTERRUPTION_QUEUE"] == "stand-in"


# ---------------------------------------------------------------- a chart shipped as an asset


@pytest.fixture(scope="module")
def small_chart(tmp_path_factory) -> tuple[PinnedChart, Path]:
    """A chart this test writes, packaged by helm as a repository would serve it, and its pin."""
    root = tmp_path_factory.mktemp("small-chart")
    chart = root / "src" / "small"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: small\nversion: 0.1.0\n")
    (chart / "values.yaml").write_text("greeting: hello\n")
    (chart / "templates" / "configmap.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Release.Name }}\ndata:\n  greeting: {{ .Values.greeting | quote }}\n")
    packages = root / "packages"
    helm("package", str(chart), "--destination", str(packages))
    package = packages / "small-0.1.0.tgz"
    pin = PinnedChart("small", "0.1.0", "https://charts.example.com", sha256=sha256_of(package), digest_source="this test")
    return pin, packages


def _synth_release(tmp_path: Path, pin: PinnedChart, packages: Path | None) -> tuple[dict, Path]:
    """A stack with one cluster and the release of ``pin``: the release's properties and the cloud assembly."""
    from aws_cdk import App, Stack, aws_eks_v2 as eks
    from aws_cdk.lambda_layer_kubectl_v36 import KubectlV36Layer

    app = App(outdir=str(tmp_path / "cdk.out"))
    stack = Stack(app, "Charts", env={"region": "us-west-2", "account": "123456789012"})
    cluster = eks.Cluster(stack, "Cluster", version=eks.KubernetesVersion.V1_36, default_capacity_type=eks.DefaultCapacityType.NODEGROUP,
                          default_capacity=0, kubectl_provider_options=eks.KubectlProviderOptions(kubectl_layer=KubectlV36Layer(stack, "Kubectl")))
    eks.HelmChart(stack, "Release", cluster=cluster, release="small", namespace="small",
                  **chart_source(stack, "SmallPackage", pin, packages))
    app.synth()
    template = json.loads((tmp_path / "cdk.out" / "Charts.template.json").read_text())
    (props,) = [r["Properties"] for r in template["Resources"].values() if r["Type"] == "Custom::AWSCDK-EKS-HelmChart"]
    return props, tmp_path / "cdk.out"


def test_a_verified_package_deploys_as_an_asset_that_the_handler_can_install(small_chart, tmp_path):
    pin, packages = small_chart
    props, outdir = _synth_release(tmp_path, pin, packages)
    # chartAsset alone: no repository reached at deploy time.
    assert "Repository" not in props and "Chart" not in props and "Version" not in props
    url = json.dumps(props["ChartAssetURL"])
    assert "s3://" in url and ".zip" in url
    # What the handler gets: the staged folder, zipped by CDK, unzipped into a folder that helm
    # installs (custom-resource-handlers/dist/aws-eks-v2/kubectl-handler/helm/__init__.py).
    (staged,) = [p for p in outdir.glob("asset.*") if (p / "Chart.yaml").is_file()]
    archive = tmp_path / "chart.zip"
    with zipfile.ZipFile(archive, "w") as zipped:
        for path in staged.rglob("*"):
            zipped.write(path, path.relative_to(staged))
    unzipped = tmp_path / "chart"
    zipfile.ZipFile(archive).extractall(unzipped)
    (configmap,) = helm_template(unzipped, release="small", namespace="small", values={"greeting": "hi"})
    assert configmap["data"] == {"greeting": "hi"}
    manifest = json.loads((outdir / "Charts.assets.json").read_text())
    assert any(f["source"]["packaging"] == "zip" for f in manifest["files"].values())


def test_without_the_package_the_release_comes_from_its_repository(small_chart, tmp_path):
    pin, _ = small_chart
    props, _ = _synth_release(tmp_path, pin, tmp_path / "no-packages-here")
    assert (props["Chart"], props["Version"], props["Repository"]) == ("small", "0.1.0", "https://charts.example.com")
    assert "ChartAssetURL" not in props


def test_a_package_that_is_not_the_pinned_one_stops_synth(small_chart, tmp_path):
    pin, packages = small_chart
    from dataclasses import replace

    wrong = replace(pin, sha256="0" * 64)
    with pytest.raises(ValueError, match=r"small-0\.1\.0\.tgz: sha256 [0-9a-f]{64} is not the pinned 0{64}.*make upstream"):
        _synth_release(tmp_path, wrong, packages)
