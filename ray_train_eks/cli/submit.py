"""``ray-train-eks submit``: one more fine-tune on the deployed platform, as a RayJob of its own,
built by the same code that builds the deployed one (ray_train_eks/workload: the job resolved
once, its pods, token authentication, the NetworkPolicies, the memory plan and the spec's checks,
all before anything is sent)."""

from __future__ import annotations

import argparse
import dataclasses
from datetime import datetime, timezone
from pathlib import Path

from ray_train_eks.cli.admission import RUN_LABEL, check_queue, ended, gpus_taken_by, rayjobs, state_of, take_gpus
from ray_train_eks.cli.job_submission import create_shared, send_job
from ray_train_eks.cli.kube import Cluster
from ray_train_eks.cli.platform import (CliError, connect, default_platform_spec, deployed_code_digest, installed_training_code,
                                        platform, s3_client)
from ray_train_eks.cli.run_records import record_options, recorded, submitted_options
from ray_train_eks.instances import INSTANCE_TYPES
from ray_train_eks.workload.code import TRAINING_CODE_CONFIGMAP, code_config_maps, files_digest
from ray_train_eks.workload.job import ResolvedJob, resolve_job
from ray_train_eks.workload.objects import job_objects, workload_problems
from ray_train_eks.workload.pods import elastic_minimum
from ray_train_eks.workload.queueing import queue_fit_problems
from ray_train_eks.workload.spec import RUN_NAME, RayWorkloadSpec, spec_from_settings

def job_spec(platform_spec: RayWorkloadSpec, *, name: str, options: list[str], code: dict[str, str]) -> RayWorkloadSpec:
    """The deployed spec for one more job: its training options (the run's name as ``--run-name``),
    a RayJob of its own (named after the run, with a hash of its spec and code), the same pods."""
    if "--run-name" in options or any(o.startswith("--run-name=") for o in options):
        raise CliError("--run-name is the run's name: give it as submit --name NAME, not among the training options")
    return dataclasses.replace(platform_spec, training_args=(*options, "--run-name", name), run_job=True, workload="job",
                               ray_job_name_prefix=name, entrypoint=None, training_code=code)


def submit_objects(job: ResolvedJob, name: str) -> list[dict]:
    """The job's objects (its NetworkPolicies, then the RayJob), each labelled with the run, after
    every check synth runs (the spec's rules, the memory plan); CliError naming each problem."""
    problems = workload_problems(job)
    if problems:
        raise CliError("the job cannot run on this platform:\n" + "\n".join(f"  - {p}" for p in problems))
    objects = job_objects(job)
    for obj in objects:
        obj["metadata"].setdefault("labels", {})[RUN_LABEL] = name
    return objects


def cost_per_hour(spec: RayWorkloadSpec) -> str:
    gpu = INSTANCE_TYPES.get(spec.gpu_instance_type)
    if gpu is None:
        return "its GPU nodes' cost (instance type not in ray-train-eks's table)"
    return (f"{gpu.on_demand_usd_per_hour * spec.gpu_node_count:.2f} USD/hour for its {spec.gpu_node_count} x "
            f"{spec.gpu_instance_type} (on demand, us-west-2)")


def elastic_line(job: ResolvedJob) -> str | None:
    """What ``--min-nodes`` means for this job on this platform, said at submit; None for a fixed-size job.
    With Kueue the job is admitted whole, as any: Kueue v0.19.2 resizes a RayJob's admission (its
    ``ElasticJobsViaWorkloadSlices``, on by default) only for a job annotated
    ``kueue.x-k8s.io/elastic-job: "true"`` (pkg/workloadslicing/workloadslicing.go ``Enabled``) and with
    KubeRay's in-tree autoscaling (pkg/controller/jobs/raycluster/common.go ``UpdatePodSets``); this
    platform sets no such annotation and keeps the autoscaling off (workload/objects.py), so the quota
    stays held while the run is smaller."""
    minimum, nodes = elastic_minimum(job), job.spec.gpu_node_count
    if minimum is None:
        return None
    line = (f"  elastic: starts on its {nodes} GPU nodes and goes on with as few as {minimum} when nodes are lost, growing "
            "back at a checkpoint when they return (a lost node's pod waits Pending for its replacement)")
    if job.spec.queue_name:
        line += (f"; Kueue admits it whole, at {nodes} nodes, and keeps that quota while it runs smaller (Kueue resizes a "
                 "RayJob only with the elastic-job annotation and in-tree autoscaling, neither of which this platform "
                 "sets), so it grows back into its own quota")
    return line


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
    """The queue is there, and the platform's ClusterQueue can ever admit ``job`` (its RayJob)."""
    check_queue(cluster, spec.namespace, spec.queue_name)
    deployed = job_objects(dataclasses.replace(platform_spec, run_job=True))[-1]
    problems = queue_fit_problems(platform_spec, deployed, job)
    if problems:
        raise CliError("Kueue would never admit the job:\n" + "\n".join(f"  - {p}" for p in problems))


def serving_holds(cluster: Cluster, spec: RayWorkloadSpec) -> str | None:
    """What the services' replicas hold of the GPU nodes the job needs (the node group's, which serving
    shares; with Karpenter serving has nodes of its own), or None."""
    from ray_train_eks.cli.serve import gpu_workers, service_pods

    if spec.gpu_capacity == "karpenter":
        return None
    held = gpu_workers(service_pods(cluster, spec.namespace))
    if not held:
        return None
    services = sorted({(p["metadata"].get("labels") or {}).get("ray-train-eks/service", "?") for p in held})
    return (f"serving ({', '.join(services)}) holds {len(held)} of the {spec.gpu_node_count} GPU nodes: the job's workers wait "
            f"until it goes to zero ({spec.serving_idle_seconds // 60} min after its last request) or ray-train-eks unserve "
            f"{services[0]}")


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
    # The job resolved once: its checks, its objects and what is said below all read it.
    job = resolve_job(dataclasses.replace(job_spec(platform_spec, name=name, options=options, code=code), code_config_map=copy))
    spec, objects = job.spec, submit_objects(job, name)
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
    note = serving_holds(cluster, spec)
    if note:
        print(note)
    sent, again = send_job(cluster, objects)
    if not spec.queue_name:
        gpus_taken_by(cluster, spec.namespace, sent)
    record_options(s3, settings, name, options)
    queued = (f"queued in {spec.queue_name} (Kueue admits it whole when the job before it has ended and its nodes are "
              f"free; ray-train-eks status {name} shows its place); " if spec.queue_name else "")
    print(f"submitted run {name}: RayJob {spec.namespace}/{job_name}{' (submitted before; its objects are complete now)' if again else ''}"
          f", {queued}{cost_per_hour(spec)} while it runs\n"
          f"  follow it:  ray-train-eks status {name}   |   ray-train-eks logs {name} -f\n"
          f"  stop it:    ray-train-eks stop {name}   (its checkpoints stay; submit --resume {name} continues it)")
    if elastic_line(job):
        print(elastic_line(job))
    return 0
