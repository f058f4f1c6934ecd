"""``ray-train-eks serve``, ``unserve`` and ``serve --list``: finished runs behind an OpenAI-compatible
endpoint on the platform's cluster, as a RayService running Ray Serve LLM
(ray_train_eks/workload/serving.py builds it; ray_train_eks/handlers/serving.py reads, checks and
stages the runs and writes what it serves).

    ray-train-eks serve dolly-full                       # a full fine-tune, as model "dolly-full"
    ray-train-eks serve lora-a lora-b lora-c --name chat  # three LoRA runs of one base, loaded on demand
    ray-train-eks serve lora-a --name chat               # again: chat serves lora-a alone now (in place)
    ray-train-eks serve --list
    ray-train-eks unserve chat

Every run is read and checked before anything is made (it exists, has finished, left a model in
``final/``; adapters of one base and chat template, of a rank, format and bias vLLM serves); the
service's name is checked as KubeRay would. Serving again under a name changes what it serves in
place (no second cluster). With ``--dry-run`` it prints the objects (GitOps) and changes nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import secrets
import sys
import time
import zipfile
from pathlib import Path

from ray_train_eks.cli.admission import rayjobs, ended, state_of
from ray_train_eks.cli.job_submission import send_policy
from ray_train_eks.cli.kube import Cluster, KubeError
from ray_train_eks.cli.platform import CliError, connect, default_platform_spec, platform, s3_client
from ray_train_eks.handlers import serving as runs_serving
from ray_train_eks.instances import INSTANCE_TYPES
from ray_train_eks.workload import bearer_ingress
from ray_train_eks.workload.serving import (CLUSTER_CONFIG_ANNOTATION, SERVICE_LABEL, operator_problems,
                                            service_objects, service_problems, serving_head_room_problem)
from ray_train_eks.workload.spec import RayWorkloadSpec, spec_from_settings

#: Minutes a first replica takes to be up, as said before the wait: a GPU node's start where the
#: capacity is Karpenter's (its launch and join: 2 to 5 minutes), the Serve LLM image's pull (several
#: minutes for a cold node), the weights' download and vLLM's start.
COLD_START_MINUTES = {"karpenter": 15, "nodegroup": 8}
#: How long ``serve`` waits for the service by default (``--wait``): KubeRay's initializing timeout.
WAIT_MINUTES = 45


def _service_name(args: argparse.Namespace) -> str:
    if args.name:
        return args.name
    if len(args.runs) == 1:
        return args.runs[0]
    raise CliError("serving several runs: give the service a name, e.g. serve " + " ".join(args.runs) + " --name chat")


def serving_platform(spec: RayWorkloadSpec, *, key_sha256: str | None = None) -> runs_serving.ServingPlatform:
    """What the application needs of the platform (handlers/serving.py ``ServingPlatform``)."""
    gpu = INSTANCE_TYPES[spec.gpu_instance_type]
    return runs_serving.ServingPlatform(
        gpus_per_node=spec.worker_gpus, gpu_memory_gib=gpu.gpu_memory_gib,
        max_replicas=spec.serving_gpu_nodes * spec.worker_gpus, idle_seconds=spec.serving_idle_seconds, key_sha256=key_sha256,
        ingress_class=f"{bearer_ingress.PACKAGE}.ingress:{bearer_ingress.CLASS}" if key_sha256 else None)


def ingress_package() -> bytes:
    """The bearer-key ingress (workload/bearer_ingress.py) as the zip ``runtime_env.py_modules`` takes
    from S3: Ray unpacks it without its one top-level folder (ray/_private/runtime_env/packaging.py,
    ``remove_top_level_directory=True`` for a remote URI) and puts the rest on the path, so the package
    ``ray_train_eks_serving`` (its module ``ingress``) sits in a folder of its own."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, text in (("__init__.py", ""), ("ingress.py", Path(bearer_ingress.__file__).read_text())):
            info = zipfile.ZipInfo(f"modules/{bearer_ingress.PACKAGE}/{name}", date_time=(2026, 1, 1, 0, 0, 0))
            archive.writestr(info, text)
    return buffer.getvalue()


def _with_ingress(config: dict, uri: str) -> dict:
    config["applications"][0]["runtime_env"] = {"py_modules": [uri]}
    return config


def _platform(args: argparse.Namespace) -> tuple[RayWorkloadSpec, str, Cluster | None]:
    """The platform's spec, its bucket, and the cluster (None for a dry run without one)."""
    if args.dry_run and not (args.kubeconfig or args.context):
        spec = spec_from_settings(Path(args.settings).read_text()) if args.settings else default_platform_spec()
        if not args.bucket:
            raise CliError("--dry-run without a cluster reads the runs from the training bucket: give --bucket (the stack's "
                           "BucketName output), or --kubeconfig to read the platform's settings")
        return spec, args.bucket, None
    cluster = connect(args)
    spec, settings = platform(cluster, args.namespace)
    return spec, settings["bucket"], cluster


def _yaml(document, *, many: bool = False) -> str:
    """YAML with multi-line strings (serveConfigV2, a chat template) as literal blocks, for a reader."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    Dumper.add_representer(str, lambda dumper, text: dumper.represent_scalar(
        "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None))
    return (yaml.dump_all if many else yaml.dump)(document, Dumper=Dumper, sort_keys=False)


def build_service(args: argparse.Namespace, spec: RayWorkloadSpec, bucket: str, s3) -> tuple[list, list[dict], str | None]:
    """The runs read and checked, and the service's objects; with ``--internal-lb`` a new bearer key
    (returned, to print once). Every problem at once; nothing is changed."""
    name = _service_name(args)
    problems = service_problems(spec, name)
    if problems:
        raise CliError("the service cannot run on this platform:\n" + "\n".join(f"  - {p}" for p in problems))
    key = secrets.token_urlsafe(32) if args.internal_lb else None
    served = serving_platform(spec, key_sha256=hashlib.sha256(key.encode()).hexdigest() if key else None)
    try:
        exports, config = runs_serving.prepare(s3, bucket, name, list(args.runs), served)
    except runs_serving.ServingProblems as error:
        raise CliError(f"cannot serve {' '.join(args.runs)}:\n" + "\n".join(f"  - {p}" for p in error.problems)) from None
    if key:
        digest = hashlib.sha256(ingress_package()).hexdigest()[:12]
        config = _with_ingress(config, f"s3://{bucket}/{runs_serving.SERVE_PREFIX}/{name}/code/ingress-{digest}.zip")
    objects = service_objects(spec, name, _yaml(config), load_balancer=args.internal_lb)
    refused = operator_problems(objects[-1])
    if refused:  # what KubeRay would set ValidationFailed for, once created
        raise CliError("KubeRay would refuse the service:\n" + "\n".join(f"  - {p}" for p in refused))
    return exports, objects, key


# ------------------------------------------------------------------ sending it


def _get_service(cluster: Cluster, namespace: str, name: str) -> dict | None:
    return cluster.ray_object(namespace, "rayservices", name)


def send_service(cluster: Cluster, objects: list[dict]) -> tuple[dict, bool, bool]:
    """Create the service's objects, or change a running one in place: its NetworkPolicies (owned by
    the RayService, deleted with it), then the RayService (a replace that keeps its status). Returns
    the RayService, whether it was there, and whether its cluster's spec changed (KubeRay then builds
    a second cluster)."""
    *policies, service = objects
    namespace, name = service["metadata"]["namespace"], service["metadata"]["name"]
    existing = _get_service(cluster, namespace, name)
    if existing is not None:
        _check_changeable(existing, service)
    for policy in policies:
        send_policy(cluster, policy, existing)
    if existing is None:
        created = cluster.request("CustomObjectsApi", "create_namespaced_custom_object", "ray.io", "v1", namespace,
                                  "rayservices", service)
        for policy in policies:  # owned by the service now: deleted with it
            send_policy(cluster, policy, created)
        return created, False, False
    # The stored object's finalizers go back with it (KubeRay's own: the operator would add it again).
    body = {**service, "metadata": {**service["metadata"], "resourceVersion": existing["metadata"]["resourceVersion"],
                                    **({"finalizers": existing["metadata"]["finalizers"]}
                                       if existing["metadata"].get("finalizers") else {})}}
    replaced = cluster.request("CustomObjectsApi", "replace_namespaced_custom_object", "ray.io", "v1", namespace,
                               "rayservices", name, body)
    digest = (existing["metadata"].get("annotations") or {}).get(CLUSTER_CONFIG_ANNOTATION)
    return replaced, True, digest != service["metadata"]["annotations"][CLUSTER_CONFIG_ANNOTATION]


def _check_changeable(existing: dict, service: dict) -> None:
    """What a serve again cannot change in place, refused with the way out: a service being deleted;
    one KubeRay gave up on (its initializing timeout: KubeRay only cleans it up from then on,
    rayservice_controller.go ``isInitializingTimeout``); the internal load balancer turned on or off
    (KubeRay changes a serve Service only with a new cluster: rayservice_controller.go, "Only update the
    service if the RayCluster switches")."""
    name = service["metadata"]["name"]
    if existing["metadata"].get("deletionTimestamp"):
        raise CliError(f"service {name} is being deleted (unserve): serve again once it is gone "
                       f"(ray-train-eks serve --list shows it until then)")
    ready = next((c for c in (existing.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"), {})
    if ready.get("reason") == "InitializingTimeout":
        raise CliError(f"service {name} gave up starting (KubeRay's initializing timeout), and KubeRay does not start it "
                       f"again: ray-train-eks unserve {name}, then serve it again")
    if ("serveService" in existing["spec"]) != ("serveService" in service["spec"]):
        raise CliError(f"service {name} was made {'with' if 'serveService' in existing['spec'] else 'without'} "
                       f"--internal-lb, and KubeRay changes its Service only with a new cluster: ray-train-eks unserve "
                       f"{name}, then serve it again {'without' if 'serveService' in existing['spec'] else 'with'} it")


# ------------------------------------------------------------------ its state


def service_state(service: dict) -> tuple[str, str | None]:
    """(state, why) of a RayService from KubeRay v1.7.0's status (apis/ray/v1/rayservice_types.go):
    ``ready`` (Ready: its serve endpoints are up, its latest spec seen, its application running),
    ``failed`` (the initializing timeout passed, an application failed to deploy, or KubeRay refused
    the spec), ``deleting``, else ``starting`` (``updating`` while KubeRay has not yet applied a serve
    again: an older status says nothing of it)."""
    if service["metadata"].get("deletionTimestamp"):
        return "deleting", None
    status = service.get("status") or {}
    if status.get("observedGeneration", 0) < service["metadata"].get("generation", 0):
        return "updating", None
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), {})
    if ready.get("reason") in ("InitializingTimeout", "ValidationFailed"):
        return "failed", f"{ready['reason']}: {ready.get('message', '')}".strip()
    apps = [(app, found) for which in ("pendingServiceStatus", "activeServiceStatus")
            for app, found in ((status.get(which) or {}).get("applicationStatuses") or {}).items()]
    for app, found in apps:
        if found.get("status") in ("DEPLOY_FAILED", "UNHEALTHY"):
            return "failed", f"application {app} {found['status']}: {found.get('message', '')}".strip()
    if ready.get("status") == "True" and all(found.get("status") == "RUNNING" for _, found in apps):
        return "ready", None
    return ("updating" if ready.get("status") == "True" else "starting"), ready.get("message")


def service_pods(cluster: Cluster, namespace: str, name: str | None = None) -> list[dict]:
    """The pods of the services (of ``name``), by the label every service pod carries."""
    selector = f"{SERVICE_LABEL}={name}" if name else SERVICE_LABEL
    return cluster.request("CoreV1Api", "list_namespaced_pod", namespace, label_selector=selector).get("items") or []


def gpu_workers(pods: list[dict]) -> list[dict]:
    """The GPU worker pods (each holds a GPU node) that are not gone."""
    return [pod for pod in pods if (pod["metadata"].get("labels") or {}).get("ray.io/node-type") == "worker"
            and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")]


def _cost(spec: RayWorkloadSpec, nodes: int) -> str:
    gpu = INSTANCE_TYPES.get(spec.gpu_instance_type)
    return f"{gpu.on_demand_usd_per_hour * nodes:.2f} USD/hour" if gpu else "?"


def wait_for(cluster: Cluster, spec: RayWorkloadSpec, name: str, minutes: float) -> str:
    """Follow the service until it is ready or failed, saying each change (its state, a GPU worker
    waiting for a node); the state it reached (``starting`` when the wait ran out)."""
    said, deadline, state = set(), time.monotonic() + minutes * 60, "starting"
    while time.monotonic() < deadline:
        service = _get_service(cluster, spec.namespace, name)
        if service is None:
            return "deleted"
        state, why = service_state(service)
        waiting = [p for p in gpu_workers(service_pods(cluster, spec.namespace, name))
                   if (p.get("status") or {}).get("phase") == "Pending"]
        for line in ([f"  {state}" + (f": {why}" if why else "")] + ([f"  a GPU worker waits for a node "
                     f"({spec.gpu_instance_type})"] if waiting else [])):
            if line not in said:
                said.add(line)
                print(line, flush=True)
        if state in ("ready", "failed", "deleting"):
            return state
        for _ in cluster.watch("CustomObjectsApi", "list_namespaced_custom_object", "ray.io", "v1", spec.namespace,
                               "rayservices", field_selector=f"metadata.name={name}",
                               resource_version=service["metadata"]["resourceVersion"],
                               timeout_s=min(30.0, max(1.0, deadline - time.monotonic()))):
            break  # a change: read it again
    return state


def gpu_note(cluster: Cluster, spec: RayWorkloadSpec) -> str:
    """What the service's head and replicas wait for, or take from training, on this platform."""
    head = serving_head_room_problem(spec)
    return (f"{head}; " if head else "") + _replica_note(cluster, spec)


def _replica_note(cluster: Cluster, spec: RayWorkloadSpec) -> str:
    if spec.gpu_capacity == "karpenter":
        return (f"its GPU nodes come from serving's own NodePool (at most {spec.serving_gpu_nodes}), apart from training's: "
                "neither waits for the other")
    busy = [job for job in rayjobs(cluster, spec.namespace) if not ended(job)]
    note = (f"it takes up to {spec.serving_gpu_nodes} of the {spec.gpu_node_count} GPU nodes while a replica runs; a "
            f"training job that needs them waits until serving goes to zero ({spec.serving_idle_seconds // 60} min without a "
            "request) or is unserved")
    if busy:
        note += (f"; now {', '.join(j['metadata']['name'] + ' (' + state_of(j) + ')' for j in busy)} holds the GPU nodes: "
                 "the first replica waits until it ends")
    return note


# ------------------------------------------------------------------ the commands


def serve(args: argparse.Namespace) -> int:
    """``serve RUN [RUN ...]``, or ``serve --list``."""
    if args.list:
        return list_services(args)
    if not args.runs:
        raise CliError("name the runs to serve (serve RUN [RUN ...] [--name NAME]), or serve --list")
    spec, bucket, cluster = _platform(args)
    s3 = s3_client(args)
    exports, objects, key = build_service(args, spec, bucket, s3)
    name = objects[-1]["metadata"]["name"]
    if args.dry_run:
        print(_yaml(objects, many=True), end="")
        print(f"ray-train-eks serve --dry-run: nothing was made; the adapters{' and the ingress package' if key else ''} are "
              f"staged in s3://{bucket}/{runs_serving.SERVE_PREFIX}/{name}/ by a serve without --dry-run"
              + (f"; the bearer key whose SHA-256 the YAML holds: {key}" if key else ""), file=sys.stderr)
        return 0
    runs_serving.stage(s3, bucket, name, exports)
    if key:
        uri = yaml_config(objects[-1])["applications"][0]["runtime_env"]["py_modules"][0]
        s3.put_object(Bucket=bucket, Key=uri.removeprefix(f"s3://{bucket}/"), Body=ingress_package())
    service, again, new_cluster = send_service(cluster, objects)
    models = runs_serving.served_models(exports)
    if again and not new_cluster and service["metadata"].get("generation") == (service.get("status") or {}).get("observedGeneration"):
        staged = [export.run for export in exports if export.kind == "lora"]
        print(f"service {name}: the same configuration; the adapters staged now: {', '.join(staged) or 'none'} (what "
              f"/v1/models lists; a replica that loaded another keeps it until it restarts)\n  {gpu_note(cluster, spec)}")
        return 0
    verb = "updated in place" if again and not new_cluster else "updated: its cluster's spec changed, so KubeRay starts a " \
        "second cluster and moves to it once it serves (its first replica needs GPUs beside the old one's)" if again else "created"
    print(f"service {name} {verb}: RayService {spec.namespace}/{name}, models {', '.join(models)}\n  {gpu_note(cluster, spec)}")
    if key:
        print(f"  bearer key (shown once; the service keeps its SHA-256 only): {key}")
    if args.no_wait:
        print(f"  follow it: ray-train-eks serve --list   |   reach it: ray-train-eks endpoint {name}")
        return 0
    if not again:
        print(f"  starting: a GPU node, the Serve LLM image and the weights, about "
              f"{COLD_START_MINUTES.get(spec.gpu_capacity, 10)} minutes for the first replica", flush=True)
    state = wait_for(cluster, spec, name, args.wait)
    if state == "ready":
        print(f"service {name} is ready: ray-train-eks endpoint {name} (an OpenAI API on localhost), or ray-train-eks chat "
              f"{name} \"Hello\"")
        return 0
    if state == "failed":
        raise CliError(f"service {name} failed (ray-train-eks serve --list; its head's log: kubectl -n {spec.namespace} logs "
                       f"-l {SERVICE_LABEL}={name},ray.io/node-type=head): ray-train-eks unserve {name} frees what it holds")
    print(f"service {name} is not ready after {args.wait:g} min ({state}); ray-train-eks serve --list follows it")
    return 0


def yaml_config(service: dict) -> dict:
    """A RayService's serveConfigV2 as a dict."""
    import yaml

    return yaml.safe_load(service["spec"]["serveConfigV2"]) or {}


def unserve(args: argparse.Namespace) -> int:
    """Delete the service: KubeRay deletes its clusters (its GPU nodes go when their pods are gone),
    the garbage collector its NetworkPolicies; its staged adapters are removed (the runs'
    own folders stay)."""
    cluster = connect(args)
    spec, settings = platform(cluster, args.namespace)
    service = _get_service(cluster, args.namespace, args.name)
    if service is None:
        raise CliError(f"no service {args.name} in namespace {args.namespace} (ray-train-eks serve --list shows them)")
    try:
        cluster.request("CustomObjectsApi", "delete_namespaced_custom_object", "ray.io", "v1", args.namespace, "rayservices",
                        args.name, body={"propagationPolicy": "Background"})
    except KubeError as error:
        if error.code != 404:
            raise
    removed = runs_serving.unstage(s3_client(args), settings["bucket"], args.name)
    held = len(gpu_workers(service_pods(cluster, args.namespace, args.name)))
    print(f"unserved {args.name}: RayService {args.namespace}/{args.name} deleted"
          + (f"; its {held} GPU node(s) are freed as their pods go" if held else "; it held no GPU node")
          + (f"; {removed} staged object(s) removed from s3://{settings['bucket']}/{runs_serving.SERVE_PREFIX}/{args.name}/"
             if removed else ""))
    return 0


def service_row(cluster: Cluster, spec: RayWorkloadSpec, service: dict) -> dict:
    """One service as ``serve --list`` and ``status`` show it."""
    name = service["metadata"]["name"]
    state, why = service_state(service)
    workers = gpu_workers(service_pods(cluster, spec.namespace, name))
    running = [p for p in workers if (p.get("status") or {}).get("phase") == "Running"]
    configs = (yaml_config(service).get("applications") or [{}])[0].get("args", {}).get("llm_configs") or []
    models = [c["model_loading_config"]["model_id"] + (" (+ adapters)" if c.get("lora_config") else "") for c in configs]
    return {"name": name, "state": state, "why": why, "gpu_nodes": len(running), "waiting": len(workers) - len(running),
            "models": models, "cost": _cost(spec, len(running))}


def list_services(args: argparse.Namespace) -> int:
    cluster = connect(args)
    spec, _ = platform(cluster, args.namespace)
    listed = cluster.request("CustomObjectsApi", "list_namespaced_custom_object", "ray.io", "v1", args.namespace,
                             "rayservices").get("items") or []
    rows = [("SERVICE", "STATE", "GPU NODES", "COST NOW", "MODELS")]
    notes = []
    for service in sorted(listed, key=lambda s: s["metadata"]["name"]):
        row = service_row(cluster, spec, service)
        nodes = f"{row['gpu_nodes']}" + (f" (+{row['waiting']} waiting)" if row["waiting"] else "")
        rows.append((row["name"], row["state"], nodes, row["cost"], ", ".join(row["models"])))
        if row["why"]:
            notes.append(f"  {row['name']}: {row['why']}")
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(r, widths)).rstrip())
    print("\n".join(notes) if notes else "", end="\n" if notes else "")
    if len(rows) == 1:
        print("(no services: ray-train-eks serve RUN)")
    return 0


def print_service_status(cluster: Cluster, spec: RayWorkloadSpec, name: str, bucket: str, s3) -> bool:
    """``status NAME`` of a service: its state and why, its GPU nodes and their cost now, its models
    and the adapters staged (what ``/v1/models`` lists), how to reach it. False: no such service."""
    service = _get_service(cluster, spec.namespace, name)
    if service is None:
        return False
    row = service_row(cluster, spec, service)
    print(f"service {name}: {row['state']}" + (f" ({row['why']})" if row["why"] else "")
          + f", RayService {spec.namespace}/{name}")
    print(f"  GPU nodes: {row['gpu_nodes']}" + (f" (+{row['waiting']} waiting for a node)" if row["waiting"] else "")
          + f", {row['cost']} now; none after {spec.serving_idle_seconds // 60} min without a request")
    adapters = sorted({key.split("/")[0] for key in runs_serving.listing(s3, bucket, f"{runs_serving.SERVE_PREFIX}/{name}/lora/")})
    print(f"  models: {', '.join(row['models'])}" + (f"; adapters: {', '.join(adapters)}" if adapters else ""))
    print(f"  reach it: ray-train-eks endpoint {name}   |   ray-train-eks chat {name} \"Hello\"")
    return True
