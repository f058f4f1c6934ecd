"""Serving finished runs (``ray-train-eks serve``): the RayService against KubeRay v1.7.0's CRD and
its operator's checks, what it serves through Ray 2.58's own schemas made strict, the adapters'
staging read back by Ray's own LoRA listing and download, every refusal's sentence, and the command
against the stand-in API server (serve, serve again, the list, the endpoint and a chat through a
port-forward to a stand-in of the Serve proxy, unserve), with the trainers' Role alone.

No vLLM here (no CPU build on the registries this machine reaches): what vLLM itself does with the
configuration (loading the base, the adapters, stopping) was never run; docs/serving.md says so."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import yaml

from crd_schema import kuberay_schemas, validate
from fake_apiserver import FakeApiServer
from openai_standin import OpenAIStandIn
from serve_schemas import serve_config_problems, unknown_keys

BUCKET, NAMESPACE = "raytraineks-bucket", "ray-train"
BASE, REVISION = "Qwen/Qwen2.5-1.5B", "a" * 40
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
#: Qwen2.5's end of text and end of turn.
STOPS = [151643, 151645]


@pytest.fixture(autouse=True)
def root_logging_kept():
    """Ray's LLM modules add a StreamHandler on the root logger when first imported (ray.llm's logging
    set-up), bound to the stderr of that moment, a test's captured one: later tests' log records
    (botocore's) would write to it once it is closed. The root logger is put back as it was."""
    import logging

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    for handler in root.handlers[:]:
        if handler not in handlers and type(handler) is logging.StreamHandler:  # not pytest's own capture
            root.removeHandler(handler)
    root.setLevel(level)


@pytest.fixture(scope="module")
def moto():
    """moto's S3 with the training bucket, for the module; its variables (what points boto3, and so
    Ray's LoRA code, at it) are set for each test alone (:func:`s3`), never left behind."""
    from bench.local_s3 import start_moto

    server, env = start_moto(BUCKET)
    yield env
    server.terminate()
    server.wait(timeout=10)


def moto_client(env: dict):
    """A client of moto's S3 without the process's environment (a module's fixture sets nothing)."""
    import boto3

    return boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name=env["AWS_REGION"],
                        aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])


@pytest.fixture
def s3(moto, monkeypatch):
    for key, value in moto.items():
        monkeypatch.setenv(key, value)
    import boto3

    return boto3.client("s3")


def put_run(s3, run: str, *, kind: str = "lora", finished: bool = True, base: str = BASE, revision: str = REVISION,
            template: str = CHATML, **adapter) -> None:
    """A run's records as the training leaves them (training/train.py summary.json, runlog.py run.json,
    the export's final/: training/modeling/lora.py, export.py)."""
    def put(key: str, body) -> None:
        s3.put_object(Bucket=BUCKET, Key=f"runs/{run}/{key}", Body=body if isinstance(body, bytes) else json.dumps(body))

    put("run.json", {"run_name": run, "model": base, "model_revision": revision, "peft": kind, "parameters": 1_543_714_304})
    if not finished:
        return
    put("summary.json", {"final_model": f"s3://{BUCKET}/runs/{run}/final"})
    put("final/tokenizer_config.json", {"chat_template": template, "eos_token": "<|im_end|>"})
    put("final/generation_config.json", {"eos_token_id": STOPS})
    if kind == "lora":
        put("final/adapter_config.json", {"peft_type": "LORA", "r": 16, "lora_alpha": 32, "target_modules": ["q_proj", "v_proj"],
                                          "base_model_name_or_path": base, "revision": revision, "bias": "none",
                                          "use_dora": False, "modules_to_save": None, **adapter})
        put("final/adapter_model.safetensors", b"\0" * 64)
    else:
        put("final/config.json", {"model_type": "qwen2", "num_attention_heads": 12})
        put("final/model.safetensors", b"\0" * 1024)


@pytest.fixture(scope="module")
def seeded(moto):
    client = moto_client(moto)
    for run in ("lora-a", "lora-b", "lora-c"):
        put_run(client, run)
    put_run(client, "full-a", kind="full")


@pytest.fixture
def runs(seeded, s3):
    return s3


def platform_spec(**context):
    from ray_train_eks.config import PlatformConfig

    return PlatformConfig.from_context(context, environ={}).workload_spec()


def dry_run(capsys, tmp_path, runs: list[str], *extra: str, spec=None) -> list[dict]:
    from ray_train_eks.cli import main
    from ray_train_eks.workload.spec import spec_settings

    settings = tmp_path / "settings.json"
    settings.write_text(spec_settings(spec or platform_spec()))
    assert main(["serve", *runs, "--dry-run", "--settings", str(settings), "--bucket", BUCKET, *extra]) == 0, \
        capsys.readouterr().err
    return list(yaml.safe_load_all(capsys.readouterr().out))


# ---------------------------------------------------------------- the objects, as KubeRay and Ray read them


@pytest.mark.parametrize("context", [{}, {"gpuCapacity": "karpenter"}], ids=["nodegroup", "karpenter"])
def test_a_lora_service_passes_the_crd_the_operators_checks_and_rays_strict_schemas(runs, capsys, tmp_path, context):
    from ray_train_eks.workload.serving import operator_problems

    objects = dry_run(capsys, tmp_path, ["lora-a", "lora-b"], "--name", "chat", spec=platform_spec(**context))
    assert [o["kind"] for o in objects] == ["NetworkPolicy"] * 3 + ["RayService"]
    service = objects[-1]
    for obj in objects:
        validate(obj, kuberay_schemas())
    assert operator_problems(service) == []
    config = yaml.safe_load(service["spec"]["serveConfigV2"])
    assert serve_config_problems(config) == []
    (llm,) = config["applications"][0]["args"]["llm_configs"]
    assert llm["model_loading_config"] == {"model_id": BASE, "model_source": BASE}
    assert llm["engine_kwargs"]["revision"] == REVISION
    assert (llm["engine_kwargs"]["generation_config"], llm["engine_kwargs"]["chat_template"]) == (".", "chat_template.jinja")
    assert llm["runtime_env"]["working_dir"].startswith(f"s3://{BUCKET}/serve/chat/engine-")
    assert llm["lora_config"]["dynamic_lora_loading_path"] == f"s3://{BUCKET}/serve/chat/lora"
    assert llm["deployment_config"]["autoscaling_config"]["min_replicas"] == 0
    gpu = service["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    # With Karpenter on the serving NodePool's nodes (the stack labels them so), else on the node group's.
    assert gpu["template"]["spec"]["nodeSelector"] == {"ray-train-eks/node-role": "gpu-serving" if context else "gpu"}


def test_a_full_fine_tune_is_its_own_model_from_its_final_folder(runs, capsys, tmp_path):
    from ray_train_eks.workload.serving import operator_problems

    objects = dry_run(capsys, tmp_path, ["full-a"])
    service = objects[-1]
    assert service["metadata"]["name"] == "full-a" and operator_problems(service) == []
    config = yaml.safe_load(service["spec"]["serveConfigV2"])
    assert serve_config_problems(config) == []
    (llm,) = config["applications"][0]["args"]["llm_configs"]
    assert llm["model_loading_config"] == {"model_id": "full-a", "model_source": f"s3://{BUCKET}/runs/full-a/final"}
    assert "lora_config" not in llm and "runtime_env" not in llm


def test_the_strict_schemas_find_keys_rays_own_validation_drops():
    from ray.llm._internal.serve.core.configs.llm_config import LLMConfig
    from ray.serve.schema import DeploymentSchema

    config = {"applications": [{"name": "llm", "import_path": "x:y", "route_prefix": "/", "bogus": 1,
                                "args": {"llm_configs": [{"model_loading_config": {"model_id": "m"},
                                                          "engine_kwargs": {"max_lora_rnk": 16},
                                                          "deployment_config": {"autoscaling_config": {"min_replica": 0}}}],
                                         "ingress_deployment_config": {"ray_actor_options": {"num_cpu": 1}}, "extra": 2}}],
              "http_options": {"prot": 8000}}
    assert sorted(serve_config_problems(config)) == sorted([
        "unknown applications[0].bogus", "unknown http_options.prot", "unknown args.extra",
        "unknown ingress_deployment_config.ray_actor_options.num_cpu",
        "llm_configs[0]: unknown deployment_config.autoscaling_config.min_replica",
        "llm_configs[0]: engine_kwargs.max_lora_rnk is no vLLM 0.26 engine argument the service sets"])
    # which Ray's own validation accepts without a word
    LLMConfig.model_validate(config["applications"][0]["args"]["llm_configs"][0])
    assert unknown_keys(DeploymentSchema, {"name": "x", "max_ongoing_requests": 5}) == []


def test_the_operators_checks_are_said_as_kuberay_says_them():
    from ray_train_eks.workload.serving import ray_service, operator_problems

    service = ray_service(platform_spec(), "a" * 48, "applications: []")
    service["metadata"]["annotations"]["ray.io/initializing-timeout"] = "soon"
    service["spec"]["upgradeStrategy"]["type"] = "Recreate"
    service["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["minReplicas"] = 3
    assert operator_problems(service) == [
        "RayService name should be no more than 47 characters: " + "a" * 48,
        "ray.io/initializing-timeout has invalid format: soon",
        "Invalid value for RayService UpgradeStrategy: Recreate",
        "worker group gpu-serving: minReplicas 3 and maxReplicas 1 must be set, 0 or more, min <= max"]


# ---------------------------------------------------------------- staging, as Ray's LoRA code reads it


def test_staged_adapters_are_what_rays_lora_listing_and_download_find_and_nothing_else(runs, tmp_path):
    from ray.llm._internal.common.utils.lora_utils import get_lora_model_ids
    from ray.llm._internal.serve.utils.lora_serve_utils import LoraModelLoader, get_lora_model_metadata

    from ray_train_eks.handlers import serving
    from ray_train_eks.cli.serve import serving_platform

    exports, _ = serving.prepare(runs, BUCKET, "chat", ["lora-a", "lora-b", "lora-c"], serving_platform(platform_spec()))
    serving.stage(runs, BUCKET, "chat", exports)
    path = serving.lora_path(BUCKET, "chat")
    assert sorted(get_lora_model_ids(dynamic_lora_loading_path=path, base_model_id=BASE)) == [
        f"{BASE}:lora-a", f"{BASE}:lora-b", f"{BASE}:lora-c"]
    metadata = asyncio.run(get_lora_model_metadata(f"{BASE}:lora-b", path))
    assert metadata["bucket_uri"] == f"{path}/lora-b"
    from ray.llm._internal.serve.utils.lora_serve_utils import LoraMirrorConfig

    loaded = asyncio.run(LoraModelLoader(lora_root=str(tmp_path), max_tries=1).load_model(
        f"{BASE}:lora-b", LoraMirrorConfig(lora_model_id=f"{BASE}:lora-b", bucket_uri=metadata["bucket_uri"],
                                           max_total_tokens=2048)))
    assert sorted(p.name for p in __import__("pathlib").Path(loaded.local_path).iterdir()) == sorted(serving.ADAPTER_FILES)
    # The engine package, unpacked as Ray unpacks a replica's working directory, is what vLLM reads:
    # the runs' generation config (the end of a turn among its stops) and chat template.
    _engine_files_as_vllm_reads_them(runs, exports, tmp_path)
    # Served again with one run: the others are gone from the listing.
    exports, _ = serving.prepare(runs, BUCKET, "chat", ["lora-a"], serving_platform(platform_spec()))
    serving.stage(runs, BUCKET, "chat", exports)
    assert get_lora_model_ids(dynamic_lora_loading_path=path, base_model_id=BASE) == [f"{BASE}:lora-a"]


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize("name, setup, said", [
    ("nowhere", None, "no run nowhere in s3://raytraineks-bucket/runs/: ray-train-eks list shows the runs"),
    ("running", {"finished": False}, "run running has not finished (no s3://raytraineks-bucket/runs/running/summary.json yet)"),
    ("dora", {"use_dora": True}, "run dora is a DoRA adapter, which vLLM does not serve; train it as plain LoRA"),
    ("saves", {"modules_to_save": ["lm_head"]}, "run saves's adapter saves whole modules too (modules_to_save=['lm_head'])"),
    ("biased", {"bias": "all"}, "run biased's adapter trains biases (bias='all'), which vLLM does not serve"),
    ("huge", {"r": 1024}, "run huge: LoRA rank 1024 is not one vLLM serves (1 to 512)"),
    ("local", {"base": "/home/me/qwen"}, "run local's base '/home/me/qwen' is not one the cluster can load"),
], ids=lambda v: v if isinstance(v, str) and " " not in v else "")
def test_a_run_that_cannot_be_served_is_refused_with_why_before_anything_is_made(runs, capsys, tmp_path, name, setup, said):
    from ray_train_eks.cli import main

    if setup is not None:
        put_run(runs, name, **setup)
    settings = tmp_path / "settings.json"
    from ray_train_eks.workload.spec import spec_settings

    settings.write_text(spec_settings(platform_spec()))
    assert main(["serve", name, "--dry-run", "--settings", str(settings), "--bucket", BUCKET]) == 1
    out = capsys.readouterr()
    assert said in out.err and out.out == ""


def test_adapters_of_two_bases_or_two_chat_templates_are_refused_together(runs):
    from ray_train_eks.cli.serve import serving_platform
    from ray_train_eks.handlers import serving

    put_run(runs, "other-base", base="Qwen/Qwen2.5-7B")
    put_run(runs, "other-template", template="{{ messages }}")
    with pytest.raises(serving.ServingProblems) as refused:
        serving.prepare(runs, BUCKET, "chat", ["lora-a", "other-base", "other-template"], serving_platform(platform_spec()))
    assert refused.value.problems[0].startswith("the adapters are of different bases, and a service serves its adapters on one")
    assert refused.value.problems[1].startswith("the adapters were trained with different chat templates")


def test_a_service_name_kuberay_refuses_is_said_at_once():
    from ray_train_eks.workload.serving import service_problems

    assert service_problems(platform_spec(), "Chat_1") == [
        "service name 'Chat_1': KubeRay takes a DNS-1035 label of at most 47 characters (lower-case letters, digits and '-', "
        "starting with a letter), e.g. --name dolly-chat"]
    assert service_problems(platform_spec(servingGpuNodes="0"), "chat")[0].startswith("servingGpuNodes=0: serving needs")


def _engine_files_as_vllm_reads_them(s3, exports, tmp_path) -> None:
    from ray._private.runtime_env.packaging import download_and_unpack_package
    from transformers import GenerationConfig

    from ray_train_eks.handlers import serving

    uri = serving.engine_uri(BUCKET, "chat", serving.engine_package(exports))
    assert s3.head_object(Bucket=BUCKET, Key=uri.removeprefix(f"s3://{BUCKET}/"))["ContentLength"] > 0
    folder = asyncio.run(download_and_unpack_package(uri, str(tmp_path / "runtime")))
    # vllm/transformers_utils/config.py try_get_generation_config: GenerationConfig.from_pretrained(path)
    assert GenerationConfig.from_pretrained(folder).eos_token_id == STOPS
    assert (__import__("pathlib").Path(folder) / "chat_template.jinja").read_text() == CHATML


def test_the_bearer_key_ingress_refuses_a_request_without_the_key_through_rays_own_routing():
    """workload/bearer_ingress.py on a stand-in of Ray 2.58's OpenAiIngress (its module imports vLLM),
    routed as Ray routes it: the routes FastAPI makes of the class's methods by name
    (ingress.py ``make_fastapi_ingress``), then Serve's class-based view (http_util.py
    ``make_fastapi_class_based_view``, which takes a method for one only under the class's name),
    then requests through Starlette's test client: 401 without the key, the route with it."""
    import hashlib
    import types

    import ray.serve
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from ray.serve._private.http_util import make_fastapi_class_based_view

    from openai_ingress_shape import OpenAiIngress
    from ray_train_eks.workload.bearer_ingress import bearer_ingress, key_matches

    app = FastAPI()
    routes = {"models": app.get("/v1/models"), "model_data": app.get("/v1/models/{model:path}"),
              "chat": app.post("/v1/chat/completions")}
    ingress = bearer_ingress(OpenAiIngress)
    routed = type(ingress.__name__, (ingress,), {name: route(getattr(ingress, name)) for name, route in routes.items()})
    routed.__qualname__ = ingress.__qualname__
    make_fastapi_class_based_view(app, routed)
    instance = routed([], key_sha256=hashlib.sha256(b"s3cret").hexdigest())
    original = ray.serve.get_replica_context
    ray.serve.get_replica_context = lambda: types.SimpleNamespace(servable_object=instance)  # what a replica has
    try:
        client = TestClient(app)
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}):
            assert client.get("/v1/models", headers=headers).status_code == 401
            assert client.post("/v1/chat/completions", json={"model": "m"}, headers=headers).status_code == 401
        key = {"authorization": "Bearer s3cret"}
        assert client.get("/v1/models", headers=key).json() == {"data": [{"id": "m"}]}
        assert client.get("/v1/models/m", headers=key).json() == {"id": "m"}
        assert client.post("/v1/chat/completions", json={"model": "m"}, headers=key).json() == {"answered": "m"}
    finally:
        ray.serve.get_replica_context = original
    assert not key_matches(None, "0" * 64)


def test_an_internal_load_balancer_comes_with_a_bearer_key_the_ingress_checks(runs, capsys, tmp_path):
    from ray_train_eks.cli import main
    from ray_train_eks.workload.serving import INTERNAL_LB_ANNOTATIONS, operator_problems
    from ray_train_eks.workload.spec import spec_settings

    settings = tmp_path / "settings.json"
    settings.write_text(spec_settings(platform_spec()))
    assert main(["serve", "lora-a", "--name", "public", "--internal-lb", "--dry-run", "--settings", str(settings),
                 "--bucket", BUCKET]) == 0
    out, err = capsys.readouterr()
    objects = list(yaml.safe_load_all(out))
    service = objects[-1]
    for obj in objects:
        validate(obj, kuberay_schemas())
    assert operator_problems(service) == []
    assert service["spec"]["serveService"]["spec"]["type"] == "LoadBalancer"
    assert service["spec"]["serveService"]["metadata"]["annotations"] == INTERNAL_LB_ANNOTATIONS
    config = yaml.safe_load(service["spec"]["serveConfigV2"])
    assert serve_config_problems(config) == []
    args = config["applications"][0]["args"]
    key = err.rsplit("the bearer key whose SHA-256 the YAML holds: ", 1)[1].strip()
    import hashlib

    assert args["ingress_cls_config"] == {"ingress_cls": "ray_train_eks_serving.ingress:BearerKeyIngress",
                                          "ingress_extra_kwargs": {"key_sha256": hashlib.sha256(key.encode()).hexdigest()}}
    assert config["applications"][0]["runtime_env"]["py_modules"][0].startswith(f"s3://{BUCKET}/serve/public/code/ingress-")
    (serve_policy,) = [o for o in objects if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "public-serve"]
    assert "from" not in serve_policy["spec"]["ingress"][0]  # the load balancer's traffic reaches port 8000


def test_the_ingress_package_is_importable_where_ray_unpacks_a_py_module_from_s3(s3, tmp_path):
    import importlib
    import sys

    from ray._private.runtime_env.packaging import download_and_unpack_package

    from ray_train_eks.cli.serve import ingress_package

    s3.put_object(Bucket=BUCKET, Key="serve/x/code/ingress.zip", Body=ingress_package())
    folder = asyncio.run(download_and_unpack_package(f"s3://{BUCKET}/serve/x/code/ingress.zip", str(tmp_path / "py_modules")))
    sys.path.insert(0, folder)  # what the py_modules plugin does (py_modules.py set_pythonpath_in_context)
    try:
        module = importlib.import_module("ray_train_eks_serving.ingress")
        assert module.key_matches("Bearer k", __import__("hashlib").sha256(b"k").hexdigest())
    finally:
        sys.path.remove(folder)
        for name in [n for n in sys.modules if n.startswith("ray_train_eks_serving")]:
            del sys.modules[name]


def test_a_run_is_read_from_its_listing_alone_and_an_adapter_missing_a_file_is_refused(runs):
    """Only the objects the run's listing holds are read: S3 answers a read of a missing object 403,
    not 404, to a reader whose ListBucket is held to prefixes (the RayServing function's); an adapter
    without its weights or its generation config is refused, before anything is staged."""
    from ray_train_eks.handlers import serving

    read: list[str] = []
    def record(params, **_):
        read.append(params["Key"])

    runs.meta.events.register("provide-client-params.s3.GetObject", record)
    try:
        put_run(runs, "bare", template=None)
        runs.delete_object(Bucket=BUCKET, Key="runs/bare/final/tokenizer_config.json")
        runs.delete_object(Bucket=BUCKET, Key="runs/bare/run.json")
        export = serving.read_run(runs, BUCKET, "bare")
        listed = set(serving.listing(runs, BUCKET, "runs/bare/"))
        assert read and {key.removeprefix("runs/bare/") for key in read} <= listed
        assert export.chat_template is None and export.weights_bytes is None
        runs.delete_object(Bucket=BUCKET, Key="runs/bare/final/generation_config.json")
        runs.delete_object(Bucket=BUCKET, Key="runs/bare/final/adapter_model.safetensors")
        with pytest.raises(serving.ServingProblems) as refused:
            serving.read_run(runs, BUCKET, "bare")
        assert refused.value.problems == [f"run bare's s3://{BUCKET}/runs/bare/final/ lacks adapter_model.safetensors, "
                                          "generation_config.json (an export by an older ray-train-eks, or cut short): "
                                          "submit --resume bare exports it again"]
    finally:
        runs.meta.events.unregister("provide-client-params.s3.GetObject", record)


def test_an_s3_base_is_asked_for_by_a_name_without_a_colon(runs, capsys, tmp_path):
    """Ray splits '<base>:<adapter>' at the first colon, so an 's3://...' id would name no model."""
    put_run(runs, "from-s3", base="s3://models-bucket/qwen2.5-1.5b")
    service = dry_run(capsys, tmp_path, ["from-s3"])[-1]
    (llm,) = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"]["llm_configs"]
    assert llm["model_loading_config"] == {"model_id": "qwen2.5-1.5b", "model_source": "s3://models-bucket/qwen2.5-1.5b"}
    assert "revision" not in llm["engine_kwargs"]  # Ray downloads what the folder holds


def test_replicas_are_counted_in_gpus_and_more_models_than_serving_gpus_are_refused(runs):
    from ray_train_eks.handlers import serving

    platform = serving.ServingPlatform(gpus_per_node=4, gpu_memory_gib=24, max_replicas=4, idle_seconds=900)
    big = serving.RunExport(run="big", kind="full", final="s3://b/runs/big/final", weights_bytes=16 * 10**9,
                            config={"num_attention_heads": 28})
    config = serving.full_model_config(big, platform)
    assert config["engine_kwargs"]["tensor_parallel_size"] == 2  # 16 GB > 60 % of a 24 GiB L4 (15.5 GB)
    assert config["deployment_config"]["autoscaling_config"]["max_replicas"] == 2  # 4 GPUs / 2 a replica
    fulls = [serving.RunExport(run=f"m{i}", kind="full", final=f"s3://b/runs/m{i}/final", weights_bytes=10**9) for i in range(5)]
    with pytest.raises(serving.ServingProblems, match="5 models need 5 GPUs at once when the service starts"):
        serving.serve_config(fulls, bucket="b", service="s", platform=platform)
