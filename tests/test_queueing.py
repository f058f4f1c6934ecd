"""Kueue queueing the Ray jobs (``-c queueing=kueue``, ray_train_eks/charts/queueing.py,
ray_train_eks/constructs/queueing.py): the queue objects validate against Kueue v0.19.2's CRDs, the
ClusterQueue's quota is one job's requests (so one job is admitted at a time, whole), a queued RayJob
is labelled with its queue and created suspended with KubeRay's end of a suspended job, the chart is
pinned with values its own values.yaml has, and the Ray namespace goes before Kueue on destroy."""

from __future__ import annotations

import dataclasses
import json

import pytest

from ray_train_eks.charts.queueing import CLUSTER_QUEUE, LOCAL_QUEUE, QUEUE_LABEL, job_requests, queue_objects, quantity
from ray_train_eks.charts.workload import ray_job, workload_problems

pytestmark = pytest.mark.synth


@pytest.fixture(scope="module")
def queued_spec():
    from ray_train_eks.config import PlatformConfig

    return PlatformConfig.from_context({"queueing": "kueue"}, environ={}).workload_spec()


def test_the_queue_objects_validate_against_kueues_crds_and_hold_one_job(queued_spec):
    from crd_schema import kueue_schemas, validate

    job = ray_job(queued_spec)
    objects = queue_objects(queued_spec, job)
    schemas = kueue_schemas()
    for obj in objects:
        validate(obj, schemas)
    flavor, cluster_queue, local_queue = objects
    assert local_queue["metadata"] == {"name": LOCAL_QUEUE, "namespace": queued_spec.namespace,
                                       "labels": {"app.kubernetes.io/part-of": "ray-train-eks"}}
    assert local_queue["spec"]["clusterQueue"] == cluster_queue["metadata"]["name"] == CLUSTER_QUEUE
    assert cluster_queue["spec"]["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": queued_spec.namespace}}
    assert cluster_queue["spec"]["queueingStrategy"] == "StrictFIFO"
    (group,) = cluster_queue["spec"]["resourceGroups"]
    quota = {r["name"]: r["nominalQuota"] for r in group["flavors"][0]["resources"]}
    # Every resource the job's pods request is covered (Kueue's BlockUndeclared), and the quota is
    # exactly one job: 2 g6.12xlarge workers (4 GPUs, 1 EFA interface each), the head, the submitter.
    assert group["coveredResources"] == list(quota) == ["cpu", "ephemeral-storage", "memory", "nvidia.com/gpu",
                                                        "vpc.amazonaws.com/efa"]
    assert (quota["nvidia.com/gpu"], quota["vpc.amazonaws.com/efa"]) == ("8", "2")
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"]["requests"]
    worker = job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]["requests"]
    assert quantity(quota["cpu"]) == quantity(head["cpu"]) + 2 * quantity(worker["cpu"]) + 0.5  # KubeRay's submitter: 500m
    assert quantity(quota["memory"]) == quantity(head["memory"]) + 2 * quantity(worker["memory"]) + 200 * 2**20
    # A second job does not fit beside the first: they wait, admitted whole one at a time.
    assert all(2 * quantity(amount) > quantity(quota[name]) for name, amount in job_requests(job).items())


def test_a_queued_job_is_labelled_suspended_and_ends_as_kubeRay_lets_a_suspended_job_end(queued_spec):
    from crd_schema import kuberay_schemas, validate

    job = ray_job(queued_spec)
    validate(job, kuberay_schemas())
    assert job["metadata"]["labels"][QUEUE_LABEL] == LOCAL_QUEUE
    assert job["spec"]["suspend"] is True
    # KubeRay v1.7.0 rejects deletionRules with shutdownAfterJobFinishes, and a suspended job without it.
    assert job["spec"]["shutdownAfterJobFinishes"] is True and "deletionStrategy" not in job["spec"]
    assert job["spec"]["ttlSecondsAfterFinished"] == queued_spec.ttl_seconds_after_finished
    assert workload_problems(queued_spec) == []
    standing = dataclasses.replace(queued_spec, workload="cluster", shutdown_after_job_finishes=False,
                                   ttl_seconds_after_finished=0)
    assert any("Kueue does not queue a RayJob that runs on a standing RayCluster" in p for p in workload_problems(standing))


def test_kueues_controller_is_counted_on_the_system_nodes():
    from ray_train_eks.config import PlatformConfig

    queued = PlatformConfig.from_context({"queueing": "kueue"}, environ={}).system_budget
    plain = PlatformConfig.from_context({}, environ={}).system_budget
    assert queued.once["kueue"] == 500 and "kueue" not in plain.once
    assert queued.head_room_m == plain.head_room_m - 500


def test_queueing_kueue_with_a_standing_cluster_fails_synth_naming_both():
    from ray_train_eks.config import ConfigError, PlatformConfig

    with pytest.raises(ConfigError) as raised:
        PlatformConfig.from_context({"queueing": "kueue", "workload": "cluster"}, environ={})
    assert any("queueing=kueue with workload=cluster" in p for p in raised.value.problems)
    with pytest.raises(ConfigError, match="queueing='fifo': use none"):
        PlatformConfig.from_context({"queueing": "fifo"}, environ={})


def test_the_stack_installs_the_pinned_chart_and_the_queues_in_destroy_order(queued_platform, default_platform):
    from upstream import chart_values

    charts = {c["Properties"]["Chart"]: c for c in queued_platform.resources("Custom::AWSCDK-EKS-HelmChart").values()}
    kueue = charts["kueue"]["Properties"]
    assert (kueue["Version"], kueue["Repository"], kueue["Namespace"]) == ("0.19.2", "oci://registry.k8s.io/kueue/charts/kueue",
                                                                         "kueue-system")
    values = json.loads(kueue["Values"])
    upstream = chart_values("kueue")
    assert set(values) <= set(upstream) and set(values["controllerManager"]) <= set(upstream["controllerManager"])
    assert values["controllerManager"]["nodeSelector"] == {"ray-train-eks/node-role": "system"}
    assert "kueue" not in {c["Properties"]["Chart"] for c in default_platform.resources("Custom::AWSCDK-EKS-HelmChart").values()}
    stack = queued_platform.stack
    # Destroy goes in reverse: the jobs, then the queues, then the Ray namespace, then Kueue.
    queues = queued_platform.logical_id(stack.queueing.queues)
    chart = queued_platform.logical_id(stack.queueing.chart)
    namespace = queued_platform.logical_id(stack.ray_service_account.namespace_manifest)
    resources = queued_platform.template["Resources"]
    assert chart in resources[namespace]["DependsOn"] and namespace in resources[queues]["DependsOn"]
    job = next(key for key, r in resources.items() if r["Type"] == "Custom::AWSCDK-EKS-KubernetesResource"
               and '"kind":"RayJob"' in json.dumps(r["Properties"].get("Manifest")).replace("\\\\", "").replace('\\"', '"'))
    assert queues in resources[job]["DependsOn"]
