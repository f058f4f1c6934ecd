"""Kueue queueing the Ray jobs (``-c queueing=kueue``, ray_train_eks/workload/queueing.py,
ray_train_eks/constructs/queueing.py): the queue objects validate against Kueue v0.19.2's CRDs, the
ClusterQueue's quota is what the platform's nodes hold for one job (so one job is admitted at a time,
whole, and every job that fits the nodes fits the quota), a queued RayJob is labelled with its queue
and created suspended with KubeRay's end of a suspended job, its cluster gone within a minute of its end, the chart is
pinned with values its own values.yaml has, and the Ray namespace goes before Kueue on destroy."""

from __future__ import annotations

import dataclasses
import json

import pytest

from ray_train_eks.workload.queueing import CLUSTER_QUEUE, LOCAL_QUEUE, QUEUE_LABEL, job_requests, queue_objects, quantity
from ray_train_eks.workload.objects import ray_job, workload_problems

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
    # one job: 2 g6.12xlarge workers (4 GPUs, 1 EFA interface each, their nodes' NVMe), the head, the submitter.
    assert group["coveredResources"] == list(quota) == ["cpu", "ephemeral-storage", "memory", "nvidia.com/gpu",
                                                        "vpc.amazonaws.com/efa"]
    assert (quota["nvidia.com/gpu"], quota["vpc.amazonaws.com/efa"]) == ("8", "2")
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"]["requests"]
    worker = job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]["requests"]
    assert quantity(quota["cpu"]) == quantity(head["cpu"]) + 2 * quantity(worker["cpu"]) + 0.5  # KubeRay's submitter: 500m
    assert quantity(quota["memory"]) == quantity(head["memory"]) + 2 * quantity(worker["memory"]) + 200 * 2**20
    from ray_train_eks.workload.queueing import NODE_DISK_ALLOCATABLE_SHARE
    from ray_train_eks.instances import INSTANCE_TYPES

    nvme = INSTANCE_TYPES["g6.12xlarge"].instance_store_gb * 1e9
    assert quantity(quota["ephemeral-storage"]) == 2 * nvme * NODE_DISK_ALLOCATABLE_SHARE // 2**20 * 2**20
    # A second job does not fit beside the first (its GPUs): they wait, admitted whole one at a time.
    assert 2 * quantity(job_requests(job)["nvidia.com/gpu"]) > quantity(quota["nvidia.com/gpu"])
    assert all(quantity(amount) <= quantity(quota[name]) for name, amount in job_requests(job).items())


def test_a_queued_job_is_labelled_suspended_and_ends_as_kubeRay_lets_a_suspended_job_end(queued_spec):
    from crd_schema import kuberay_schemas, validate

    job = ray_job(queued_spec)
    validate(job, kuberay_schemas())
    assert job["metadata"]["labels"][QUEUE_LABEL] == LOCAL_QUEUE
    assert job["spec"]["suspend"] is True
    # KubeRay v1.7.0 rejects deletionRules with shutdownAfterJobFinishes, and a suspended job without it.
    assert job["spec"]["shutdownAfterJobFinishes"] is True and "deletionStrategy" not in job["spec"]
    # Kueue frees the quota when the job ends and admits the next, whose pods need these GPU nodes: gone
    # within a minute, not the platform's ten (its logs are in CloudWatch and the bucket).
    assert queued_spec.ttl_seconds_after_finished == 600 and job["spec"]["ttlSecondsAfterFinished"] == 30
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


def test_trainers_get_an_access_entry_in_a_group_bound_to_exactly_the_commands_verbs(queued_platform):
    """-c trainerRoleArns: a STANDARD access entry per role with the trainers' group and no access
    policy; a Role in the Ray namespace with the command's verbs (nothing cluster-wide, no secrets,
    no exec), bound to that group, applied after the namespace."""
    from ray_train_eks.workload.trainer_access import TRAINER_ROLE, TRAINERS_GROUP

    (entry,) = [
        r for r in queued_platform.resources("AWS::EKS::AccessEntry").values()
        if r["Properties"]["PrincipalArn"] == "arn:aws:iam::123456789012:role/Trainer"]
    assert entry["Properties"]["KubernetesGroups"] == [TRAINERS_GROUP] and entry["Properties"]["Type"] == "STANDARD"
    assert not entry["Properties"].get("AccessPolicies")
    objects = {o["kind"]: (key, o) for key, found in queued_platform.manifests().items() for o in found
               if o["kind"] in ("Role", "RoleBinding") and o["metadata"]["name"] == TRAINER_ROLE}
    (role_key, role), (_, binding) = objects["Role"], objects["RoleBinding"]
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == "ray-train"
    granted = {(rule["apiGroups"][0], resource, verb) for rule in role["rules"] for resource in rule["resources"]
               for verb in rule["verbs"]}
    assert ("", "secrets", "get") not in granted and ("", "pods/exec", "create") not in granted
    assert ("ray.io", "rayjobs", "create") in granted and ("coordination.k8s.io", "leases", "update") in granted
    assert binding["subjects"] == [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": TRAINERS_GROUP}]
    namespace = queued_platform.logical_id(queued_platform.stack.ray_service_account.namespace_manifest)
    assert namespace in queued_platform.template["Resources"][role_key]["DependsOn"]
