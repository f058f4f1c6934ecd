"""Releases rendered by the helm the deploy runs, with the values of the synthesized template,
checked against the nodes they must run on.

Karpenter is the release whose templates this repository has (the deployment, service account
and helpers of its chart, in tests/fixtures/upstream/karpenter-1.14.1/chart/, their upstream
source and commit in tests/fixtures/upstream/README.md); the other charts are known here by
their values alone."""

from __future__ import annotations

import json

import pytest

from helm import helm_template
from platform_synth import UPSTREAM_DIR

pytestmark = pytest.mark.synth
CHART = UPSTREAM_DIR / "karpenter-1.14.1" / "chart"


def _chart_values(platform) -> dict:
    """The Karpenter release's values exactly as the template hands them to Helm, with the
    CloudFormation references it holds filled in with stand-ins."""
    ((props),) = [r["Properties"] for r in platform.resources("Custom::AWSCDK-EKS-HelmChart").values()
                  if r["Properties"]["Chart"] == "karpenter"]
    parts = props["Values"]["Fn::Join"][1]
    return json.loads("".join(p if isinstance(p, str) else "stand-in" for p in parts))


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


@pytest.fixture(scope="module")
def karpenter_objects(karpenter_platform):
    return helm_template(CHART, release="karpenter", namespace="kube-system",
                         values_files=[UPSTREAM_DIR / "karpenter-1.14.1" / "karpenter-values.yaml"],
                         values=_chart_values(karpenter_platform))


def test_the_release_renders_with_the_synthesized_values(karpenter_objects):
    kinds = sorted(o["kind"] for o in karpenter_objects)
    assert kinds == ["Deployment", "ServiceAccount"]


def test_the_controller_lands_on_a_system_node_and_asks_what_capacity_py_budgets(karpenter_objects, karpenter_platform):
    from ray_train_eks.capacity import CPU_REQUESTS_M

    (deployment,) = [o for o in karpenter_objects if o["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    system_labels = {"ray-train-eks/node-role": "system", "kubernetes.io/os": "linux"}
    assert set(pod["nodeSelector"].items()) <= set(system_labels.items())
    # The system nodes carry no taint; the GPU nodes' taint keeps the controller off them.
    assert not _tolerates(pod.get("tolerations"), {"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"})
    requests_m = sum(cpu_millicores(c["resources"]["requests"]["cpu"]) for c in pod["containers"])
    assert requests_m == CPU_REQUESTS_M["karpenter"][0]
    assert deployment["spec"]["replicas"] == karpenter_platform.stack.config.karpenter_replicas


def test_the_controller_gets_its_region_from_the_values_not_imds(karpenter_objects):
    (deployment,) = [o for o in karpenter_objects if o["kind"] == "Deployment"]
    (controller,) = deployment["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in controller["env"]}
    assert env["AWS_REGION"] == "us-west-2"
    assert env["CLUSTER_NAME"] == "stand-in" and env["INTERRUPTION_QUEUE"] == "stand-in"
