"""``ray-train-eks``: fine-tunes on the deployed platform without CloudFormation.

    ray-train-eks submit --name dolly-lr1e5 -- --learning-rate 1e-5 --max-steps 200
    ray-train-eks submit --name dolly-lr1e5 --dry-run -- --learning-rate 1e-5   # the manifests; no cluster, no AWS
    ray-train-eks list
    ray-train-eks status dolly-lr1e5
    ray-train-eks logs dolly-lr1e5 -f
    ray-train-eks stop dolly-lr1e5

``cdk deploy`` builds the platform (and its first fine-tune); each ``submit`` is one more RayJob of
its own name, built by the same code that builds the deployed one (ray_train_eks/charts: the pod
templates, token authentication, the NetworkPolicies, the memory plan and the spec's checks, all
before anything is sent), with the platform's settings read from the cluster, where the stack wrote
them (the settings ConfigMap's ``workload``: charts/spec.py ``spec_settings``), never retyped. A
run's name is its training ``--run-name``: its checkpoints, metrics and final model are under
``s3://<bucket>/runs/<name>/``, and a run submitted again under the same name resumes from its last
checkpoint.

Credentials: the user's AWS identity (the stack's ``ClusterName`` output, ``eks:DescribeCluster``
and a token as ``aws eks get-token`` makes it: ray_train_eks/kube.py), or their kubeconfig
(``--kubeconfig``, ``--context``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from ray_train_eks.charts import RayWorkloadSpec, job_objects, spec_from_settings, workload_problems
from ray_train_eks.charts.code import (CODE_DIGEST_ANNOTATION, SETTINGS_CONFIGMAP, TRAINING_CODE_CONFIGMAP, code_config_maps,
                                      files_digest, package_files)
from ray_train_eks.instances import INSTANCE_TYPES
from ray_train_eks.kube import Connection, KubeError, from_eks, from_kubeconfig
from ray_train_eks.scheduling import RAY_NAMESPACE

#: The label that names a submitted job's run (its ``--run-name``), what ``list`` and ``stop`` find it by.
RUN_LABEL = "ray-train-eks/run"
#: A run's name: a DNS label short enough for the RayJob's name (the run, a dash and 8 hex digits)
#: and KubeRay's names derived from it (its RayCluster adds 6 characters, its pods more).
RUN_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,28}[a-z0-9])?$")
RAYJOBS = "/apis/ray.io/v1/namespaces/{namespace}/rayjobs"


class CliError(RuntimeError):
    """What went wrong, said to the user (no traceback)."""


# --------------------------------------------------------------------- the platform


def connect(args: argparse.Namespace) -> Connection:
    """The cluster, from the kubeconfig when one is named, else from the stack (the user's AWS identity)."""
    if args.kubeconfig or args.context:
        return from_kubeconfig(args.kubeconfig, args.context)
    import boto3

    session = boto3.Session(region_name=args.region)
    stack = session.client("cloudformation").describe_stacks(StackName=args.stack)["Stacks"][0]
    outputs = {o["OutputKey"]: o["OutputValue"] for o in stack.get("Outputs") or []}
    if "ClusterName" not in outputs:
        raise CliError(f"stack {args.stack} has no ClusterName output: is it a ray-train-eks stack? (--stack names it)")
    return from_eks(outputs["ClusterName"], session=session, admin_setting="-c adminRoleArn=<your role's ARN>")


def platform(connection: Connection, namespace: str) -> tuple[RayWorkloadSpec, dict]:
    """The deployed workload's spec and the settings ConfigMap's data (the bucket), from the cluster."""
    try:
        settings = connection.call("GET", f"/api/v1/namespaces/{namespace}/configmaps/{SETTINGS_CONFIGMAP}")
    except KubeError as error:
        if error.code == 404:
            raise CliError(f"no ConfigMap {SETTINGS_CONFIGMAP} in namespace {namespace}: deploy the stack first (make "
                           "deploy), or name the Ray namespace with --namespace") from None
        raise
    data = settings.get("data") or {}
    if "workload" not in data:
        raise CliError(f"ConfigMap {namespace}/{SETTINGS_CONFIGMAP} holds no workload settings: the stack was deployed "
                       "by an older ray-train-eks; deploy it again with this one (make deploy)")
    return spec_from_settings(data["workload"]), data


def default_platform_spec() -> RayWorkloadSpec:
    """What ``cdk deploy`` builds with no settings given (ray_train_eks/config.py; it imports the CDK,
    and so starts Node.js: only a dry run without a cluster needs it)."""
    import os

    os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "1")
    from ray_train_eks.config import PlatformConfig

    return PlatformConfig.from_context({}, environ={}).workload_spec()


def installed_training_code() -> dict[str, str]:
    """The training package this ray-train-eks installed (path -> content), as the stack ships it
    (constructs/ray_workload.py ``bundled_training_code``: found, not imported)."""
    import importlib.util

    found = importlib.util.find_spec("ray_train_eks.training_code")
    if found is None or not found.submodule_search_locations:
        raise CliError("ray_train_eks.training_code is not installed: reinstall ray-train-eks")
    return package_files(list(found.submodule_search_locations)[0])


def deployed_code_digest(connection: Connection, namespace: str) -> str | None:
    """The digest of the deployed training code (None: none deployed, a custom entrypoint's platform)."""
    try:
        config_map = connection.call("GET", f"/api/v1/namespaces/{namespace}/configmaps/{TRAINING_CODE_CONFIGMAP}")
    except KubeError as error:
        if error.code == 404:
            return None
        raise
    return (config_map.get("metadata", {}).get("annotations") or {}).get(CODE_DIGEST_ANNOTATION)


# --------------------------------------------------------------------- submit


def job_spec(platform_spec: RayWorkloadSpec, *, name: str, options: list[str], code: dict[str, str]) -> RayWorkloadSpec:
    """The deployed spec for one more job: its training options (the run's name as ``--run-name``),
    a RayJob of its own (named after the run, with a hash of its spec and code), the same pods."""
    if "--run-name" in options or any(o.startswith("--run-name=") for o in options):
        raise CliError("--run-name is the run's name: give it as submit --name NAME, not among the training options")
    return dataclasses.replace(platform_spec, training_args=(*options, "--run-name", name), run_job=True, workload="job",
                               ray_job_name_prefix=name, entrypoint=None, training_code=code)


def submit_objects(spec: RayWorkloadSpec, name: str) -> list[dict]:
    """The job's objects (its NetworkPolicies, then the RayJob), each labelled with the run, after
    every check synth runs (the spec's rules, the memory plan); CliError naming each problem."""
    problems = workload_problems(spec)
    if problems:
        raise CliError("the job cannot run on this platform:\n" + "\n".join(f"  - {p}" for p in problems))
    objects = job_objects(spec)
    for obj in objects:
        obj["metadata"].setdefault("labels", {})[RUN_LABEL] = name
    return objects


def cost_per_hour(spec: RayWorkloadSpec) -> str:
    gpu = INSTANCE_TYPES.get(spec.gpu_instance_type)
    if gpu is None:
        return "its GPU nodes' cost (instance type not in ray-train-eks's table)"
    return (f"{gpu.on_demand_usd_per_hour * spec.gpu_node_count:.2f} USD/hour for its {spec.gpu_node_count} x "
            f"{spec.gpu_instance_type} (on demand, us-west-2)")


def submit(args: argparse.Namespace) -> int:
    if args.resume and args.name and args.resume != args.name:
        raise CliError(f"--resume {args.resume} continues run {args.resume}: drop --name {args.name}")
    name = args.resume or args.name or f"run-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}"
    if not RUN_NAME.match(name):
        raise CliError(f"--name {name!r}: use 1 to 30 lower-case letters, digits and '-', starting with a letter "
                       "(a Kubernetes name with room for KubeRay's suffixes), e.g. dolly-lr1e5")
    options = list(args.options)[1:] if list(args.options)[:1] == ["--"] else list(args.options)
    code, connection, settings = installed_training_code(), None, {}
    if args.dry_run and args.settings:
        platform_spec = spec_from_settings(Path(args.settings).read_text())
    elif args.dry_run and not (args.kubeconfig or args.context):
        platform_spec = default_platform_spec()
    else:
        connection = connect(args)
        platform_spec, settings = platform(connection, args.namespace)
    if args.resume and not settings:
        raise CliError("--resume reads the run's options from the deployed platform's bucket: give --kubeconfig, or "
                       "drop --dry-run")
    if args.resume:
        options = [*submitted_options(s3_client(args), settings, name), *options]  # what is given now wins
    copy = None
    if connection is not None and deployed_code_digest(connection, args.namespace) != files_digest(code):
        copy = f"{TRAINING_CODE_CONFIGMAP}-{files_digest(code)[:8]}"  # the job carries its own, named by its hash
    spec = dataclasses.replace(job_spec(platform_spec, name=name, options=options, code=code), code_config_map=copy)
    objects = submit_objects(spec, name)
    if args.dry_run:
        import yaml

        print(yaml.safe_dump_all(objects, sort_keys=False), end="")
        return 0
    if not spec.queue_name:  # queued (Kueue): it waits for the GPUs instead
        check_gpus_free(connection, spec)
    record_options(s3_client(args), settings, name, options)
    if copy:
        for config_map in code_config_maps(code, namespace=spec.namespace, base=copy):
            create(connection, config_map, exists_ok=True)  # the same hash: the same code
        print(f"the training code installed here is not the deployed code: the job carries its own copy ({copy})")
    for obj in objects:
        create(connection, obj)
    job = objects[-1]["metadata"]["name"]
    queued = (f"queued in {spec.queue_name} (Kueue admits it whole when the GPU nodes are free, oldest first); "
              if spec.queue_name else "")
    print(f"submitted run {name}: RayJob {spec.namespace}/{job}, {queued}{cost_per_hour(spec)} while it runs\n"
          f"  follow it:  ray-train-eks list   |   ray-train-eks logs {name} -f\n"
          f"  stop it:    ray-train-eks stop {name}   (its checkpoints stay; submit --resume {name} continues it)")
    return 0


#: The options a run was submitted with, in its folder: what ``submit --resume`` submits again.
SUBMITTED_FILE = "submitted.json"


def record_options(s3, settings: dict, name: str, options: list[str]) -> None:
    """Keep the run's options beside its checkpoints (its RayJob goes when it is stopped)."""
    bucket, folder = run_folder(settings, name)
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        s3.put_object(Bucket=bucket, Key=f"{folder}/{SUBMITTED_FILE}",
                      Body=json.dumps({"options": options, "submitted": datetime.now(timezone.utc).isoformat()}).encode())
    except (BotoCoreError, ClientError) as error:
        print(f"ray-train-eks: could not keep the run's options in s3://{bucket}/{folder}/{SUBMITTED_FILE} ({error}); "
              f"submit --resume {name} will need them again", file=sys.stderr)


def submitted_options(s3, settings: dict, name: str) -> list[str]:
    """The options run ``name`` was last submitted with (:func:`record_options`)."""
    bucket, folder = run_folder(settings, name)
    try:
        return json.loads(s3.get_object(Bucket=bucket, Key=f"{folder}/{SUBMITTED_FILE}")["Body"].read())["options"]
    except s3.exceptions.NoSuchKey:
        raise CliError(f"--resume {name}: no s3://{bucket}/{folder}/{SUBMITTED_FILE}, so the run was not submitted by "
                       f"ray-train-eks; submit --name {name} -- OPTIONS resumes it from its last checkpoint with the options "
                       "you give") from None


#: KubeRay's end states of a RayJob (its job status, or its deployment status when the job never ran).
ENDED = {"SUCCEEDED", "FAILED", "STOPPED"}
ENDED_DEPLOYMENTS = {"Complete", "Failed"}


def active(job: dict) -> bool:
    status = job.get("status") or {}
    return status.get("jobStatus") not in ENDED and status.get("jobDeploymentStatus") not in ENDED_DEPLOYMENTS


def check_gpus_free(connection: Connection, spec: RayWorkloadSpec) -> None:
    """Every job asks for all the platform's GPU nodes (its worker group is ``gpu_node_count`` pods,
    one a node; the node group holds that many, Karpenter's NodePool that many and a spare). Two
    jobs at once would each hold part of the nodes and wait for the rest forever, so a submit is
    refused while another RayJob of the namespace (a submitted run, the deployed job) is active,
    naming it. With ``-c queueing=kueue`` the jobs queue instead, each admitted whole
    (charts/queueing.py), and this check is not made."""
    listed = connection.call("GET", RAYJOBS.format(namespace=spec.namespace)).get("items") or []
    busy = [job for job in listed if active(job)]
    if busy:
        names = ", ".join(f"{job['metadata']['name']} ({state_of(job)}"
                          + (f", run {job['metadata']['labels'][RUN_LABEL]})" if RUN_LABEL in (job["metadata"].get("labels") or {})
                             else ")") for job in busy)
        raise CliError(f"the GPU nodes are taken: {names} asks for all {spec.gpu_node_count} of them, as this job would; "
                       "two at once would each hold part and wait forever. Stop it (ray-train-eks stop NAME, or kubectl "
                       f"-n {spec.namespace} delete rayjob NAME), wait for it to end, or deploy with -c queueing=kueue "
                       "to queue the jobs")


def create(connection: Connection, obj: dict, *, exists_ok: bool = False) -> dict:
    """POST one object to its collection."""
    namespace, kind = obj["metadata"]["namespace"], obj["kind"]
    collections = {"RayJob": RAYJOBS, "NetworkPolicy": "/apis/networking.k8s.io/v1/namespaces/{namespace}/networkpolicies",
                   "ConfigMap": "/api/v1/namespaces/{namespace}/configmaps"}
    try:
        return connection.call("POST", collections[kind].format(namespace=namespace), obj)
    except KubeError as error:
        if error.code == 409 and exists_ok:
            return obj
        if error.code == 409:
            raise CliError(f"{kind} {namespace}/{obj['metadata']['name']} exists already: a run of this name with these "
                           "options is submitted (ray-train-eks list)") from None
        raise


# --------------------------------------------------------------------- list, stop


def runs(connection: Connection, namespace: str) -> list[dict]:
    """The submitted runs' RayJobs, oldest first."""
    listed = connection.call("GET", RAYJOBS.format(namespace=namespace), query={"labelSelector": RUN_LABEL})
    return sorted(listed.get("items") or [], key=lambda job: job["metadata"].get("creationTimestamp", ""))


def state_of(job: dict) -> str:
    """Queued, running, or how it ended, from KubeRay's status."""
    status = job.get("status") or {}
    if job.get("spec", {}).get("suspend"):
        return "queued"
    return (status.get("jobStatus") or status.get("jobDeploymentStatus") or "created").lower()


def age_hours(job: dict, now: float | None = None) -> float:
    created = job["metadata"].get("creationTimestamp")
    if not created:
        return 0.0
    started = datetime.strptime(created, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp()
    return max(0.0, ((now or time.time()) - started) / 3600)


def run_folder(settings: dict, name: str) -> tuple[str, str]:
    """The run's folder in the bucket (the pods' storage path, ``s3://<bucket>/runs``: charts/pods.py)."""
    return settings["bucket"], f"runs/{name}"


def progress(s3, settings: dict, name: str) -> dict:
    """What the run's own records say (its ``run.json`` and ``metrics.jsonl``, which rank 0 writes
    as it trains: training/telemetry/runlog.py): the step of max steps, the last loss and eval
    loss, tokens/s, and an ETA from the median step time; {} before its first step."""
    bucket, folder = run_folder(settings, name)

    def read(key: str) -> str | None:
        try:
            return s3.get_object(Bucket=bucket, Key=f"{folder}/{key}")["Body"].read().decode()
        except s3.exceptions.NoSuchKey:
            return None

    from botocore.exceptions import BotoCoreError, ClientError

    try:
        about, lines = json.loads(read("run.json") or "{}"), []
        text = read("metrics.jsonl") or ""
    except (BotoCoreError, ClientError) as error:  # the cluster answered; the bucket is the user's AWS access
        print(f"ray-train-eks: cannot read run {name}'s records in s3://{bucket}/{folder}/ ({error})", file=sys.stderr)
        return {}
    for line in text.splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:  # a line being written
            continue
    if not lines:
        return {}
    last, evals = lines[-1], [line["eval_loss"] for line in lines if line.get("eval_loss") is not None]
    seconds = sorted(line["step_seconds"] for line in lines[-20:] if line.get("step_seconds"))
    found = {"step": last["step"], "max_steps": about.get("max_steps"), "loss": last.get("loss"),
             "eval_loss": evals[-1] if evals else None, "tokens_per_s": last.get("tokens_per_s")}
    if seconds and found["max_steps"]:
        found["eta_min"] = (found["max_steps"] - last["step"]) * seconds[len(seconds) // 2] / 60
    return found


def s3_client(args: argparse.Namespace):
    import boto3

    return boto3.Session(region_name=args.region).client("s3")


def list_runs(args: argparse.Namespace) -> int:
    connection = connect(args)
    platform_spec, settings = platform(connection, args.namespace)
    gpu = INSTANCE_TYPES.get(platform_spec.gpu_instance_type)
    rate = gpu.on_demand_usd_per_hour * platform_spec.gpu_node_count if gpu else None
    s3 = s3_client(args)
    rows = [("RUN", "STATE", "STEP", "LOSS", "AGE", "COST SO FAR", "RAYJOB")]
    for job in runs(connection, args.namespace):
        hours, name = age_hours(job), job["metadata"]["labels"][RUN_LABEL]
        running = state_of(job) in ("running", "pending", "initializing", "created")
        cost = f"{rate * hours:.2f} USD" if rate and running else "-"
        found = progress(s3, settings, name)
        step = f"{found['step']}/{found['max_steps'] or '?'}" if found else "-"
        loss = f"{found['loss']:.4f}" if found.get("loss") is not None else "-"
        rows.append((name, state_of(job), step, loss, f"{hours * 60:.0f} min", cost, job["metadata"]["name"]))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    if len(rows) == 1:
        print("(no runs submitted: ray-train-eks submit --name NAME -- OPTIONS)")
    return 0


def status(args: argparse.Namespace) -> int:
    """One run: its state and RayJob, its progress with tokens/s and an ETA, the eval loss, and
    where its checkpoints and final model are."""
    connection = connect(args)
    _, settings = platform(connection, args.namespace)
    jobs = [job for job in runs(connection, args.namespace) if job["metadata"]["labels"].get(RUN_LABEL) == args.name]
    found = progress(s3_client(args), settings, args.name)
    if not jobs and not found:
        raise CliError(f"no run {args.name!r} in namespace {args.namespace} or in the bucket (ray-train-eks list shows the runs)")
    bucket, folder = run_folder(settings, args.name)
    print(f"run {args.name}: {state_of(jobs[-1]) if jobs else 'no RayJob (stopped or ended)'}"
          + (f", RayJob {args.namespace}/{jobs[-1]['metadata']['name']}" if jobs else ""))
    if found:
        eta = f", about {found['eta_min']:.0f} min to go" if "eta_min" in found else ""
        evaluated = f", eval loss {found['eval_loss']:.4f}" if found.get("eval_loss") is not None else ""
        print(f"  step {found['step']} of {found['max_steps'] or '?'}, loss {found['loss']:.4f}{evaluated}, "
              f"{found['tokens_per_s'] or 0:,.0f} tokens/s{eta}")
    else:
        print("  no step yet")
    print(f"  checkpoints: s3://{bucket}/{folder}/checkpoint_*   final model: s3://{bucket}/{folder}/final/\n"
          f"  metrics: s3://{bucket}/{folder}/metrics.jsonl   curves: s3://{bucket}/{folder}/curves.png")
    return 0


def logs(args: argparse.Namespace) -> int:
    """The training's output: the log of the run's submitter pod, as it comes with ``-f``. KubeRay
    v1.7.0's K8sJobMode submits from a Kubernetes Job of the RayJob's name
    (ray-operator/controllers/ray/rayjob_controller.go ``createNewK8sJob``) whose command ends in
    ``ray job logs --follow`` (common/job.go), and Kubernetes labels a Job's pods
    ``batch.kubernetes.io/job-name``."""
    connection = connect(args)
    jobs = [job for job in runs(connection, args.namespace) if job["metadata"]["labels"].get(RUN_LABEL) == args.name]
    if not jobs:
        raise CliError(f"no run {args.name!r} in namespace {args.namespace} (stopped runs keep their log in the bucket's "
                       "job log: docs/operations.md; ray-train-eks list shows the runs)")
    job = jobs[-1]["metadata"]["name"]
    pods = connection.call("GET", f"/api/v1/namespaces/{args.namespace}/pods",
                           query={"labelSelector": f"batch.kubernetes.io/job-name={job}"}).get("items") or []
    if not pods:
        raise CliError(f"run {args.name}: its submitter pod has not started yet (state {state_of(jobs[-1])}); try again")
    pod = max(pods, key=lambda p: p["metadata"].get("creationTimestamp", ""))["metadata"]["name"]
    query = {"follow": "true"} if args.follow else {}
    with connection.call("GET", f"/api/v1/namespaces/{args.namespace}/pods/{pod}/log", query=query, raw=True,
                         timeout=None if args.follow else 60) as stream:
        for line in stream:
            sys.stdout.write(line.decode(errors="replace"))
            sys.stdout.flush()
    return 0


def stop(args: argparse.Namespace) -> int:
    """Delete the run's RayJob: KubeRay deletes its RayCluster and pods, the GPUs are free; its
    checkpoints stay in the bucket."""
    connection = connect(args)
    jobs = [job for job in runs(connection, args.namespace) if job["metadata"]["labels"].get(RUN_LABEL) == args.name]
    if not jobs:
        raise CliError(f"no run {args.name!r} in namespace {args.namespace} (ray-train-eks list shows the runs)")
    for job in jobs:
        connection.call("DELETE", f"{RAYJOBS.format(namespace=args.namespace)}/{job['metadata']['name']}",
                        {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"})
        print(f"stopped run {args.name}: RayJob {args.namespace}/{job['metadata']['name']} deleted (its checkpoints stay; "
              f"ray-train-eks submit --name {args.name} -- ... resumes from the last)")
    return 0


# --------------------------------------------------------------------- the command line


def parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--stack", default="RayTrainEks", help="the deployed stack (its ClusterName output; default RayTrainEks)")
    common.add_argument("--region", help="the stack's region (default: your AWS configuration's)")
    common.add_argument("--kubeconfig", help="use this kubeconfig instead of your AWS identity")
    common.add_argument("--context", help="the kubeconfig context (default: its current one)")
    common.add_argument("--namespace", default=RAY_NAMESPACE, help=f"the Ray namespace (default {RAY_NAMESPACE})")
    top = argparse.ArgumentParser(prog="ray-train-eks", description=__doc__.split("\n\n")[0])
    commands = top.add_subparsers(dest="command", required=True)
    submit_parser = commands.add_parser("submit", parents=[common], help="a new fine-tune, as a RayJob of its own")
    submit_parser.add_argument("--name", help="the run's name (its --run-name; default run-<UTC time>)")
    submit_parser.add_argument("--resume", metavar="NAME",
                               help="continue run NAME from its last checkpoint with the options it was submitted with "
                                    "(options after -- change them, e.g. -- --max-steps 400)")
    submit_parser.add_argument("--dry-run", action="store_true",
                               help="print the manifests; needs no AWS (the platform's defaults, or --settings, or the cluster's "
                                    "settings with --kubeconfig)")
    submit_parser.add_argument("--settings", help="with --dry-run: a platform's settings JSON (the settings ConfigMap's workload)")
    submit_parser.add_argument("options", nargs=argparse.REMAINDER, help="-- then python -m training.train options")
    submit_parser.set_defaults(handler=submit)
    commands.add_parser("list", parents=[common], help="the submitted runs").set_defaults(handler=list_runs)
    status_parser = commands.add_parser("status", parents=[common], help="one run: progress, ETA, eval loss, where its outputs are")
    status_parser.add_argument("name")
    status_parser.set_defaults(handler=status)
    logs_parser = commands.add_parser("logs", parents=[common], help="a run's training output")
    logs_parser.add_argument("name")
    logs_parser.add_argument("-f", "--follow", action="store_true", help="follow it as it comes")
    logs_parser.set_defaults(handler=logs)
    stop_parser = commands.add_parser("stop", parents=[common], help="stop a run and free its GPUs; its checkpoints stay")
    stop_parser.add_argument("name")
    stop_parser.set_defaults(handler=stop)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.handler(args)
    except (CliError, KubeError) as error:
        print(f"ray-train-eks {args.command}: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
