"""The runs: ``list``, ``status``, ``logs`` and ``stop``, read from the cluster (the runs' RayJobs)
and the bucket (their records: ray_train_eks/cli/run_records.py)."""

from __future__ import annotations

import argparse
import time
from datetime import datetime, timezone

from ray_train_eks.cli.admission import RUN_LABEL, queue_reasons, rayjobs, state_of
from ray_train_eks.cli.kube import Cluster, KubeError
from ray_train_eks.cli.platform import CliError, connect, platform, s3_client
from ray_train_eks.cli.run_records import (cost_line, cost_so_far, elastic_line, number, outcome, progress, run_folder, stop_time_line,
                                           tracking_url)
from ray_train_eks.instances import INSTANCE_TYPES


def runs(cluster: Cluster, namespace: str, name: str | None = None) -> list[dict]:
    """The submitted runs' RayJobs (of run ``name``), oldest first."""
    return rayjobs(cluster, namespace, f"{RUN_LABEL}={name}" if name else RUN_LABEL)


def stopped_by_hand(job: dict) -> bool:
    """A job stopped with ``ray job stop`` (STOPPED) whose cluster KubeRay keeps: its deletion rules
    name SUCCEEDED, FAILED and a failed deployment only (workload/objects.py ``END_STATES``); a queued
    job's ``shutdownAfterJobFinishes`` does take it down."""
    status = job.get("status") or {}
    return (status.get("jobStatus") == "STOPPED" and not job["metadata"].get("deletionTimestamp")
            and not job.get("spec", {}).get("shutdownAfterJobFinishes"))


def stopped_note(job: dict, name: str) -> str:
    """What happens to a job :func:`stopped_by_hand`: the watch beside its head (workload/stopped_jobs.py)
    deletes it after its grace; a job without one stays until ``ray-train-eks stop``."""
    from ray_train_eks.workload.stopped_jobs import WATCH_CONTAINER

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
        found = progress(s3, settings, name)
        # The run's own pricing of its nodes where it has one; else the platform's On-Demand rate since the job was made.
        so_far = cost_so_far(found, running) if found else None
        cost = f"{so_far:.2f} USD" if so_far is not None else f"~{rate * hours:.2f} USD" if rate and running else "-"
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
        from ray_train_eks.cli.serve import print_service_status

        if print_service_status(cluster, platform_spec, args.name, settings["bucket"], s3):
            return 0
        raise CliError(f"no run {args.name!r} in namespace {args.namespace} or in the bucket, and no service of that name "
                       "(ray-train-eks list shows the runs, ray-train-eks serve --list the services)")
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
        if elastic_line(found):
            print(f"  {elastic_line(found)}")
        cost = cost_line(found, running=bool(jobs) and state_of(jobs[-1]) == "running")
        if cost:
            print(f"  {cost}")
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
    from ray_train_eks.cli.submitter_logs import follow_submitter

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
