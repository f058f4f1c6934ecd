"""``ray-train-eks``: fine-tunes on the deployed platform without CloudFormation (the job command).

    ray-train-eks submit --name dolly-lr1e5 -- --learning-rate 1e-5 --max-steps 200
    ray-train-eks submit --name dolly-lr1e5 --dry-run -- --learning-rate 1e-5   # the manifests; no cluster, no AWS
    ray-train-eks list
    ray-train-eks status dolly-lr1e5
    ray-train-eks logs dolly-lr1e5 -f
    ray-train-eks stop dolly-lr1e5

``cdk deploy`` builds the platform (and its first fine-tune); each ``submit`` is one more RayJob of
its own name, built by the same code that builds the deployed one (ray_train_eks/workload: the pod
templates, token authentication, the NetworkPolicies, the memory plan and the spec's checks, all
before anything is sent), with the platform's settings read from the cluster, where the stack wrote
them (the settings ConfigMap's ``workload``: workload/spec.py ``spec_settings``), never retyped. A
run's name is its training ``--run-name``: its checkpoints, metrics and final model are under
``s3://<bucket>/runs/<name>/``, and a run submitted again under the same name resumes from its last
checkpoint.

Credentials: the user's AWS identity (the stack's ``ClusterName`` output, ``eks:DescribeCluster``
and a token as ``aws eks get-token`` makes it), or their kubeconfig (``--kubeconfig``,
``--context``, ``KUBECONFIG``), both through the ``kubernetes`` client (ray_train_eks/cli/kube.py).
Every failure is a sentence with its fix, never a traceback; nothing here imports the CDK, so the
command never starts Node.js.

The command's modules, one concern each: ``command`` (the command line, :func:`main`), ``platform``
(the cluster, the deployed spec and settings), ``submit``, ``runs`` (list, status, logs, stop),
``admission`` (the GPU nodes' Lease, Kueue's reasons), ``job_submission`` (the objects sent),
``submitter_logs``, ``run_records`` (the runs' records in the bucket) and ``kube`` (the cluster's
API through the ``kubernetes`` client). They import ray_train_eks/workload (the objects), the
platform's configuration and its facts, and nothing of the CDK, cdk8s or jsii: tests/test_layout.py
holds the package to that, lazy imports included.
"""

from ray_train_eks.cli.admission import ENDED, ENDED_DEPLOYMENTS, state_of
from ray_train_eks.cli.command import main, parser
from ray_train_eks.cli.platform import (CliError, connect, default_platform_spec, deployed_code_digest,  # noqa: F401
                                        installed_training_code, platform, read_config_map, s3_client)
from ray_train_eks.cli.run_records import SUBMITTED_FILE
# The names the single-module ray_train_eks/cli.py had before round 9, importable from here as before.
from ray_train_eks.cli.runs import age_hours, list_runs, logs, runs, status, stop, stopped_by_hand, stopped_note  # noqa: F401
from ray_train_eks.cli.submit import RUN_NAME, cost_per_hour, job_spec, submit, submit_objects  # noqa: F401

__all__ = ["ENDED", "ENDED_DEPLOYMENTS", "SUBMITTED_FILE", "CliError", "main", "installed_training_code", "parser", "state_of"]
