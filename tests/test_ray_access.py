"""Who may reach the Ray clusters: Ray's token authentication on every RayCluster we create
(KubeRay ``authOptions``), the VPC CNI's NetworkPolicy enforcement, and the policies of the
Ray namespace, validated against Kubernetes' own v1.36 schemas and then evaluated, as
Kubernetes defines NetworkPolicy semantics, for the pods KubeRay v1.7.0 really creates."""

from __future__ import annotations

import dataclasses
import json

import pytest

from ray_train_eks.charts import (
    CLUSTER_LABEL,
    KUBERAY_OPERATOR_POD_LABELS,
    RayWorkloadSpec,
    ray_cluster,
    ray_job,
    ray_objects,
    workload_problems,
)
from ray_train_eks.config import ConfigError, PlatformConfig

from crd_schema import kuberay_schemas, validate, validate_builtin

def spec_for(**context) -> RayWorkloadSpec:
    return PlatformConfig.from_context(context.get, environ={}).workload_spec({"train.py": "print(1)\n"})


STANDING = {"workload": "cluster", "shutdownAfterJobFinishes": "false", "ttlSecondsAfterFinished": "0"}


# --------------------------------------------------------------------- token authentication

@pytest.mark.parametrize("context", [{}, STANDING, {"submissionMode": "HTTPMode"}, {"submissionMode": "SidecarMode"},
                                     {"submissionMode": "InteractiveMode"}])
def test_every_ray_cluster_we_create_requires_the_token(context):
    """mode token, and no secretName: KubeRay creates a Secret per cluster (named after it, key
    auth_token, owned by it) and injects it into the head, the workers and the submitter of every
    submission mode; the operator's dashboard client reads it for HTTPMode, job status and stop."""
    spec = spec_for(**context)
    clusters = [o["spec"] if o["kind"] == "RayCluster" else o["spec"].get("rayClusterSpec")
                for o in ray_objects(spec) if o["kind"] in ("RayCluster", "RayJob")]
    clusters = [c for c in clusters if c is not None]
    assert clusters
    assert all(c["authOptions"] == {"mode": "token"} for c in clusters)


def test_the_token_never_passes_through_the_template(default_platform):
    """No Secret among the manifests CloudFormation applies: the token is generated in the
    cluster by the operator, so it is in no template, Lambda event or log."""
    kinds = {o["kind"] for objects in default_platform.manifests().values() for o in objects}
    assert "Secret" not in kinds
    assert "auth_token" not in json.dumps(default_platform.template)


def test_authentication_objects_validate_against_the_kuberay_crds():
    schemas = kuberay_schemas()
    for context in ({}, STANDING, {"rayAuthMode": "disabled"}):
        for obj in ray_objects(spec_for(**context)):
            validate(obj, schemas)


def test_authentication_can_be_turned_off_and_bad_values_fail_synth():
    assert ray_job(spec_for(rayAuthMode="disabled"))["spec"]["rayClusterSpec"]["authOptions"] == {"mode": "disabled"}
    with pytest.raises(ConfigError) as raised:
        PlatformConfig.from_context({"rayAuthMode": "on"}.get, environ={})
    assert raised.value.problems == [
        "rayAuthMode='on': use token (Ray refuses callers without the cluster's token) or disabled (anyone who reaches "
        "the head can run code on the cluster)"]
    with pytest.raises(ConfigError) as raised:
        PlatformConfig.from_context({"rayVersion": "2.51.1"}.get, environ={})
    assert raised.value.problems == [
        "rayVersion='2.51.1' with rayAuthMode=token: Ray's token authentication needs Ray 2.52.0 or later (KubeRay rejects "
        "the cluster otherwise); use an image with a newer Ray, or rayAuthMode=disabled"]
    assert workload_problems(dataclasses.replace(spec_for(), ray_version="2.51.1", auth_mode="disabled")) == []


# --------------------------------------------------------------------- network policies: objects

@pytest.mark.parametrize("context", [{}, STANDING, {"gpuCapacity": "karpenter"}, {"submissionMode": "HTTPMode"}])
def test_policies_validate_strictly_against_kubernetes_1_36(context):
    policies = [o for o in ray_objects(spec_for(**context)) if o["kind"] == "NetworkPolicy"]
    assert len(policies) == 3
    for policy in policies:
        validate_builtin(policy)


def test_a_misspelled_policy_field_is_caught():
    import jsonschema

    (deny, *_rest) = [o for o in ray_objects(spec_for()) if o["kind"] == "NetworkPolicy"]
    deny["spec"]["ingres"] = []
    with pytest.raises(jsonschema.ValidationError, match="ingres"):
        validate_builtin(deny)


def test_every_ray_pod_carries_its_clusters_label():
    job = ray_job(spec_for())
    name = job["metadata"]["name"]
    cluster_spec = job["spec"]["rayClusterSpec"]
    for template in [cluster_spec["headGroupSpec"]["template"], *(g["template"] for g in cluster_spec["workerGroupSpecs"])]:
        assert template["metadata"]["labels"] == {CLUSTER_LABEL: name}
    standing = ray_cluster(spec_for(**STANDING))
    assert standing["spec"]["headGroupSpec"]["template"]["metadata"]["labels"] == {CLUSTER_LABEL: "ray-train"}


def test_without_policies_nothing_is_denied_and_the_cni_is_left_as_it_is(tmp_path):
    assert not [o for o in ray_objects(spec_for(networkPolicies="false")) if o["kind"] == "NetworkPolicy"]
    from platform_synth import synth_platform

    platform = synth_platform(tmp_path, {"networkPolicies": "false"})
    (cni,) = [r for r in platform.resources("AWS::EKS::Addon").values() if r["Properties"]["AddonName"] == "vpc-cni"]
    assert "ConfigurationValues" not in cni["Properties"]
    assert not [o for objects in platform.manifests().values() for o in objects if o["kind"] == "NetworkPolicy"]


def test_the_vpc_cni_enforces_network_policies(default_platform):
    (cni,) = [r for r in default_platform.resources("AWS::EKS::Addon").values() if r["Properties"]["AddonName"] == "vpc-cni"]
    assert json.loads(cni["Properties"]["ConfigurationValues"]) == {"enableNetworkPolicy": "true"}


def test_the_stacks_policies_go_with_their_objects_and_before_the_pods(default_platform):
    manifests = default_platform.manifests()
    job_key, job = default_platform.ray_job()
    assert [o["kind"] for o in manifests[job_key]] == ["NetworkPolicy", "NetworkPolicy", "RayJob"]
    assert {o["metadata"]["name"] for o in manifests[job_key][:2]} == {f"{job['metadata']['name']}-ray-pods",
                                                                       f"{job['metadata']['name']}-dashboard"}
    (deny_key,) = [k for k, objects in manifests.items() if [o["kind"] for o in objects] == ["NetworkPolicy"]]
    assert deny_key in default_platform.template["Resources"][job_key]["DependsOn"]
    # The dashboard allows the operator where the stack installs it.
    dashboard = manifests[job_key][1]
    (operator,) = [p for p in dashboard["spec"]["ingress"][0]["from"] if "namespaceSelector" in p]
    assert operator["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "kuberay"}


def _consumer_stack(**workload):
    """Someone else's cluster with our RayWorkload on it."""
    from aws_cdk import App, Stack, aws_eks_v2 as eks, aws_s3 as s3
    from aws_cdk.lambda_layer_kubectl_v36 import KubectlV36Layer

    from ray_train_eks.constructs import RayWorkload

    stack = Stack(App(), "Consumer", env={"region": "us-west-2", "account": "111111111111"})
    cluster = eks.Cluster(stack, "Theirs", version=eks.KubernetesVersion.of("1.36"),
                          kubectl_provider_options=eks.KubectlProviderOptions(kubectl_layer=KubectlV36Layer(stack, "Kubectl")))
    RayWorkload(stack, "Ray", cluster=cluster, spec=RayWorkloadSpec(), bucket=s3.Bucket(stack, "Bucket"), **workload)
    return stack


def _policy_warnings(stack) -> list:
    from aws_cdk import assertions

    return assertions.Annotations.from_stack(stack).find_warning("*", assertions.Match.string_like_regexp("NetworkPolicies"))


def test_a_cluster_without_enforcement_gets_a_note_not_a_failure():
    (warning,) = _policy_warnings(_consumer_stack())
    assert "enableNetworkPolicy" in warning.entry.data and "network_policy_enforced=True" in warning.entry.data
    assert _policy_warnings(_consumer_stack(network_policy_enforced=True)) == []


# --------------------------------------------------------------------- network policies: semantics

def _matches(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # what our policies use
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


NAMESPACES = {"ray-train": {"kubernetes.io/metadata.name": "ray-train"}, "kuberay": {"kubernetes.io/metadata.name": "kuberay"},
              "default": {"kubernetes.io/metadata.name": "default"}}


def _peer_matches(peer: dict, policy_namespace: str, source: dict) -> bool:
    """A NetworkPolicyPeer: podSelector alone selects pods of the policy's namespace;
    namespaceSelector (with or without podSelector) pods of the selected namespaces."""
    if "namespaceSelector" in peer:
        if not _matches(peer["namespaceSelector"], NAMESPACES[source["namespace"]]):
            return False
    elif source["namespace"] != policy_namespace:
        return False
    return _matches(peer.get("podSelector", {}), source["labels"])


def allowed(policies: list[dict], source: dict, target: dict, port: int) -> bool:
    """Kubernetes' ingress semantics: a pod no policy selects takes anything; a selected pod
    takes what at least one rule of one selecting policy allows."""
    selecting = [p for p in policies if p["metadata"]["namespace"] == target["namespace"]
                 and "Ingress" in p["spec"]["policyTypes"] and _matches(p["spec"]["podSelector"], target["labels"])]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            peers_ok = not rule.get("from") or any(_peer_matches(peer, policy["metadata"]["namespace"], source)
                                                   for peer in rule["from"])
            ports_ok = not rule.get("ports") or any(p["port"] == port and p.get("protocol", "TCP") == "TCP"
                                                    for p in rule["ports"])
            if peers_ok and ports_ok:
                return True
    return False


def ray_pod(template_labels: dict, *, cluster: str, node_type: str, group: str) -> dict:
    """A Ray pod's labels as KubeRay v1.7.0 sets them (common/pod.go labelPod: its own labels,
    then the template's)."""
    labels = {"ray.io/is-ray-node": "yes", "ray.io/cluster": cluster, "ray.io/node-type": node_type, "ray.io/group": group,
              "ray.io/identifier": f"{cluster}-{node_type}", "app.kubernetes.io/name": "kuberay",
              "app.kubernetes.io/created-by": "kuberay-operator", **template_labels}
    return {"namespace": "ray-train", "labels": labels}


def submitter_pod(job_name: str) -> dict:
    """KubeRay v1.7.0's K8sJobMode submitter (rayjob_controller.go getSubmitterTemplate), a Job's pod."""
    return {"namespace": "ray-train", "labels": {"ray.io/originated-from-cr-name": job_name, "ray.io/originated-from-crd": "RayJob",
                                                 "app.kubernetes.io/created-by": "kuberay-operator", "batch.kubernetes.io/job-name": job_name}}


OPERATOR = {"namespace": "kuberay", "labels": {**KUBERAY_OPERATOR_POD_LABELS, "app.kubernetes.io/instance": "kuberay-operator",
                                               "app.kubernetes.io/component": "kuberay-operator"}}


def _job_world(**context):
    spec = spec_for(**context)
    objects = ray_objects(spec)
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    job = objects[-1]
    name = job["metadata"]["name"]
    template = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["metadata"]["labels"]
    head = ray_pod(template, cluster=f"{name}-x7k2p", node_type="head", group="headgroup")
    worker = ray_pod(template, cluster=f"{name}-x7k2p", node_type="worker", group="gpu-workers")
    return policies, name, head, worker


def test_a_job_clusters_pods_reach_each_other_on_every_port():
    policies, _, head, worker = _job_world()
    for port in (6379, 8265, 52365, 10002, 40123):  # GCS, dashboard, agent, worker ports, a raylet's random port
        assert allowed(policies, worker, head, port) and allowed(policies, head, worker, port)


def test_only_the_operator_and_this_jobs_submitter_reach_the_job_api():
    policies, name, head, worker = _job_world()
    assert allowed(policies, OPERATOR, head, 8265)
    assert allowed(policies, submitter_pod(name), head, 8265)
    assert not allowed(policies, submitter_pod(name), head, 6379)  # the job API only
    assert not allowed(policies, OPERATOR, worker, 8265) and not allowed(policies, OPERATOR, head, 6379)
    stranger = {"namespace": "default", "labels": {"app": "anything"}}
    same_namespace = {"namespace": "ray-train", "labels": {"app": "test-pod"}}
    impostor = {"namespace": "default", "labels": dict(OPERATOR["labels"])}  # operator labels, wrong namespace
    for source in (stranger, same_namespace, impostor, submitter_pod("finetune-00000000")):
        for port in (8265, 6379, 10001, 8080, 52365):
            assert not allowed(policies, source, head, port), (source, port)
            assert not allowed(policies, source, worker, port), (source, port)


def test_another_clusters_pods_are_kept_out():
    policies, _, head, _ = _job_world()
    other = ray_pod({CLUSTER_LABEL: "ray-train"}, cluster="ray-train", node_type="worker", group="gpu-workers")
    assert not allowed(policies, other, head, 6379)


def test_a_standing_cluster_takes_any_rayjobs_submitter_and_its_own_pods():
    spec = spec_for(**STANDING)
    objects = ray_objects(spec)
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    head = ray_pod({CLUSTER_LABEL: "ray-train"}, cluster="ray-train", node_type="head", group="headgroup")
    worker = ray_pod({CLUSTER_LABEL: "ray-train"}, cluster="ray-train", node_type="worker", group="gpu-workers")
    assert allowed(policies, worker, head, 6379) and allowed(policies, head, worker, 52365)
    assert allowed(policies, submitter_pod(objects[-1]["metadata"]["name"]), head, 8265)
    assert allowed(policies, submitter_pod("someone-elses-job"), head, 8265)  # RayJobs select the standing cluster by name
    assert allowed(policies, OPERATOR, head, 8265)
    assert not allowed(policies, {"namespace": "ray-train", "labels": {}}, head, 8265)


def test_the_operator_selector_is_what_its_chart_labels_its_pod():
    """helm-chart/kuberay-operator/templates/deployment.yaml (v1.7.0): the pod template's labels are
    app.kubernetes.io/name (the chart name, kuberay-operator), instance (the release) and component."""
    assert KUBERAY_OPERATOR_POD_LABELS == {"app.kubernetes.io/name": "kuberay-operator"}
    spec = dataclasses.replace(spec_for(), operator_namespace="ray-system", operator_pod_labels={"app": "my-operator"})
    dashboard = [o for o in ray_objects(spec) if o["metadata"]["name"].endswith("-dashboard")][0]
    assert dashboard["spec"]["ingress"][0]["from"][0] == {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ray-system"}},
        "podSelector": {"matchLabels": {"app": "my-operator"}}}
    assert workload_problems(dataclasses.replace(spec, operator_namespace="Ray_System")) == [
        "operator_namespace='Ray_System': must be the namespace the KubeRay operator runs in (a DNS-1123 label), e.g. kuberay"]
