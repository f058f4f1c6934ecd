"""The GPU worker pods' preStop hook: it drains the pod's Ray node in Ray's GCS as a preemption,
with a deadline inside the pod's grace period, so the training checkpoints before the pod goes
(training/resilience/preemption.py); and its constants."""

from __future__ import annotations

from ray_train_eks.workload.spec import WORKER_TERMINATION_GRACE_SECONDS, RayWorkloadSpec

#: training.resilience.preflight.PRESTOP_CHECK_ENV (the chart does not import the training code): the GPU
#: worker pods' preStop command with ``check`` appended, as a JSON list.
PRESTOP_CHECK_ENV = "RAY_TRAIN_EKS_PRESTOP_CHECK"
#: Seconds of the grace kept for what follows the hook: Kubernetes' SIGTERM, on which ``ray
#: start`` drains its node again and stops (RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S, 30 s).
DRAIN_MARGIN_SECONDS = 30
#: The drain deadline on Spot nodes, from the hook's start: EC2 takes a Spot instance two minutes
#: after its interruption notice (EC2 User Guide, "Spot Instance interruption notices") whatever
#: the pod's grace, and the hook starts after the notice has gone through EventBridge, SQS and
#: Karpenter's drain (or EKS's node-group drain), seconds later. Ray counts a node's death as a
#: preemption only after its drain deadline (GCS ``InferDeathInfo``): a deadline past the
#: instance's end would charge the reclaim to ``--max-failures``. 90 s leaves up to 25 s for
#: the notice to reach the pod and 5 s for the node's last report.
SPOT_DRAIN_DEADLINE_SECONDS = 90
#: The GPU worker pods' preStop hook, run by the interpreter that runs the pod's Ray (the parent
#: of the pod's one raylet, ``ray start --block``: whatever ``python`` means on the image's PATH
#: does not matter) as ``-c DRAIN_HOOK <seconds>``:
#:
#: 1. it finds this pod's Ray node and GCS from its raylet's command line (``--node_id``,
#:    ``--gcs-address``; ray/_private/services.py ``find_node_ids``, ``find_gcs_addresses``), as
#:    ``ray drain-node`` would be told them (ray/scripts/scripts.py);
#: 2. drains the node in the GCS with reason preemption and a deadline ``seconds`` from now, so
#:    Ray Train's PreemptionWatcher tells the training, which writes and uploads a checkpoint,
#:    then moves the deadline to that moment (training/resilience/preemption.py): Ray Train restarts the
#:    run at once, counting a preemption (its controller's PREEMPTING state ends at the deadline);
#: 3. holds while the raylet runs, at most until the deadline: a drained node's raylet exits by
#:    itself once its workers are gone (ray/_private/node.py, the SIGTERM drain), and Kubernetes
#:    sends SIGTERM as soon as the hook returns.
#:
#: With ``check`` after the seconds it only prints what it found (the training's preflight runs
#: it so, in the pod, at job start: training/resilience/preflight.py). The node id must be hex: a binary id
#: is accepted and drains nothing.
DRAIN_HOOK = """\
import sys, time
import ray
import psutil  # Ray's own copy (ray/thirdparty_files), importable once ray is
from ray._private import services
from ray.core.generated import autoscaler_pb2
seconds, check = int(sys.argv[1]), sys.argv[2:] == ["check"]
nodes, gcs = sorted(services.find_node_ids()), sorted(services.find_gcs_addresses())
if len(nodes) != 1 or len(gcs) != 1:
    sys.exit("preStop: expected this pod's one Ray node and GCS, found nodes %s and GCS %s" % (nodes, gcs))
if check:
    print("preStop check: node %s GCS %s python %s ray %s" % (nodes[0], gcs[0], sys.executable, ray.__version__))
    sys.exit(0)
deadline_ms = int(time.time() * 1000) + seconds * 1000
accepted, why = ray._raylet.GcsClient(address=gcs[0]).drain_node(
    nodes[0], autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
    "Kubernetes is stopping the pod (preStop)", deadline_ms)
print("drain %s: accepted=%s %s; deadline in %d s" % (nodes[0], accepted, why, seconds), flush=True)
raylets = [p for p in psutil.process_iter(["name"]) if p.info["name"] == "raylet"]
gone, alive = psutil.wait_procs(raylets, timeout=max(0.0, deadline_ms / 1000 - time.time()))
print("drain %s: %s" % (nodes[0], "the raylet exited" if gone else "deadline reached"), flush=True)
"""
#: The shell part of the hook: the pod's Ray interpreter is the first word of the command line of
#: its raylet's parent, as the kernel ran ``ray``'s shebang (not ``/proc/<pid>/exe``: in a virtual
#: environment that is the base interpreter, without the environment's packages).
DRAIN_HOOK_LAUNCHER = """\
hook=$1; shift
for comm in /proc/[0-9]*/comm; do
  [ "$(cat "$comm" 2>/dev/null)" = raylet ] || continue
  parent=$(awk '/^PPid:/ {print $2}' "${comm%/comm}/status")
  exec "$(tr '\\0' '\\n' < "/proc/$parent/cmdline" | head -n 1)" -c "$hook" "$@"
done
echo "preStop: no raylet runs in this pod" >&2
exit 1
"""


def drain_hook_command(spec: RayWorkloadSpec) -> list[str]:
    """The GPU workers' preStop command: :data:`DRAIN_HOOK` with :func:`drain_deadline_seconds`."""
    return ["/bin/sh", "-c", DRAIN_HOOK_LAUNCHER, "ray-train-eks-prestop", DRAIN_HOOK, str(drain_deadline_seconds(spec))]


def drain_deadline_seconds(spec: RayWorkloadSpec) -> int:
    """Seconds from the hook's start to the node's drain deadline: ``drain_deadline_seconds``
    (Spot: :data:`SPOT_DRAIN_DEADLINE_SECONDS`), at most the grace period less the margin."""
    longest = spec.worker_termination_grace_seconds - DRAIN_MARGIN_SECONDS
    return longest if spec.drain_deadline_seconds is None else min(spec.drain_deadline_seconds, longest)


def drain_problems(spec: RayWorkloadSpec) -> list[str]:
    """The grace period and the drain deadline must leave the training time to checkpoint."""
    problems: list[str] = []
    if spec.worker_termination_grace_seconds < DRAIN_MARGIN_SECONDS + 30:
        problems.append(
            f"worker_termination_grace_seconds={spec.worker_termination_grace_seconds}: the preStop hook keeps "
            f"{DRAIN_MARGIN_SECONDS} s for SIGTERM and a checkpoint needs time; use at least {DRAIN_MARGIN_SECONDS + 30}, e.g. "
            f"{WORKER_TERMINATION_GRACE_SECONDS}")
    if spec.drain_deadline_seconds is not None and spec.drain_deadline_seconds < 30:
        problems.append(
            f"drain_deadline_seconds={spec.drain_deadline_seconds}: the training needs time to write and upload a "
            f"checkpoint after the notice; use at least 30, e.g. {SPOT_DRAIN_DEADLINE_SECONDS} on Spot, or None")
    return problems
