"""What a service serves, read from the runs' records in the training bucket, checked, staged, and
written as Ray Serve LLM's application (the ``serveConfigV2`` of the RayService).

Shared by ``ray-train-eks serve`` (ray_train_eks/cli/serve.py) and the ``RayServing`` construct's
deploy-time function (``on_event``): this folder is that function's code, so this module needs
boto3 alone (no PyYAML: the configuration is a dict, which the function writes as JSON, a YAML
document KubeRay reads).

How a run is served (Ray 2.58's ``ray.serve.llm:build_openai_app``, vLLM 0.26):

- **A full fine-tune** is its own model: ``model_id`` the run's name, ``model_source`` its
  ``s3://<bucket>/runs/<run>/final`` (Ray downloads every object under it with boto3 to the
  replica's Hugging Face cache: ray/llm/_internal/common/utils/cloud_utils.py; the folder holds the
  model alone). vLLM reads that folder's ``generation_config.json`` and tokenizer, which the
  export made stop at the end of a turn (training/modeling/export.py ``stopping_generation_config``).
- **LoRA runs** are adapters on their one base: the base is served at the commit they trained on
  (``revision``), each adapter staged under ``s3://<bucket>/serve/<service>/lora/<run>/`` (only the
  files vLLM reads), which is the ``dynamic_lora_loading_path``: Ray lists every folder under it in
  ``/v1/models`` and loads ``<path>/<run>`` on the first request for ``"<base>:<run>"``
  (ray/llm/_internal/serve/utils/lora_serve_utils.py). vLLM reads the *base's* generation config
  and chat template, never an adapter's (vllm/v1/engine/input_processor.py), so the service passes
  the runs' own: both are staged as a package (``serve/<service>/engine-<digest>.zip``) that Ray
  unpacks as the replica's working directory (its ``runtime_env.working_dir``:
  ray/_private/runtime_env/packaging.py ``download_and_unpack_package``), named to vLLM by their
  paths there (``generation_config: .``, ``chat_template: chat_template.jinja``). A new package is a
  new name, so the replicas that read it are new ones: no pod keeps an older file.
"""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
from dataclasses import dataclass, field

#: Where the runs are (the pods' storage path, ``s3://<bucket>/runs``) and where services stage.
RUNS_PREFIX, SERVE_PREFIX = "runs", "serve"
#: What vLLM reads of a PEFT adapter (vllm/lora/peft_helper.py, lora_model.py): what is staged.
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
#: The ranks vLLM 0.26 takes as ``max_lora_rank`` (vllm/config/lora.py ``MaxLoRARanks``); an adapter
#: of rank r needs a ``max_lora_rank`` of at least r (``PEFTHelper.validate_legal``).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: Adapters a replica keeps loaded (Ray's ``max_num_adapters_per_replica`` default, and vLLM's CPU cache).
ADAPTERS_PER_REPLICA = 16
#: The share of a GPU's memory the weights may take (vLLM's ``gpu_memory_utilization`` is 0.9; the
#: rest of it holds the KV cache and activations).
WEIGHTS_SHARE = 0.6
#: The application's name in serveConfigV2 and its route.
APPLICATION = "llm"
IMPORT_PATH = "ray.serve.llm:build_openai_app"
#: The custom resource the head gives the Serve ingress (the OpenAI router): it runs there and never
#: keeps a GPU node up (a replica of it on a GPU worker would).
INGRESS_RESOURCE = "serve-ingress"


class ServingProblems(ValueError):
    """Every reason the runs cannot be served, one sentence each with its fix."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("\n".join(problems))


@dataclass(frozen=True)
class RunExport:
    """What a finished run left in ``runs/<run>/final/``, as serving needs it."""

    run: str
    #: ``full`` (a Hugging Face model) or ``lora`` (a PEFT adapter).
    kind: str
    final: str
    #: LoRA: the base (a Hub id, or an ``s3://`` folder) and its commit.
    base: str | None = None
    revision: str | None = None
    adapter: dict = field(default_factory=dict, compare=False)
    chat_template: str | None = None
    #: ``generation_config.json`` of the export (where a turn ends).
    generation: dict | None = None
    #: The bytes of the model's weights (full: final/'s safetensors; LoRA: the base's, where the
    #: run's record says), for the tensor-parallel size; None where unknown.
    weights_bytes: int | None = None
    #: A full model's ``config.json`` (its attention heads bound the tensor-parallel size).
    config: dict | None = None


# ------------------------------------------------------------------ reading a run


def _read(s3, bucket: str, key: str) -> str | None:
    try:
        return s3.get_object(Bucket=bucket, Key=key)["Body"].read().decode()
    except s3.exceptions.NoSuchKey:
        return None


def listing(s3, bucket: str, prefix: str) -> dict[str, int]:
    """Every object under ``prefix``: name relative to it -> size."""
    found: dict[str, int] = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for item in page.get("Contents") or []:
            found[item["Key"][len(prefix):]] = item["Size"]
    return found


def _json(text: str | None) -> dict | None:
    try:
        return json.loads(text) if text else None
    except ValueError:
        return None


def chat_template(tokenizer_config: dict | None, template_file: str | None) -> str | None:
    """The chat template a tokenizer folder holds: ``chat_template.jinja`` (transformers 5 writes it
    there) or ``tokenizer_config.json``'s ``chat_template``."""
    if template_file:
        return template_file
    template = (tokenizer_config or {}).get("chat_template")
    return template if isinstance(template, str) else None


def read_run(s3, bucket: str, run: str) -> RunExport:
    """Run ``run``'s export, or :class:`ServingProblems` saying why it cannot be served: it does not
    exist, has not finished, or left no model in ``final/``. Only the objects its listing holds are
    read (S3 answers a read of a missing object 403, not 404, to a reader whose ``s3:ListBucket`` is
    held to prefixes, as the construct's function's is)."""
    folder = f"{RUNS_PREFIX}/{run}"
    files = listing(s3, bucket, f"{folder}/")
    final = f"s3://{bucket}/{folder}/final"

    def read(name: str):
        return _json(_read(s3, bucket, f"{folder}/{name}")) if name in files else None

    if not files:
        raise ServingProblems([f"no run {run} in s3://{bucket}/{RUNS_PREFIX}/: ray-train-eks list shows the runs"])
    summary = read("summary.json")
    if summary is None:
        raise ServingProblems([f"run {run} has not finished (no s3://{bucket}/{folder}/summary.json yet): serve it once it "
                               f"has (ray-train-eks status {run})"])
    exported = {name.removeprefix("final/"): size for name, size in files.items() if name.startswith("final/")}
    if not summary.get("final_model") or not exported:
        raise ServingProblems([f"run {run} ended without a final model (nothing in {final}/): it stopped or failed before "
                               f"its export; ray-train-eks status {run} says why, and submit --resume {run} finishes it"])
    about, generation = read("run.json") or {}, read("final/generation_config.json")
    template = chat_template(read("final/tokenizer_config.json"),
                             _read(s3, bucket, f"{folder}/final/chat_template.jinja") if "chat_template.jinja" in exported else None)
    if "adapter_config.json" in exported:
        missing = [name for name in (*ADAPTER_FILES, "generation_config.json") if name not in exported]
        if missing:
            raise ServingProblems([f"run {run}'s {final}/ lacks {', '.join(missing)} (an export by an older ray-train-eks, "
                                   f"or cut short): submit --resume {run} exports it again"])
        parameters = about.get("parameters")
        adapter = read("final/adapter_config.json") or {}
        return RunExport(run=run, kind="lora", final=final, base=adapter.get("base_model_name_or_path"),
                         revision=adapter.get("revision") or about.get("model_revision"), adapter=adapter,
                         chat_template=template, generation=generation,
                         weights_bytes=2 * parameters if isinstance(parameters, int) else None)
    if "config.json" in exported:
        weights = sum(size for name, size in exported.items() if name.endswith(".safetensors"))
        return RunExport(run=run, kind="full", final=final, chat_template=template, generation=generation,
                         weights_bytes=weights or None, config=read("final/config.json"))
    raise ServingProblems([f"run {run}'s {final}/ holds neither a model (config.json) nor a LoRA adapter "
                           f"(adapter_config.json): {', '.join(sorted(exported)[:5])}"])


def model_id(base: str) -> str:
    """The id clients ask the base by: its Hub id, or an ``s3://`` folder's last part. Ray splits
    ``<base>:<adapter>`` at the first colon (ray/llm/_internal/common/utils/lora_utils.py
    ``get_base_model_id``), so an id with one (``s3://...``) would name no model."""
    return base.rstrip("/").rsplit("/", 1)[-1] if base.startswith("s3://") else base


# ------------------------------------------------------------------ the checks


def adapter_problems(export: RunExport) -> list[str]:
    """What vLLM 0.26 refuses of a PEFT adapter, at its first request rather than at deploy
    (vllm/lora/peft_helper.py ``_validate_features``, ``validate_legal``): said before anything is made."""
    config, run = export.adapter, export.run
    problems = []
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1 or rank > VLLM_LORA_RANKS[-1]:
        problems.append(f"run {run}: LoRA rank {rank!r} is not one vLLM serves (1 to {VLLM_LORA_RANKS[-1]}); train it with "
                        f"--lora-rank 8 to {VLLM_LORA_RANKS[-1]}")
    if config.get("use_dora"):
        problems.append(f"run {run} is a DoRA adapter, which vLLM does not serve; train it as plain LoRA")
    if config.get("modules_to_save"):
        problems.append(f"run {run}'s adapter saves whole modules too (modules_to_save={config['modules_to_save']!r}), "
                        "which vLLM does not serve; train it without them, or serve its --merge-lora model")
    if config.get("bias", "none") != "none":
        problems.append(f"run {run}'s adapter trains biases (bias={config['bias']!r}), which vLLM does not serve; train "
                        "it with bias none")
    if not export.base or export.base.startswith("/") or export.base.startswith("tiny:"):
        problems.append(f"run {run}'s base {export.base!r} is not one the cluster can load (a Hub id or an s3:// folder): "
                        "serve runs trained on the platform")
    return problems


def served_problems(exports: list[RunExport]) -> list[str]:
    """Why these runs cannot be served together: each adapter's own problems, adapters of different
    bases or commits (one service serves its adapters on one base), chat templates that differ
    (vLLM's is server-wide)."""
    problems = [problem for export in exports if export.kind == "lora" for problem in adapter_problems(export)]
    adapters = [export for export in exports if export.kind == "lora"]
    bases = sorted({(export.base, export.revision) for export in adapters}, key=str)
    if len(bases) > 1:
        problems.append("the adapters are of different bases, and a service serves its adapters on one: " + "; ".join(
            f"{export.run} on {export.base}@{(export.revision or 'latest')[:12]}" for export in adapters)
            + ". Serve each base's runs under a name of its own (serve ... --name NAME)")
    templates = {export.chat_template for export in adapters}
    if len(templates) > 1:
        problems.append("the adapters were trained with different chat templates, and vLLM applies one to every adapter of "
                        f"a base: serve {', '.join(e.run for e in adapters)} under names of their own")
    return problems


def tensor_parallel_size(export: RunExport, *, gpu_memory_gib: float, gpus_per_node: int) -> int:
    """The fewest GPUs of one node (a power of two that divides the attention heads, where known)
    whose memory holds the weights within :data:`WEIGHTS_SHARE`; 1 where the size is not known."""
    if export.weights_bytes is None:
        return 1
    heads = (export.config or {}).get("num_attention_heads")
    size = 1
    while size <= gpus_per_node:
        if export.weights_bytes <= WEIGHTS_SHARE * gpu_memory_gib * 2**30 * size and (not heads or heads % size == 0):
            return size
        size *= 2
    raise ServingProblems([f"run {export.run}: its {export.weights_bytes / 1e9:.1f} GB of weights need more than the "
                           f"{gpus_per_node} x {gpu_memory_gib} GiB GPUs of one node; serve it on a GPU type with more "
                           "memory a node (-c gpuInstanceType)"])


# ------------------------------------------------------------------ staging


def lora_path(bucket: str, service: str) -> str:
    """The service's ``dynamic_lora_loading_path``: one folder an adapter."""
    return f"s3://{bucket}/{SERVE_PREFIX}/{service}/lora"


def stage(s3, bucket: str, service: str, exports: list[RunExport]) -> list[str]:
    """The adapters of ``exports`` copied (in the bucket, server side) to the service's LoRA path,
    and every other folder there removed, so that ``/v1/models`` lists what is served and nothing
    else; their engine package uploaded. Returns the staged runs."""
    stage_engine(s3, bucket, service, engine_package(exports))
    prefix = f"{SERVE_PREFIX}/{service}/lora/"
    adapters = [export for export in exports if export.kind == "lora"]
    for export in adapters:
        source = export.final.removeprefix(f"s3://{bucket}/")
        for name in ADAPTER_FILES:
            s3.copy({"Bucket": bucket, "Key": f"{source}/{name}"}, bucket, f"{prefix}{export.run}/{name}")
    served = {export.run for export in adapters}
    stale = [key for key in listing(s3, bucket, prefix) if key.split("/")[0] not in served]
    for start in range(0, len(stale), 1000):
        s3.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": prefix + key} for key in stale[start:start + 1000]]})
    return sorted(served)


#: The files of the adapters' engine package, as vLLM reads them from the replica's working directory.
GENERATION_FILE, TEMPLATE_FILE = "generation_config.json", "chat_template.jinja"


def engine_package(exports: list[RunExport]) -> bytes | None:
    """The adapters' generation config and chat template as the zip ``runtime_env.working_dir`` takes
    (one top-level folder, which Ray's unpacking removes); None without adapters."""
    adapters = [export for export in exports if export.kind == "lora"]
    if not adapters:
        return None
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, text in ((GENERATION_FILE, json.dumps(adapters[0].generation or {}, indent=2, sort_keys=True)),
                           (TEMPLATE_FILE, adapters[0].chat_template)):
            if text is not None:
                info = zipfile.ZipInfo(f"engine/{name}", date_time=(2026, 1, 1, 0, 0, 0))  # the same bytes, the same digest
                archive.writestr(info, text)
    return buffer.getvalue()


def engine_uri(bucket: str, service: str, package: bytes) -> str:
    """Where a service's engine package is staged, named by its digest."""
    return f"s3://{bucket}/{SERVE_PREFIX}/{service}/engine-{hashlib.sha256(package).hexdigest()[:16]}.zip"


def stage_engine(s3, bucket: str, service: str, package: bytes | None) -> None:
    """Upload the engine package. The service's earlier ones stay until ``unstage``: the running
    configuration names one until KubeRay has applied the new, and a replica started from zero
    meanwhile unpacks it (a few kilobytes each)."""
    if package:
        s3.put_object(Bucket=bucket, Key=engine_uri(bucket, service, package).removeprefix(f"s3://{bucket}/"), Body=package)


def unstage(s3, bucket: str, service: str) -> int:
    """Remove everything staged for ``service``; the objects removed."""
    prefix = f"{SERVE_PREFIX}/{service}/"
    keys = list(listing(s3, bucket, prefix))
    for start in range(0, len(keys), 1000):
        s3.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": prefix + key} for key in keys[start:start + 1000]]})
    return len(keys)


# ------------------------------------------------------------------ the application


@dataclass(frozen=True, kw_only=True)
class ServingPlatform:
    """What the application needs to know of the nodes and the service: GPUs a node and their
    memory, the replicas a model may have, the idle delay before a replica (and its GPU node) goes,
    and the SHA-256 of the bearer key the ingress checks (None: no key)."""

    gpus_per_node: int
    gpu_memory_gib: float
    max_replicas: int
    idle_seconds: int
    key_sha256: str | None = None
    ingress_class: str | None = None


def _autoscaling(platform: ServingPlatform, tensor_parallel: int) -> dict:
    """From zero and back to it: one replica at the first deploy (a model that cannot load fails the
    deploy, and KubeRay's initializing timeout frees its GPUs), none after ``idle_seconds`` without a
    request (Serve's ``downscale_to_zero_delay_s``; the Ray autoscaler then removes the idle GPU node),
    at most as many as the serving GPUs hold of ``tensor_parallel`` GPUs each."""
    return {"min_replicas": 0, "initial_replicas": 1, "max_replicas": max(1, platform.max_replicas // tensor_parallel),
            "downscale_to_zero_delay_s": platform.idle_seconds, "target_ongoing_requests": 16}


def full_model_config(export: RunExport, platform: ServingPlatform) -> dict:
    """The ``LLMConfig`` of a full fine-tune: its own model, from its ``final/``."""
    tensor_parallel = tensor_parallel_size(export, gpu_memory_gib=platform.gpu_memory_gib, gpus_per_node=platform.gpus_per_node)
    return {
        "model_loading_config": {"model_id": export.run, "model_source": export.final},
        "engine_kwargs": {"tensor_parallel_size": tensor_parallel},
        "deployment_config": {"autoscaling_config": _autoscaling(platform, tensor_parallel)},
    }


def adapters_config(adapters: list[RunExport], *, bucket: str, service: str, platform: ServingPlatform) -> dict:
    """The ``LLMConfig`` of LoRA runs on their base: the base at their commit, LoRA on, the adapters
    loaded on demand from the service's LoRA path, the runs' chat template and generation config from
    the engine package (:func:`engine_package`), the replica's working directory."""
    first = adapters[0]
    rank = max(int(export.adapter.get("r") or 1) for export in adapters)
    tensor_parallel = tensor_parallel_size(first, gpu_memory_gib=platform.gpu_memory_gib, gpus_per_node=platform.gpus_per_node)
    engine: dict = {
        "tensor_parallel_size": tensor_parallel,
        "enable_lora": True,
        "max_lora_rank": next(r for r in VLLM_LORA_RANKS if r >= rank),
        # vLLM's max_loras is how many adapters one batch mixes (its default: 1).
        "max_loras": min(4, ADAPTERS_PER_REPLICA),
        "max_cpu_loras": ADAPTERS_PER_REPLICA,
        # vLLM stops where the served base's generation config says, never an adapter's: the runs',
        # in the working directory (the engine package).
        "generation_config": ".",
    }
    if first.revision and not first.base.startswith("s3://"):
        engine.update(revision=first.revision, tokenizer_revision=first.revision)
    if first.chat_template:
        engine["chat_template"] = TEMPLATE_FILE
    return {
        "model_loading_config": {"model_id": model_id(first.base), "model_source": first.base},
        "runtime_env": {"working_dir": engine_uri(bucket, service, engine_package(adapters))},
        "engine_kwargs": engine,
        "lora_config": {"dynamic_lora_loading_path": lora_path(bucket, service),
                        "max_num_adapters_per_replica": ADAPTERS_PER_REPLICA},
        "deployment_config": {"autoscaling_config": _autoscaling(platform, tensor_parallel)},
    }


def serve_config(exports: list[RunExport], *, bucket: str, service: str, platform: ServingPlatform) -> dict:
    """The RayService's ``serveConfigV2``: one application, Ray Serve LLM's OpenAI-compatible app,
    a model a full fine-tune and one base for the adapters; the ingress (the OpenAI router) on the
    head, one replica always, checking the bearer key where one is set."""
    adapters = [export for export in exports if export.kind == "lora"]
    configs = [full_model_config(export, platform) for export in exports if export.kind == "full"]
    if adapters:
        configs.append(adapters_config(adapters, bucket=bucket, service=service, platform=platform))
    first_start = sum(config["engine_kwargs"]["tensor_parallel_size"] for config in configs)
    if first_start > platform.max_replicas:  # each model starts one replica with the service
        raise ServingProblems([f"{len(configs)} models need {first_start} GPUs at once when the service starts (a replica "
                               f"each), more than serving's {platform.max_replicas} (servingGpuNodes x GPUs a node): serve "
                               "fewer full models under one name, or deploy with a larger -c servingGpuNodes"])
    args: dict = {
        "llm_configs": configs,
        "ingress_deployment_config": {
            "autoscaling_config": {"min_replicas": 1, "max_replicas": 1},
            "ray_actor_options": {"num_cpus": 1, "resources": {INGRESS_RESOURCE: 1}},
        },
    }
    if platform.key_sha256:
        args["ingress_cls_config"] = {"ingress_cls": platform.ingress_class,
                                      "ingress_extra_kwargs": {"key_sha256": platform.key_sha256}}
    return {
        # Every node with a replica runs a proxy: KubeRay's readiness probe of a RayService worker asks
        # its local proxy (ray-operator common/pod.go), and the head's serves the ingress.
        "proxy_location": "EveryNode",
        "http_options": {"host": "0.0.0.0", "port": 8000},
        "applications": [{"name": APPLICATION, "route_prefix": "/", "import_path": IMPORT_PATH, "args": args}],
    }


def served_models(exports: list[RunExport]) -> list[str]:
    """The model ids a client asks for: a full run's name, the adapters' base, each ``<base>:<run>``."""
    adapters = [export for export in exports if export.kind == "lora"]
    models = [export.run for export in exports if export.kind == "full"]
    if adapters:
        base = model_id(adapters[0].base)
        models += [base, *(f"{base}:{export.run}" for export in adapters)]
    return models


def prepare(s3, bucket: str, service: str, runs: list[str], platform: ServingPlatform) -> tuple[list[RunExport], dict]:
    """Read and check ``runs`` (every problem at once) and build the service's configuration; nothing is
    staged or changed (:func:`stage` does it, once the rest of the service is checked too)."""
    exports, problems = [], []
    for run in dict.fromkeys(runs):
        try:
            exports.append(read_run(s3, bucket, run))
        except ServingProblems as error:
            problems.extend(error.problems)
    problems += served_problems(exports)
    if problems:
        raise ServingProblems(problems)
    try:
        return exports, serve_config(exports, bucket=bucket, service=service, platform=platform)
    except ServingProblems:
        raise
    except (KeyError, StopIteration, TypeError) as error:  # a record of an unexpected shape
        raise ServingProblems([f"the runs' records are not what this ray-train-eks reads ({type(error).__name__}: "
                               f"{error})"]) from None


# ------------------------------------------------------------------ the construct's function


def on_event(event, context):
    """The ``RayServing`` construct's custom resource (properties ``Bucket``, ``Service``, and as JSON
    ``Runs`` and ``Platform``, a :class:`ServingPlatform`): on create and update, read and check the runs
    (a problem fails the deploy with its sentence), stage the adapters, and return the serve config
    and the adapters' generation config as JSON; on delete, remove what was staged (the runs' own
    folders are never touched)."""
    import boto3

    props = event["ResourceProperties"]
    s3 = boto3.client("s3")
    bucket, service = props["Bucket"], props["Service"]
    physical = f"{bucket}/{SERVE_PREFIX}/{service}"
    if event["RequestType"] == "Delete":
        unstage(s3, bucket, service)
        return {"PhysicalResourceId": event.get("PhysicalResourceId") or physical}
    platform = ServingPlatform(**json.loads(props["Platform"]))
    try:
        exports, config = prepare(s3, bucket, service, json.loads(props["Runs"]), platform)
    except ServingProblems as error:  # CloudFormation keeps 4 KB of a reason: the first problems, whole
        raise ServingProblems([problem[:1000] for problem in error.problems[:3]]) from None
    stage(s3, bucket, service, exports)
    # Inside the manifest's JSON the value is a string: given escaped for one (CloudFormation joins it in
    # as it is); a few hundred bytes, within a custom resource's 4 KB response.
    return {"PhysicalResourceId": physical,
            "Data": {"ServeConfigJsonEscaped": json.dumps(json.dumps(config, sort_keys=True))[1:-1],
                     "Models": ",".join(served_models(exports))}}
