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
and a token as ``aws eks get-token`` makes it), or their kubeconfig (``--kubeconfig``,
``--context``, ``KUBECONFIG``), both through the ``kubernetes`` client (ray_train_eks/kube.py).
Every failure is a sentence with its fix, never a traceback; nothing here imports the CDK, so the
command never starts Node.js.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from ray_train_eks.admission import (ENDED, ENDED_DEPLOYMENTS, RUN_LABEL, NotAdmitted, check_queue, ended, queue_reasons,
                                     gpus_taken_by, rayjobs, state_of, take_gpus)
from ray_train_eks.charts import RayWorkloadSpec, job_objects, spec_from_settings, workload_problems
from ray_train_eks.charts.code import (CODE_DIGEST_ANNOTATION, SETTINGS_CONFIGMAP, TRAINING_CODE_CONFIGMAP, code_config_maps,
                                      files_digest, package_files)
from ray_train_eks.charts.queueing import queue_fit_problems
from ray_train_eks.instances import INSTANCE_TYPES
from ray_train_eks.job_submission import SubmitError, create_shared, send_job
from ray_train_eks.kube import Cluster, KubeError, from_eks, from_kubeconfig
from ray_train_eks.run_records import (SUBMITTED_FILE, RecordsError, number, outcome, progress, record_options, recorded, run_folder,
                                       stop_time_line, submitted_options, tracking_url)
from ray_train_eks.scheduling import RAY_NAMESPACE

__all__ = ["ENDED", "ENDED_DEPLOYMENTS", "SUBMITTED_FILE", "CliError", "main", "installed_training_code", "state_of"]

#: A run's name: a DNS label short enough for the RayJob's name (the run, a dash and 8 hex digits)
#: and KubeRay's names derived from it (its RayCluster adds 6 characters, its pods more).
RUN_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,28}[a-z0-9])?$")


class CliError(RuntimeError):
    """What went wrong, said to the user (no traceback)."""


# --------------------------------------------------------------------- the platform


def connect(args: argparse.Namespace) -> Cluster:
    """The cluster, from the kubeconfig when one is named, else from the stack (the user's AWS identity)."""
    if args.kubeconfig or args.context:
        return from_kubeconfig(args.kubeconfig, args.context)
    import boto3
    from botocore.exceptions import ClientError

    session = boto3.Session(region_name=args.region)
    if not session.region_name:
        raise CliError("no AWS region: give --region (the stack's), or set AWS_REGION, or aws configure set region REGION")
    try:
        stack = session.client("cloudformation").describe_stacks(StackName=args.stack)["Stacks"][0]
    except ClientError as error:
        if "does not exist" in str(error):
            raise CliError(f"no stack {args.stack} in {session.region_name}: name the deployed stack with --stack NAME, its "
                           "region with --region (aws cloudformation list-stacks lists them)") from None
        raise
    outputs = {o["OutputKey"]: o["OutputValue"] for o in stack.get("Outputs") or []}
    if "ClusterName" not in outputs:
        raise CliError(f"stack {args.stack} has no ClusterName output: is it a ray-train-eks stack? (--stack names it)")
    identity = session.client("sts").get_caller_identity()["Arn"]
    return from_eks(outputs["ClusterName"], session=session, identity=identity)


def read_config_map(cluster: Cluster, namespace: str, name: str) -> dict | None:
    try:
        return cluster.request("CoreV1Api", "read_namespaced_config_map", name, namespace)
    except KubeError as error:
        if error.code == 404:
            return None
        raise


def platform(cluster: Cluster, namespace: str) -> tuple[RayWorkloadSpec, dict]:
    """The deployed workload's spec and the settings ConfigMap's data (the bucket), from the cluster."""
    settings = read_config_map(cluster, namespace, SETTINGS_CONFIGMAP)
    if settings is None:
        raise CliError(f"no ConfigMap {SETTINGS_CONFIGMAP} in namespace {namespace}: deploy the stack first (make "
                       "deploy), or name the Ray namespace with --namespace")
    data = settings.get("data") or {}
    if "workload" not in data:
        raise CliError(f"ConfigMap {namespace}/{SETTINGS_CONFIGMAP} holds no workload settings: the stack was deployed "
                       "by an older ray-train-eks; deploy it again with this one (make deploy)")
    return spec_from_settings(data["workload"]), data


def default_platform_spec() -> RayWorkloadSpec:
    """What ``cdk deploy`` builds with no settings given (ray_train_eks/config.py, whose rules live in
    ray_train_eks/rules/: no CDK is imported, Node.js never starts)."""
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


def deployed_code_digest(cluster: Cluster, namespace: str) -> str | None:
    """The digest of the deployed training code (None: none deployed, a custom entrypoint's platform)."""
    config_map = read_config_map(cluster, namespace, TRAINING_CODE_CONFIGMAP)
    return None if config_map is None else (config_map.get("metadata", {}).get("annotations") or {}).get(CODE_DIGEST_ANNOTATION)


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


def _options(args: argparse.Namespace) -> list[str]:
    return list(args.options)[1:] if list(args.options)[:1] == ["--"] else list(args.options)


def _run_name(args: argparse.Namespace) -> str:
    if args.resume and args.name and args.resume != args.name:
        raise CliError(f"--resume {args.resume} continues run {args.resume}: drop --name {args.name}")
    name = args.resume or args.name or f"run-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}"
    if not RUN_NAME.match(name):
        raise CliError(f"--name {name!r}: use 1 to 30 lower-case letters, digits and '-', starting with a letter "
                       "(a Kubernetes name with room for KubeRay's suffixes), e.g. dolly-lr1e5")
    return name


def _check_run_is_new(cluster: Cluster, s3, settings: dict, spec: RayWorkloadSpec, name: str, job_name: str) -> None:
    """``submit --name NAME`` starts a new run: one that exists (a RayJob, or records in the bucket)
    is refused, unless its RayJob is this very job (the same options and code: the same submit
    again, after one that failed half-way)."""
    jobs = rayjobs(cluster, spec.namespace, f"{RUN_LABEL}={name}")
    if any(job["metadata"]["name"] == job_name and not ended(job) for job in jobs):
        return
    found = (f"its RayJob {jobs[-1]['metadata']['name']} ({state_of(jobs[-1])})" if jobs
             else recorded(s3, settings, name))
    if found:
        raise CliError(f"run {name} exists ({found}): submit --resume {name} continues it from its last checkpoint "
                       f"(options after -- change it), or give another --name for a new run")


def _check_resumable(cluster: Cluster, spec: RayWorkloadSpec, name: str, job_name: str) -> None:
    """A run is continued once: refused while another of its jobs is active."""
    for job in rayjobs(cluster, spec.namespace, f"{RUN_LABEL}={name}"):
        if not ended(job) and job["metadata"]["name"] != job_name:
            raise CliError(f"run {name} is {state_of(job)} (RayJob {spec.namespace}/{job['metadata']['name']}): stop it "
                           f"first (ray-train-eks stop {name}), then submit --resume {name}")


def _check_queueing(cluster: Cluster, platform_spec: RayWorkloadSpec, spec: RayWorkloadSpec, job: dict) -> None:
    check_queue(cluster, spec.namespace, spec.queue_name)
    deployed = job_objects(dataclasses.replace(platform_spec, run_job=True))[-1]
    problems = queue_fit_problems(platform_spec, deployed, job)
    if problems:
        raise CliError("Kueue would never admit the job:\n" + "\n".join(f"  - {p}" for p in problems))


def submit(args: argparse.Namespace) -> int:
    name, options = _run_name(args), _options(args)
    code, cluster, settings = installed_training_code(), None, {}
    if args.dry_run and args.settings:
        platform_spec = spec_from_settings(Path(args.settings).read_text())
    elif args.dry_run and not (args.kubeconfig or args.context):
        platform_spec = default_platform_spec()
    else:
        cluster = connect(args)
        platform_spec, settings = platform(cluster, args.namespace)
    if platform_spec.workload == "cluster":
        raise CliError("this platform runs a standing RayCluster (-c workload=cluster), which ray-train-eks submit does not "
                       f"use: submit to it with ray job submit (the RayCluster {platform_spec.ray_cluster_name}'s dashboard), or "
                       "deploy with -c workload=job for a cluster per job that frees the GPUs when it ends")
    if args.resume and not settings:
        raise CliError("--resume reads the run's options from the deployed platform's bucket: give --kubeconfig, or "
                       "drop --dry-run")
    s3 = s3_client(args) if settings else None
    if args.resume:
        options = [*submitted_options(s3, settings, name, options), *options]  # what is given now wins
    copy = None
    if cluster is not None and deployed_code_digest(cluster, args.namespace) != files_digest(code):
        copy = f"{TRAINING_CODE_CONFIGMAP}-{files_digest(code)[:8]}"  # the job carries its own, named by its hash
    spec = dataclasses.replace(job_spec(platform_spec, name=name, options=options, code=code), code_config_map=copy)
    objects = submit_objects(spec, name)
    if args.dry_run:
        import yaml

        print(yaml.safe_dump_all(objects, sort_keys=False), end="")
        return 0
    job_name = objects[-1]["metadata"]["name"]
    if args.resume:
        _check_resumable(cluster, spec, name, job_name)
    else:
        _check_run_is_new(cluster, s3, settings, spec, name, job_name)
    if spec.queue_name:
        _check_queueing(cluster, platform_spec, spec, objects[-1])
    else:
        take_gpus(cluster, spec.namespace, job_name, spec.gpu_node_count)
    if copy:
        for config_map in code_config_maps(code, namespace=spec.namespace, base=copy):
            create_shared(cluster, config_map)  # the same hash: the same code
        print(f"the training code installed here is not the deployed code: the job carries its own copy ({copy})")
    job, again = send_job(cluster, objects)
    if not spec.queue_name:
        gpus_taken_by(cluster, spec.namespace, job)
    record_options(s3, settings, name, options)
    queued = (f"queued in {spec.queue_name} (Kueue admits it whole when the job before it has ended and its nodes are "
              f"free; ray-train-eks status {name} shows its place); " if spec.queue_name else "")
    print(f"submitted run {name}: RayJob {spec.namespace}/{job_name}{' (submitted before; its objects are complete now)' if again else ''}"
          f", {queued}{cost_per_hour(spec)} while it runs\n"
          f"  follow it:  ray-train-eks status {name}   |   ray-train-eks logs {name} -f\n"
          f"  stop it:    ray-train-eks stop {name}   (its checkpoints stay; submit --resume {name} continues it)")
    return 0


# --------------------------------------------------------------------- list, status, logs, stop


def runs(cluster: Cluster, namespace: str, name: str | None = None) -> list[dict]:
    """The submitted runs' RayJobs (of run ``name``), oldest first."""
    return rayjobs(cluster, namespace, f"{RUN_LABEL}={name}" if name else RUN_LABEL)


def stopped_by_hand(job: dict) -> bool:
    """A job stopped with ``ray job stop`` (STOPPED) whose cluster KubeRay keeps: its deletion rules
    name SUCCEEDED, FAILED and a failed deployment only (charts/workload.py ``END_STATES``); a queued
    job's ``shutdownAfterJobFinishes`` does take it down."""
    status = job.get("status") or {}
    return (status.get("jobStatus") == "STOPPED" and not job["metadata"].get("deletionTimestamp")
            and not job.get("spec", {}).get("shutdownAfterJobFinishes"))


def stopped_note(job: dict, name: str) -> str:
    """What happens to a job :func:`stopped_by_hand`: the watch beside its head (charts/stopped_jobs.py)
    deletes it after its grace; a job without one stays until ``ray-train-eks stop``."""
    from ray_train_eks.charts.stopped_jobs import WATCH_CONTAINER

    head = ((job.get("spec", {}).get("rayClusterSpec") or {}).get("headGroupSpec") or {}).get("template", {}).get("spec", {})
    watch = next((c for c in head.get("containers") or [] if c.get("name") == WATCH_CONTAINER), None)
    if watch is None:
        return (f"stopped with ray job stop, and KubeRay keeps its cluster (no deletion rule can name STOPPED): "
                f"its GPU nodes stay taken until ray-train-eks stop {name} deletes it")
    grace = next((e["value"] for e in watch.get("env") or [] if e.get("name") == "RAY_TRAIN_EKS_STOPPED_GRACE_S"), "?")
    return (f"stopped with ray job stop: the watch beside its Ray head deletes it {grace} s after, freeing its GPU nodes "
            f"(its log says why if not; ray-train-eks stop {name} frees them now)")


def age_hours(job: dict, now: float | None = None) -> float:
    created = job["metadata"].get("creationTimestamp")
    if not created:
        return 0.0
    started = datetime.strptime(created, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp()
    return max(0.0, ((now or time.time()) - started) / 3600)


def s3_client(args: argparse.Namespace):
    import boto3

    return boto3.Session(region_name=args.region).client("s3")


def list_runs(args: argparse.Namespace) -> int:
    cluster = connect(args)
    platform_spec, settings = platform(cluster, args.namespace)
    gpu = INSTANCE_TYPES.get(platform_spec.gpu_instance_type)
    rate = gpu.on_demand_usd_per_hour * platform_spec.gpu_node_count if gpu else None
    s3 = s3_client(args)
    jobs = runs(cluster, args.namespace)
    waiting = queue_reasons(cluster, args.namespace, jobs) if platform_spec.queue_name else {}
    rows = [("RUN", "STATE", "STEP", "LOSS", "AGE", "COST SO FAR", "RAYJOB")]
    for job in jobs:
        hours, name = age_hours(job), job["metadata"]["labels"][RUN_LABEL]
        running = state_of(job) in ("running", "pending", "initializing", "created")
        cost = f"{rate * hours:.2f} USD" if rate and running else "-"
        found = progress(s3, settings, name)
        step = f"{found['step']}/{found['max_steps'] or '?'}" if found else "-"
        loss = number(found["loss"]) if found else "-"
        rows.append((name, state_of(job), step, loss, f"{hours * 60:.0f} min", cost, job["metadata"]["name"]))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    for job_name, why in waiting.items():
        print(f"  {job_name} queued: {why}")
    for job in jobs:
        if stopped_by_hand(job):
            name = job["metadata"]["labels"][RUN_LABEL]
            print(f"  {name}: {stopped_note(job, name)}")
    for row in rows[1:]:
        url = tracking_url(s3, settings, row[0])
        if url:
            print(f"  {row[0]} in MLflow: {url}")
    if len(rows) == 1:
        print("(no runs submitted: ray-train-eks submit --name NAME -- OPTIONS)")
    return 0


def status(args: argparse.Namespace) -> int:
    """One run: its state and RayJob (why it waits, when queued), its progress with tokens/s and an
    ETA, the eval loss, and where its checkpoints and final model are."""
    cluster = connect(args)
    platform_spec, settings = platform(cluster, args.namespace)
    jobs = runs(cluster, args.namespace, args.name)
    s3 = s3_client(args)
    found = progress(s3, settings, args.name)
    if not jobs and not found:
        raise CliError(f"no run {args.name!r} in namespace {args.namespace} or in the bucket (ray-train-eks list shows the runs)")
    bucket, folder = run_folder(settings, args.name)
    print(f"run {args.name}: {state_of(jobs[-1]) if jobs else 'no RayJob (stopped or ended)'}"
          + (f", RayJob {args.namespace}/{jobs[-1]['metadata']['name']}" if jobs else ""))
    if jobs and platform_spec.queue_name:
        for why in queue_reasons(cluster, args.namespace, jobs[-1:]).values():
            print(f"  queued: {why}")
    if jobs and stopped_by_hand(jobs[-1]):
        print(f"  {stopped_note(jobs[-1], args.name)}")
    url = tracking_url(s3, settings, args.name)
    if url:
        print(f"  MLflow: {url}")
    if found:
        eta = f", about {found['eta_min']:.0f} min to go" if "eta_min" in found else ""
        evaluated = f", eval loss {number(found['eval_loss'])}" if found.get("eval_loss") is not None else ""
        print(f"  step {found['step']} of {found['max_steps'] or '?'}, loss {number(found['loss'])}{evaluated}, "
              f"{found['tokens_per_s'] or 0:,.0f} tokens/s{eta}")
        if found.get("best"):
            print(f"  best eval loss {number(found['best'][1])} at step {found['best'][0]}")
        if stop_time_line(found):
            print(f"  {stop_time_line(found)}")
        if found["loss"] is None:
            print("  the last step's loss is not a number (NaN or infinite): the run is diverging; its log says which step "
                  f"(ray-train-eks logs {args.name})")
    else:
        print("  no step yet")
    for line in outcome(s3, settings, args.name):
        print(f"  {line}")
    print(f"  checkpoints: s3://{bucket}/{folder}/checkpoint_*   final model: s3://{bucket}/{folder}/final/\n"
          f"  metrics: s3://{bucket}/{folder}/metrics.jsonl   curves: s3://{bucket}/{folder}/curves.png")
    return 0


def logs(args: argparse.Namespace) -> int:
    """The training's output: the log of the run's submitter pod. KubeRay v1.7.0's K8sJobMode
    submits from a Kubernetes Job of the RayJob's name (``createNewK8sJob``) whose command ends in
    ``ray job logs --follow`` (common/job.go); the Job retries its pod (backoffLimit 2), and
    Kubernetes labels a Job's pods ``batch.kubernetes.io/job-name``. With ``-f`` it waits for the pod
    to start, and follows the next pod when the Job retries."""
    from ray_train_eks.submitter_logs import follow_submitter

    cluster = connect(args)
    jobs = runs(cluster, args.namespace, args.name)
    if not jobs:
        raise CliError(f"no run {args.name!r} in namespace {args.namespace} (stopped runs keep their log in the bucket's "
                       "job log: docs/operations.md; ray-train-eks list shows the runs)")
    return follow_submitter(cluster, args.namespace, jobs[-1], follow=args.follow, tail=args.tail, previous=args.previous)


def stop(args: argparse.Namespace) -> int:
    """Delete the run's RayJobs: KubeRay stops the Ray job and the garbage collector deletes the
    RayCluster, its pods and the job's NetworkPolicies, so the GPUs are free; the checkpoints stay."""
    cluster = connect(args)
    jobs = runs(cluster, args.namespace, args.name)
    if not jobs:
        raise CliError(f"no run {args.name!r} in namespace {args.namespace} (ray-train-eks list shows the runs)")
    for job in jobs:
        try:
            cluster.request("CustomObjectsApi", "delete_namespaced_custom_object", "ray.io", "v1", args.namespace, "rayjobs",
                            job["metadata"]["name"], body={"propagationPolicy": "Background"})
        except KubeError as error:
            if error.code != 404:  # gone meanwhile
                raise
        print(f"stopped run {args.name}: RayJob {args.namespace}/{job['metadata']['name']} deleted (its checkpoints stay; "
              f"ray-train-eks submit --resume {args.name} continues from the last)")
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
    logs_parser.add_argument("-f", "--follow", action="store_true",
                             help="follow it as it comes (waits for the pod to start; follows the next one when it is retried)")
    logs_parser.add_argument("--tail", type=int, metavar="N", help="only the last N lines")
    logs_parser.add_argument("--previous", action="store_true", help="the log of the submitter pod's previous container")
    logs_parser.set_defaults(handler=logs)
    stop_parser = commands.add_parser("stop", parents=[common], help="stop a run and free its GPUs; its checkpoints stay")
    stop_parser.add_argument("name")
    stop_parser.set_defaults(handler=stop)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, NoRegionError

    try:
        return args.handler(args)
    except (CliError, KubeError, NotAdmitted, SubmitError, RecordsError) as error:
        said = str(error)
    except NoRegionError:
        said = "no AWS region: give --region (the stack's), or set AWS_REGION, or aws configure set region REGION"
    except NoCredentialsError:
        said = ("no AWS credentials: aws configure (or aws sso login, or AWS_PROFILE), or give --kubeconfig to use a "
                "kubeconfig instead")
    except ClientError as error:
        said = f"AWS refused {error.operation_name}: {error.response.get('Error', {}).get('Message', error)}"
    except BotoCoreError as error:
        said = f"AWS: {error}"
    print(f"ray-train-eks {args.command}: {said}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
