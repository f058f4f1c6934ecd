"""The Ray workload: fine-grained fields, strict CRD-schema validation with API-server
defaulting, synth-time checks with their messages, dist/ snapshots."""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path
from unittest.mock import patch

import jsonschema
import pytest
import yaml

import cdk8s

from ray_train_eks.charts import (
    ObjectChart,
    RayWorkloadSpec,
    TrainingCodeChart,
    code_parts,
    config_map_data,
    ray_job,
    ray_objects,
    runtime_env_yaml,
    training_entrypoint,
    workload_problems,
    write_dist,
)
from ray_train_eks.config import ConfigError, PlatformConfig

from crd_schema import kuberay_schemas, validate

ROOT = Path(__file__).resolve().parents[1]
CODE_DIR = ROOT / "training"
CODE = TrainingCodeChart(cdk8s.App(), "Code", directory=CODE_DIR, namespace="ray-train").files


def spec_for(**context) -> RayWorkloadSpec:
    return PlatformConfig.from_context(context.get, environ={}).workload_spec(CODE)


# --------------------------------------------------------------------- schema validation

@pytest.fixture(scope="module")
def crd_schemas():
    return kuberay_schemas()


@pytest.mark.parametrize("context", [{}, {"gpuInstanceType": "p4d.24xlarge"}, {"workload": "cluster", "shutdownAfterJobFinishes": "false", "ttlSecondsAfterFinished": "0"}, {"ncclDebug": "true"}, {"gpuCapacity": "karpenter"}])
def test_every_object_validates_strictly_against_the_crds(crd_schemas, context):
    objects = ray_objects(spec_for(**context))
    assert objects
    for obj in objects:
        validate(obj, crd_schemas)


def test_strict_validation_catches_a_misspelled_field(crd_schemas):
    job = ray_job(spec_for())
    job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["volume_mounts"] = []
    with pytest.raises(jsonschema.ValidationError, match="volume_mounts"):
        validate(job, crd_schemas)


def test_api_server_defaults_are_what_we_expect(crd_schemas):
    defaulted = validate(ray_job(spec_for()), crd_schemas)
    assert defaulted["spec"]["submissionMode"] == "K8sJobMode"
    assert defaulted["spec"]["backoffLimit"] == 0


# --------------------------------------------------------------------- pod templates

def _head(obj):
    spec = obj["spec"]["rayClusterSpec"] if obj["kind"] == "RayJob" else obj["spec"]
    return spec["headGroupSpec"]


def _workers(obj):
    spec = obj["spec"]["rayClusterSpec"] if obj["kind"] == "RayJob" else obj["spec"]
    (group,) = spec["workerGroupSpecs"]
    return group


def test_head_is_on_system_nodes_without_gpus_with_dashboard_and_prestop():
    head = _head(ray_job(spec_for()))
    assert head["rayStartParams"]["num-gpus"] == "0" and head["rayStartParams"]["dashboard-host"] == "0.0.0.0"
    pod = head["template"]["spec"]
    container, watch = pod["containers"]  # KubeRay takes the first container for Ray's (utils.RayContainerIndex)
    assert container["name"] == "ray-head" and watch["name"] == "stopped-job-watch"
    assert watch["resources"]["requests"] == watch["resources"]["limits"]  # the pod stays Guaranteed
    assert pod["nodeSelector"] == {"ray-train-eks/node-role": "system"}
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"} in container["env"]
    assert container["lifecycle"]["preStop"]["exec"]["command"][-1] == "ray stop"
    assert container["resources"]["requests"] == container["resources"]["limits"] == {"cpu": "2", "memory": "8Gi"}
    assert "command" not in container and "args" not in container  # KubeRay injects ray start
    assert {"name": "dashboard", "containerPort": 8265} in container["ports"]


@pytest.mark.parametrize("instance, gpus, efa, cpu, memory", [("g6.12xlarge", 4, 1, "46", "163Gi"), ("p4d.24xlarge", 8, 4, "94", "979Gi")])
def test_one_worker_per_gpu_node_asks_all_gpus_and_efa_interfaces(instance, gpus, efa, cpu, memory):
    workers = _workers(ray_job(spec_for(gpuInstanceType=instance, gpuNodeCount="3")))
    assert workers["replicas"] == workers["minReplicas"] == workers["maxReplicas"] == 3
    (container,) = workers["template"]["spec"]["containers"]
    expected = {"cpu": cpu, "memory": memory, "nvidia.com/gpu": str(gpus), "vpc.amazonaws.com/efa": str(efa)}
    # Guaranteed QoS (requests = limits); the staged checkpoints' disk is a request only.
    requests = dict(container["resources"]["requests"])
    assert requests.pop("ephemeral-storage").endswith("Gi")
    assert requests == container["resources"]["limits"] == expected


def test_workers_tolerate_the_gpu_taint_and_talk_over_efa():
    pod = _workers(ray_job(spec_for()))["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["nodeSelector"] == {"ray-train-eks/node-role": "gpu"}
    assert (env["FI_PROVIDER"], env["NCCL_NET_PLUGIN"], env["NCCL_SOCKET_IFNAME"]) == ("efa", "ofi", "^lo,docker,veth")
    assert env["NCCL_DEBUG"] == "WARN"  # set either way: the DLC image sets INFO itself
    nccl = {e["name"]: e.get("value") for e in _workers(ray_job(spec_for(ncclDebug="true")))["template"]["spec"]["containers"][0]["env"]}
    assert nccl["NCCL_DEBUG"] == "INFO"


def test_shm_cache_code_image_version_and_service_account():
    job = ray_job(spec_for())
    assert job["spec"]["rayClusterSpec"]["rayVersion"] == "2.58.0"
    for group in (_head(job), _workers(job)):
        pod = group["template"]["spec"]
        container = pod["containers"][0]
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert container["image"] == "public.ecr.aws/deep-learning-containers/ray:train-ml-cuda-v1.1"
        assert pod["serviceAccountName"] == "ray-train"
        assert volumes["dshm"]["emptyDir"]["medium"] == "Memory" and mounts["/dev/shm"] == "dshm"
        assert "emptyDir" in volumes["cache"] and mounts["/cache"] == "cache"
        parts = [source["configMap"]["name"] for source in volumes["training-code"]["projected"]["sources"]]
        count = len(code_parts(CODE))
        assert count >= 2 and parts == ["ray-train-eks-code"] + [f"ray-train-eks-code-{n}" for n in range(2, count + 1)]
        assert mounts["/opt/ray-train-eks/training"] == "training-code"
    assert _workers(job)["template"]["spec"]["volumes"][2]["emptyDir"]["sizeLimit"] == "48Gi"  # 30% of 163Gi


# --------------------------------------------------------------------- RayJob and RayCluster

def test_rayjob_runs_the_production_preset_into_the_bucket():
    spec = ray_job(spec_for())["spec"]
    assert spec["entrypoint"] == (
        "python -m training.train --preset qwen2.5-1.5b-l4x8 --num-workers 8 --workers-per-node 4 --gpu-type L4 --expect-efa"
    )
    assert "$" not in spec["entrypoint"]  # nothing for the submitter pod's shell to expand
    head_env = {e["name"]: e for e in _head(ray_job(spec_for()))["template"]["spec"]["containers"][0]["env"]}
    assert head_env["TRAINING_BUCKET"]["valueFrom"] == {"configMapKeyRef": {"name": "ray-train-eks-settings", "key": "bucket"}}
    assert head_env["RAY_TRAIN_EKS_STORAGE_PATH"]["value"] == "s3://$(TRAINING_BUCKET)/runs"
    assert spec["submissionMode"] == "K8sJobMode"
    assert (spec["activeDeadlineSeconds"], spec["backoffLimit"]) == (14400, 0)
    assert yaml.safe_load(spec["runtimeEnvYAML"]) == {"env_vars": {
        "PYTHONPATH": "/opt/ray-train-eks", "TOKENIZERS_PARALLELISM": "false",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        # tracked: time for the driver to end its MLflow run KILLED at ray job stop (Ray's default: 3 s)
        "RAY_JOB_STOP_WAIT_TIME_S": "30"},
        # tracked (the default: a SageMaker MLflow App): MLflow's client where the image lacks it
        "pip": {"packages": ["mlflow-skinny==3.17.2", "sagemaker-mlflow==0.5.0"], "pip_check": False}}


def test_the_gpu_workers_go_when_the_job_ends_and_the_head_stays_its_ttl_for_the_logs():
    spec = ray_job(spec_for())["spec"]
    assert spec["shutdownAfterJobFinishes"] is False and "ttlSecondsAfterFinished" not in spec  # KubeRay: not with rules
    rules = spec["deletionStrategy"]["deletionRules"]
    for state in ({"jobStatus": "SUCCEEDED"}, {"jobStatus": "FAILED"}, {"jobDeploymentStatus": "Failed"}):
        assert {"condition": {**state, "ttlSeconds": 0}, "policy": "DeleteWorkers"} in rules
        assert {"condition": {**state, "ttlSeconds": 600}, "policy": "DeleteCluster"} in rules
    assert len(rules) == 6
    assert ray_job(spec_for())["spec"]["rayClusterSpec"]["enableInTreeAutoscaling"] is False  # DeleteWorkers needs it off
    # A job queued suspended (Kueue) must keep shutdownAfterJobFinishes (KubeRay 1.7.0 validation.go): today's TTL.
    queued = ray_job(spec_for(suspend="true"))["spec"]
    assert (queued["shutdownAfterJobFinishes"], queued["ttlSecondsAfterFinished"], "deletionStrategy" in queued) == (True, 600, False)
    kept = ray_job(spec_for(shutdownAfterJobFinishes="false", ttlSecondsAfterFinished="0"))["spec"]
    assert kept["shutdownAfterJobFinishes"] is False and "deletionStrategy" not in kept


def test_rayjob_name_is_a_hash_of_its_spec_and_code():
    base = ray_job(spec_for())["metadata"]["name"]
    assert base.startswith("finetune-") and len(base) == len("finetune-") + 8
    assert ray_job(spec_for())["metadata"]["name"] == base  # deterministic
    assert ray_job(spec_for(trainingArgs="--max-steps 60"))["metadata"]["name"] != base
    changed_code = dataclasses.replace(spec_for(), training_code={**CODE, "train.py": CODE["train.py"] + "\n"})
    assert ray_job(changed_code)["metadata"]["name"] != base


def test_cluster_workload_runs_the_job_on_the_standing_cluster():
    spec = spec_for(workload="cluster", shutdownAfterJobFinishes="false", ttlSecondsAfterFinished="0")
    objects = {o["kind"]: o for o in ray_objects(spec) if o["kind"] != "NetworkPolicy"}
    assert objects["RayJob"]["spec"]["clusterSelector"] == {"ray.io/cluster": "ray-train"}
    assert "backoffLimit" not in objects["RayJob"]["spec"]  # KubeRay rejects any value > 0 with clusterSelector
    assert "rayClusterSpec" not in objects["RayJob"]["spec"] and objects["RayJob"]["spec"]["shutdownAfterJobFinishes"] is False
    # The same templates, each cluster's pods labelled with its own name (for its NetworkPolicies);
    # the standing cluster's pods are recreated when its spec changes (KubeRay forbids it for a RayJob's).
    job = ray_job(spec_for())
    standing = dict(objects["RayCluster"]["spec"])
    assert standing.pop("upgradeStrategy") == {"type": "Recreate"} and "upgradeStrategy" not in job["spec"]["rayClusterSpec"]
    cluster_label = lambda name: json.dumps(standing).replace(f'"ray-train-eks/ray-cluster": "{name}"', "")
    # and the RayJob's head has the stopped-job watch beside it (KubeRay keeps a stopped job's cluster)
    assert job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"].pop()["name"] == "stopped-job-watch"
    assert cluster_label("ray-train") == json.dumps(job["spec"]["rayClusterSpec"]).replace(
        f'"ray-train-eks/ray-cluster": "{job["metadata"]["name"]}"', "")


def test_job_workload_has_no_standing_cluster_and_run_job_false_has_no_job():
    marker = ["ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
    stopped = ["Role", "RoleBinding", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
    assert [o["kind"] for o in ray_objects(spec_for())] == marker + stopped + ["NetworkPolicy"] * 3 + ["RayJob"]
    assert [o["kind"] for o in ray_objects(spec_for(networkPolicies="false"))] == marker + stopped + ["RayJob"]
    # the submit of ray-train-eks needs the watch's permission where the stack runs no job
    assert [o["kind"] for o in ray_objects(spec_for(runJob="false"))] == marker + stopped + ["NetworkPolicy"]


# --------------------------------------------------------------------- synth-time checks

@pytest.mark.parametrize(
    "context, message",
    [
        ({"rayClusterName": "Ray_Train"}, "rayClusterName='Ray_Train': a RayCluster name must be DNS-1035 (lower-case letters, digits, '-', starting with a letter) and at most 53 characters"),
        ({"rayClusterName": "r" * 54}, f"rayClusterName='{'r' * 54}': a RayCluster name must be DNS-1035"),
        ({"rayJobNamePrefix": "x" * 39}, f"rayJobNamePrefix='{'x' * 39}': the RayJob name is '<prefix>-<8-character hash>', DNS-1035 and at most 47 characters, so the prefix must be DNS-1035 and at most 38 characters"),
        ({"submissionMode": "K8SJobMode"}, "submissionMode='K8SJobMode': use one of K8sJobMode, HTTPMode, InteractiveMode, SidecarMode"),
        ({"shutdownAfterJobFinishes": "false"}, "ttlSecondsAfterFinished=600 needs shutdownAfterJobFinishes=true (KubeRay rejects a TTL without it); set both, or ttlSecondsAfterFinished=0"),
        ({"suspend": "true", "shutdownAfterJobFinishes": "false", "ttlSecondsAfterFinished": "0"}, "suspend=true needs shutdownAfterJobFinishes=true (KubeRay rejects it otherwise)"),
        ({"workload": "cluster"}, "workload=cluster with shutdownAfterJobFinishes=true: a RayJob on an existing cluster (clusterSelector) cannot shut that cluster down; set shutdownAfterJobFinishes=false (and ttlSecondsAfterFinished=0)"),
        ({"workload": "pool"}, "workload='pool': use job (the RayJob brings its own cluster) or cluster (a standing RayCluster)"),
        ({"activeDeadlineSeconds": "10"}, "activeDeadlineSeconds=10: below a minute the job cannot even start; use e.g. 14400"),
    ],
)
def test_workload_rules_fail_synth_with_their_message(context, message):
    with pytest.raises(ConfigError) as raised:
        PlatformConfig.from_context(context.get, environ={})
    assert any(problem.startswith(message) for problem in raised.value.problems), raised.value.problems


def test_gpu_and_efa_counts_are_checked_against_the_instance_type():
    spec = dataclasses.replace(spec_for(), gpus_per_worker=8, efa_per_worker=2)
    assert workload_problems(spec) == [
        "gpusPerWorker=8: g6.12xlarge has 4 GPUs; use 1 to 4",
        "efaPerWorker=2: g6.12xlarge has 1 EFA interfaces; use 0 to 1",
    ]


# --------------------------------------------------------------------- delivery

def test_chart_renders_exactly_the_objects(tmp_path):
    objects = ray_objects(spec_for(workload="cluster", shutdownAfterJobFinishes="false", ttlSecondsAfterFinished="0"))
    chart = ObjectChart(cdk8s.App(outdir=str(tmp_path)), "Workload", objects=objects)
    assert chart.to_json() == objects


def test_dist_holds_both_workloads(tmp_path):
    files = write_dist(spec_for(), CODE_DIR, tmp_path / "dist")
    assert [f.name for f in files] == ["ray-workload-job.k8s.yaml", "ray-workload-cluster.k8s.yaml", "settings.k8s.yaml"]
    job = list(yaml.safe_load_all(files[0].read_text()))
    code = ["ConfigMap"] * len(code_parts(CODE))  # the code split under kubectl apply's cap
    marker = ["ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
    stopped = ["Role", "RoleBinding", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
    assert [o["kind"] for o in job] == [*code, *marker, *stopped, *["NetworkPolicy"] * 3, "RayJob"] and job[-1] == ray_job(spec_for())
    cluster = [o["kind"] for o in yaml.safe_load_all(files[1].read_text())]
    assert cluster == [*code, *marker, *["NetworkPolicy"] * 3, "RayCluster", "RayJob"]
    (settings,) = yaml.safe_load_all(files[2].read_text())
    assert settings["data"] == {"bucket": "REPLACE-WITH-BucketName-OUTPUT"}
    # What the files assume about the cluster is said at their top, for GitOps users.
    header = files[0].read_text().split("\n---", 1)[0]
    assert "namespace 'ray-train', service account 'ray-train'" in header
    assert "from namespace\n# 'kuberay', pods labelled app.kubernetes.io/name=kuberay-operator" in header


def test_dist_snapshot(tmp_path, snapshot):
    # Stand-in modules with the real names: edits of training/ must not churn the snapshot.
    stand_in = tmp_path / "training"
    stand_in.mkdir()
    for name in CODE:
        (stand_in / name).parent.mkdir(parents=True, exist_ok=True)
        (stand_in / name).write_text("<training module>")
    files = write_dist(spec_for(), stand_in, tmp_path / "dist")
    assert {f.name: f.read_text() for f in files} == snapshot


def test_training_code_configmap_ships_every_training_module_and_nothing_else(tmp_path):
    assert set(CODE) == {p.relative_to(CODE_DIR).as_posix() for p in CODE_DIR.rglob("*.py")}
    assert {"train.py", "loop.py", "__init__.py", "data/__init__.py", "modeling/plan.py"} <= set(CODE)
    (tmp_path / "main.py").write_text("print(1)\n")
    (tmp_path / "notes.txt").write_text("not code\n")
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "main.cpython-311.py").write_text("cached\n")
    (tmp_path / "steps").mkdir()
    (tmp_path / "steps" / "__init__.py").write_text("")
    (tmp_path / "steps" / "one.py").write_text("print(2)\n")
    (tmp_path / "scratch").mkdir()  # a folder that is no subpackage: not shipped
    (tmp_path / "scratch" / "try.py").write_text("print(3)\n")
    chart = TrainingCodeChart(cdk8s.App(), "Code", directory=tmp_path, namespace="team")
    (configmap,) = chart.to_json()
    assert configmap["data"] == {"main.py": "print(1)\n", "steps.__init__.py": "", "steps.one.py": "print(2)\n"}
    assert configmap["metadata"]["namespace"] == "team"
    assert configmap["metadata"]["annotations"]["ray-train-eks/code-sha256"]
    # The pods give each key its path back: the subpackage is a folder again.
    spec = dataclasses.replace(spec_for(), training_code=chart.files)
    (source,) = {v["name"]: v for v in _head(ray_job(spec))["template"]["spec"]["volumes"]}["training-code"]["projected"]["sources"]
    assert source["configMap"]["items"] == [{"key": "main.py", "path": "main.py"},
                                           {"key": "steps.__init__.py", "path": "steps/__init__.py"},
                                           {"key": "steps.one.py", "path": "steps/one.py"}]


def test_every_file_of_the_training_package_reaches_the_pods_at_its_path():
    """What the pods see under /opt/ray-train-eks/training: the projection of every code part."""
    job = ray_job(spec_for())
    volume = {v["name"]: v for v in _workers(job)["template"]["spec"]["volumes"]}["training-code"]
    data = {}
    for part in code_parts(CODE):
        data.update(config_map_data(part))
    projected = {item["path"]: data[item["key"]] for source in volume["projected"]["sources"]
                 for item in source["configMap"]["items"]}
    assert projected == CODE


# --------------------------------------------------------------------- KubeRay's own rules, at synth

@pytest.mark.parametrize(
    "context, message",
    [
        ({"workload": "cluster", "shutdownAfterJobFinishes": "false", "ttlSecondsAfterFinished": "0", "backoffLimit": "1"},
         "backoffLimit=1 with workload=cluster: KubeRay rejects backoffLimit > 0 for a RayJob on an existing cluster (clusterSelector); use backoffLimit=0"),
        ({"submissionMode": "InteractiveMode", "backoffLimit": "2"},
         "backoffLimit=2 with submissionMode=InteractiveMode: KubeRay rejects retries in InteractiveMode; use backoffLimit=0"),
        ({"workload": "cluster", "shutdownAfterJobFinishes": "false", "ttlSecondsAfterFinished": "0", "submissionMode": "SidecarMode"},
         "submissionMode=SidecarMode with workload=cluster: KubeRay does not support clusterSelector in SidecarMode; use K8sJobMode or HTTPMode"),
        ({"workload": "cluster", "shutdownAfterJobFinishes": "false", "ttlSecondsAfterFinished": "0", "suspend": "true"},
         "suspend=true with workload=cluster: KubeRay's clusterSelector mode cannot suspend; use workload=job"),
    ],
)
def test_kuberay_validation_rules_fail_synth(context, message):
    with pytest.raises(ConfigError) as raised:
        PlatformConfig.from_context(context.get, environ={})
    assert message in raised.value.problems


def test_runtime_env_is_yaml_as_kuberay_requires():
    assert yaml.safe_load(runtime_env_yaml(RayWorkloadSpec()))["env_vars"]["PYTHONPATH"] == "/opt/ray-train-eks"


def test_a_lora_job_installs_the_pinned_peft_a_full_fine_tune_installs_nothing():
    """The Ray Train image has no PEFT: a LoRA job's runtime env installs the versions the tests ran
    (requirements-dev.txt's pins), a full fine-tune's installs nothing; and the memory plan at synth
    plans the LoRA job (the 32B LoRA preset fits the default 8 L4s, a 32B full fine-tune does not)."""
    import re

    from training.config import HARNESS_PACKAGES, LORA_PACKAGES, TRACKING_PACKAGES

    untracked = {"mlflowTracking": "none"}
    lora = yaml.safe_load(ray_job(spec_for(trainingArgs="--peft lora", **untracked))["spec"]["runtimeEnvYAML"])
    assert lora["pip"] == {"packages": list(LORA_PACKAGES), "pip_check": False}
    assert "pip" not in yaml.safe_load(ray_job(spec_for(**untracked))["spec"]["runtimeEnvYAML"])
    # A tracked job (the default) installs MLflow's client and the SageMaker plugin too.
    tracked = yaml.safe_load(ray_job(spec_for(trainingArgs="--peft lora"))["spec"]["runtimeEnvYAML"])
    assert tracked["pip"]["packages"] == [*LORA_PACKAGES, *TRACKING_PACKAGES]
    pinned = dict(re.findall(r"^([a-z-]+)==(\S+)$", (ROOT / "requirements-dev.txt").read_text(), re.MULTILINE))
    assert [f"{name}=={pinned[name]}" for name in ("peft", "accelerate")] == list(LORA_PACKAGES)
    assert [f"{name}=={pinned[name]}" for name in ("mlflow-skinny", "sagemaker-mlflow")] == list(TRACKING_PACKAGES)
    # A job with --eval-tasks installs nothing for its training: the harness (with IFEval's extra, the accelerate
    # and PEFT it needs, at the versions the tests ran) goes into the benchmark's own tasks' environment.
    bench = yaml.safe_load(ray_job(spec_for(trainingArgs="--eval-tasks gsm8k,ifeval", **untracked))["spec"]["runtimeEnvYAML"])
    assert "pip" not in bench
    from training.evaluation.harness import harness_runtime_env

    assert list(HARNESS_PACKAGES) == [f"lm-eval[ifeval]=={pinned['lm-eval']}"]
    with patch("training.evaluation.harness.harness_here", return_value=False):  # a driver without the harness: the image's
        packages = harness_runtime_env()["pip"]["packages"]
    assert packages == [f"lm-eval[ifeval]=={pinned['lm-eval']}", *[f"{name}=={pinned[name]}" for name in ("peft", "accelerate")]]
    assert workload_problems(spec_for(trainingArgs="--preset qwen2.5-32b-lora-l4x8")) == []
    with pytest.raises(ConfigError, match="Qwen/Qwen2.5-32B does not fit 8 x L4"):
        spec_for(trainingArgs="--model Qwen/Qwen2.5-32B")
    # A target the model does not have is refused at synth, naming the model's linear layers.
    with pytest.raises(ConfigError, match="c_attn is not a linear layer of Qwen/Qwen2.5-1.5B's decoder layers; use all-linear "
                                          "or some of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"):
        spec_for(trainingArgs="--peft lora --lora-target-modules q_proj,c_attn")


# --------------------------------------------------------------------- a consumer's workload

def test_training_args_are_quoted_for_the_submitters_shell():
    args = "--run-name 'a b' --dataset s3://bucket/$USER/data.jsonl --model x;rm"
    entrypoint = training_entrypoint(spec_for(trainingArgs=args))
    assert entrypoint.endswith("--run-name 'a b' --dataset 's3://bucket/$USER/data.jsonl' --model 'x;rm'")
    assert shlex.split(entrypoint)[-6:] == ["--run-name", "a b", "--dataset", "s3://bucket/$USER/data.jsonl", "--model", "x;rm"]


def test_a_consumer_entrypoint_package_and_node_sizes():
    spec = RayWorkloadSpec(system_instance_type="m5.large", head_resources=(1, 4), entrypoint=("python", "-m", "my_trainer.main", "--lr", "1e-5"),
                           code_package="my_trainer", training_code=CODE)
    assert workload_problems(spec) == []
    job = ray_job(spec)
    assert job["spec"]["entrypoint"] == "python -m my_trainer.main --lr 1e-5"
    head = _head(job)["template"]["spec"]
    assert head["containers"][0]["resources"]["requests"] == {"cpu": "1", "memory": "4Gi"}
    assert "nodeSelector" not in head and "tolerations" not in head  # neutral: any node of theirs
    workers = _workers(job)["template"]["spec"]
    assert "nodeSelector" not in workers and workers["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert {"name": "training-code", "mountPath": "/opt/ray-train-eks/my_trainer", "readOnly": True} in head["containers"][0]["volumeMounts"]


def test_instance_types_outside_the_table_need_explicit_sizes():
    assert workload_problems(RayWorkloadSpec(system_instance_type="m5.large", gpu_instance_type="g7.48xlarge")) == [
        "system_instance_type='m5.large' is not in ray_train_eks.instances.INSTANCE_TYPES, so the Ray head cannot be sized "
        "from it; pass head_resources=(cpu, memory_gib)",
        "gpu_instance_type='g7.48xlarge' is not in ray_train_eks.instances.INSTANCE_TYPES; pass worker_resources=(cpu, "
        "memory_gib), gpus_per_worker and efa_per_worker",
    ]
    sized = RayWorkloadSpec(gpu_instance_type="g7.48xlarge", worker_resources=(180, 1500), gpus_per_worker=8, efa_per_worker=4)
    assert workload_problems(sized) == []
    (container,) = _workers(ray_job(sized))["template"]["spec"]["containers"]
    assert container["resources"]["limits"] == {"cpu": "180", "memory": "1500Gi", "nvidia.com/gpu": "8", "vpc.amazonaws.com/efa": "4"}


def test_gpu_workers_request_the_disk_their_staged_checkpoints_need():
    from ray_train_eks.charts import worker_disk_gib, worker_group_spec, workload_problems

    spec = spec_for()
    resources = worker_group_spec(spec)["template"]["spec"]["containers"][0]["resources"]
    # Qwen2.5-1.5B on 2 nodes: two checkpoints of a node's share (1.54 B x 12 bytes / 2) and the
    # bf16 weights, plus 10 GiB; a request only (a limit would evict the pod mid-checkpoint).
    assert resources["requests"]["ephemeral-storage"] == "31Gi" == f"{worker_disk_gib(spec)}Gi"
    assert "ephemeral-storage" not in resources["limits"]
    # A custom entrypoint: synth cannot know the model; nothing is requested.
    custom = dataclasses.replace(spec, entrypoint=("python", "-m", "mine"))
    assert "ephemeral-storage" not in worker_group_spec(custom)["template"]["spec"]["containers"][0]["resources"]["requests"]
    # A model whose checkpoints outgrow the node's NVMe is refused at synth.
    big = dataclasses.replace(spec, gpu_instance_type="g6.xlarge", gpu_node_count=1, training_args=("--model", "Qwen/Qwen2.5-14B"))
    assert any("of checkpoints and model on its node's disk, more than g6.xlarge's 250 GB of NVMe" in p
               for p in workload_problems(big))
    # LoRA: a checkpoint holds the adapters (32B at rank 8: 67 M parameters x 12 bytes, half on a node;
    # two staged), the base's bf16 weights (61 GiB) are cached; --merge-lora stages the merged model too.
    lora = spec_for(trainingArgs="--preset qwen2.5-32b-lora-l4x8")
    merged = spec_for(trainingArgs="--preset qwen2.5-32b-lora-l4x8 --merge-lora")
    assert (worker_disk_gib(lora), worker_disk_gib(merged)) == (72, 133)


def test_a_model_synth_cannot_plan_is_a_warning_naming_it_never_silence(tmp_path):
    from ray_train_eks.charts import memory_plan_notice

    assert memory_plan_notice(spec_for()) is None  # Qwen2.5-1.5B: in the table, planned at synth
    notice = memory_plan_notice(spec_for(trainingArgs="--model deepseek-ai/DeepSeek-R1-Distill-Qwen-32B"))
    assert notice.startswith("model 'deepseek-ai/DeepSeek-R1-Distill-Qwen-32B' is not in the memory plan's table and not a local folder")
    assert "the job plans it at its start" in notice and "python -m training.modeling.plan" in notice
    assert memory_plan_notice(spec_for(trainingArgs="--model deepseek-ai/DeepSeek-R1-Distill-Qwen-32B", runJob="false")) is None

    from aws_cdk.assertions import Annotations, Match
    from platform_synth import synth_platform

    platform = synth_platform(tmp_path, {"trainingArgs": "--model deepseek-ai/DeepSeek-R1-Distill-Qwen-32B"})
    Annotations.from_stack(platform.stack).has_warning("*", Match.string_like_regexp("DeepSeek-R1-Distill-Qwen-32B' is not in the memory plan"))


def test_synth_shows_what_the_memory_plan_chose_for_the_job(default_platform):
    """Where trainingArgs leave activation checkpointing and the micro-batch open, synth says what
    the job's plan chose and its headroom (the same choice the job makes before Ray starts); an
    option given is kept and nothing is chosen."""
    from aws_cdk.assertions import Annotations, Match

    from ray_train_eks.charts import memory_plan_choice

    chose = memory_plan_choice(spec_for())
    assert chose.startswith("chose activation checkpointing on, micro-batch 8 (1 accumulation step): ")
    assert "GiB headroom" in chose
    assert memory_plan_choice(spec_for(trainingArgs="--micro-batch-size 4 --activation-checkpointing")) is None
    Annotations.from_stack(default_platform.stack).has_info("*", Match.string_like_regexp("memory plan: chose activation"))
