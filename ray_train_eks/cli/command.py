"""The ``ray-train-eks`` command line: its subcommands and their options, and :func:`main`, which
says every failure as a sentence with its fix, never a traceback."""

from __future__ import annotations

import argparse
import sys

from ray_train_eks.cli.admission import NotAdmitted
from ray_train_eks.cli.job_submission import SubmitError
from ray_train_eks.cli.kube import KubeError
from ray_train_eks.cli.platform import CliError
from ray_train_eks.cli.run_records import RecordsError
from ray_train_eks.cli.endpoint import chat, endpoint
from ray_train_eks.cli.runs import list_runs, logs, status, stop
from ray_train_eks.cli.serve import WAIT_MINUTES, serve, unserve
from ray_train_eks.cli.submit import submit
from ray_train_eks.handlers.serving import ServingProblems
from ray_train_eks.scheduling import RAY_NAMESPACE

#: What ``ray-train-eks --help`` says first.
DESCRIPTION = "ray-train-eks: fine-tunes on the deployed platform without CloudFormation, and what they made served."


def parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--stack", default="RayTrainEks", help="the deployed stack (its ClusterName output; default RayTrainEks)")
    common.add_argument("--region", help="the stack's region (default: your AWS configuration's)")
    common.add_argument("--kubeconfig", help="use this kubeconfig instead of your AWS identity")
    common.add_argument("--context", help="the kubeconfig context (default: its current one)")
    common.add_argument("--namespace", default=RAY_NAMESPACE, help=f"the Ray namespace (default {RAY_NAMESPACE})")
    top = argparse.ArgumentParser(prog="ray-train-eks", description=DESCRIPTION)
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
    _serving_commands(commands, common)
    return top


def _serving_commands(commands, common: argparse.ArgumentParser) -> None:
    serve_parser = commands.add_parser("serve", parents=[common], help="finished runs behind an OpenAI-compatible endpoint "
                                       "(a RayService); again with other runs: changes what it serves, in place")
    serve_parser.add_argument("runs", nargs="*", metavar="RUN", help="runs to serve: a full fine-tune each as its own model, "
                              "LoRA runs of one base as adapters on it")
    serve_parser.add_argument("--name", help="the service's name (default: the run's, when one is served)")
    serve_parser.add_argument("--list", action="store_true", help="the services: ready or not, GPU nodes, cost, models")
    serve_parser.add_argument("--dry-run", action="store_true", help="print the objects (the RayService and its "
                              "NetworkPolicies); change nothing (reads the runs from the bucket)")
    serve_parser.add_argument("--settings", help="with --dry-run and no cluster: a platform's settings JSON")
    serve_parser.add_argument("--bucket", help="with --dry-run and no cluster: the training bucket (the stack's BucketName)")
    serve_parser.add_argument("--internal-lb", action="store_true",
                              help="also an internal load balancer in the VPC, with a bearer key the service checks (printed "
                                   "once); without it the service is reached through the Kubernetes API only")
    serve_parser.add_argument("--wait", type=float, default=WAIT_MINUTES, metavar="MINUTES",
                              help=f"how long to wait for it to be ready (default {WAIT_MINUTES})")
    serve_parser.add_argument("--no-wait", action="store_true", help="return once it is sent")
    serve_parser.set_defaults(handler=serve)
    unserve_parser = commands.add_parser("unserve", parents=[common], help="delete a service and free its GPUs")
    unserve_parser.add_argument("name")
    unserve_parser.set_defaults(handler=unserve)
    endpoint_parser = commands.add_parser("endpoint", parents=[common], help="a local port to a service's OpenAI API, "
                                          "through the Kubernetes API with your own access")
    endpoint_parser.add_argument("name")
    endpoint_parser.add_argument("--port", type=int, default=8000, help="the local port (default 8000; 0: any free one)")
    endpoint_parser.set_defaults(handler=endpoint)
    chat_parser = commands.add_parser("chat", parents=[common], help="one streamed chat request to a service (a smoke test)")
    chat_parser.add_argument("name")
    chat_parser.add_argument("message")
    chat_parser.add_argument("--model", help="the model to ask (default: the service's only one, or its first adapter)")
    chat_parser.add_argument("--max-tokens", type=int, default=256)
    chat_parser.add_argument("--key", help="the bearer key of a service served with --internal-lb (default: "
                             "RAY_TRAIN_EKS_SERVE_KEY)")
    chat_parser.set_defaults(handler=chat)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, NoRegionError

    try:
        return args.handler(args)
    except (CliError, KubeError, NotAdmitted, SubmitError, RecordsError, ServingProblems) as error:
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
