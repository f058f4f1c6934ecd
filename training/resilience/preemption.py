"""A preemption that costs one step: Ray's graceful path, used as Ray 2.58 built it.

- A node about to go is drained in Ray's GCS with reason ``DRAIN_NODE_REASON_PREEMPTION`` and a
  deadline: by the Ray worker pod's ``preStop`` hook (``ray_train_eks.workload.drain_hook``
  ``DRAIN_HOOK``) when Kubernetes stops the pod (a Spot reclaim, a replacement by Karpenter's
  consolidation, a node-group update), or by ``ray start`` itself on SIGTERM.
- Ray Train V2's ``PreemptionWatcher`` (``ray/train/v2/_internal/execution/preemption.py``)
  polls the draining nodes every 5 s and marks every worker; ``ray.train.get_preemption_info()``
  (``ray/train/v2/api/train_fn_utils.py``) reads the mark. It is a barrier that broadcasts rank
  0's view, so all ranks see the notice at the same step even though the watcher marks them
  one by one: no rank enters a checkpoint while another enters a training step.
- On a notice every rank writes one checkpoint and reports it with a synchronous upload (which
  also waits for every earlier asynchronous one: ``_wait_then_report`` in
  ``ray/train/v2/_internal/execution/context.py`` keeps reports in order); once every rank's
  report is in, rank 0 drains the preempted nodes again with the deadline *now*
  (:func:`release`). The GCS overwrites a node's drain request (``GcsNodeManager::SetNodeDraining``)
  and the watcher passes the new deadline on; the controller, waiting in its PREEMPTING state
  until every worker finished or the deadline passed (``controller.py``
  ``_handle_preempting_state``), then raises a ``PreemptionError`` at its next poll (2 s), charged
  to ``FailureConfig.max_preemption_failures`` (``failure_handling/default.py``), and restarts
  from the checkpoint just registered. The training stops but never returns (a run whose
  workers all return is FINISHED).
- Why the deadline moves: the GPUs would otherwise wait idle until the hook's deadline (up to
  270 s), and a node that dies before its deadline is an unexpected termination to the GCS
  (``InferDeathInfo`` takes a death as ``AUTOSCALER_DRAIN_PREEMPTED`` only after the deadline),
  charged to ``--max-failures``: on Spot, EC2 may take the instance before the hook's deadline.
  Once the deadline is now, whenever the node dies is after it.
- Once Ray Train has torn the workers down, the drained node is idle and its raylet exits by
  itself, reporting ``AUTOSCALER_DRAIN_PREEMPTED``; the hook, which waits for that, returns, and
  Kubernetes stops the pod.

A node that dies without notice still recovers, from the last periodic checkpoint, against
``max_failures``. A worker that finds its GPU broken takes its node out the same way, through a
drain (training/resilience/health.py), and records the fault first. What Ray Train counted, preemptions apart
from failures and hardware faults apart from both, reaches the training through :class:`RetryCounter`.
"""

from __future__ import annotations

import json
import os
import time

# The replacement deadline lives in its own module; its names stay importable from here.
from .replacement import REPLACEMENT_TIMEOUT_ENV, NoReplacement, lost, no_replacement_message, waited_s  # noqa: F401

#: What a checkpoint taken at a notice records in its train state.
PREEMPTED = "preempted"


def preemption_notice(step: int, every: int):
    """Ray Train's notice (a ``PreemptionInfo``), or None; asked every ``every`` steps
    (collective: every rank calls this at the same steps)."""
    if step % every:
        return None
    import ray.train

    return ray.train.get_preemption_info()


def seconds_left(notice) -> float | None:
    """Seconds until the notice's deadline (None: no deadline was given)."""
    if notice is None or notice.deadline_ms is None:
        return None
    return notice.deadline_ms / 1000 - time.time()


def release(notice) -> None:
    """Drain the notice's nodes again, with the deadline now: the checkpoint at the notice is
    uploaded and reported by every rank, so Ray Train may restart the run at once (rank 0 only)."""
    import ray
    from ray.core.generated import autoscaler_pb2

    gcs = ray._private.worker.global_worker.gcs_client  # ray._raylet.GcsClient; node ids in hex
    now_ms = int(time.time() * 1000)
    for node in notice.preempted_node_ids:
        try:
            accepted, why = gcs.drain_node(node, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                                           "the checkpoint at the notice is uploaded", now_ms)
        except Exception as error:  # noqa: BLE001 - the hook's deadline still ends the wait
            accepted, why = False, f"{type(error).__name__}: {error}"
        print(f"[train] node {node[:12]} released (drain deadline now): accepted={accepted} {why}".rstrip(), flush=True)


def hold_until_replaced() -> None:
    """Stop training and wait for Ray Train to tear this worker down (the node goes, or the
    deadline passes); it then restarts the run from the checkpoint just reported. Never
    returns on its own: returning would finish the run."""
    while True:
        time.sleep(5.0)


# ---------------------------------------------------------------------- what Ray Train counted

#: The environment variable through which :class:`RetryCounter` gives each new worker what Ray
#: Train counted so far in this run: ``{"preemptions": n, "failures": m, "hardware_faults": k,
#: "last": cause, "faults": [...]}`` (``last`` is "resize" after an elastic run's growth, which no budget pays).
RETRIES_ENV = "RAY_TRAIN_EKS_RAY_RETRIES"
#: What a run counts, each apart: Ray Train's two retry budgets, and the hardware faults (restarts
#: Ray charged to preemptions, or failures, on a node a worker recorded as broken).
COUNTS = ("preemptions", "failures", "hardware_faults")
#: The retry's cause, by count.
CAUSES = {"preemptions": "preemption", "failures": "failure", "hardware_faults": "hardware fault"}


def classify(error) -> str | None:
    """What Ray Train's failure policy charges ``error`` to: "preemption"
    (``max_preemption_failures``), "failure" (``max_failures``), or None (a controller error: a
    worker group that could not start, e.g. while capacity comes back). Ray's own predicate."""
    from ray.train.v2._internal.execution.failure_handling.default import _is_preemption_failure
    from ray.train.v2.api.exceptions import ControllerError

    if error is None or isinstance(error, ControllerError):
        return None
    return "preemption" if _is_preemption_failure(error) else "failure"


#: How long the controller waits, at a worker whose process ended without a Python error, for the
#: fault its NCCL log follower records (training/resilience/nccl_log.py: it polls every 0.2 s and
#: reaches the GCS in about a second): a no-notice node loss costs the run this much more.
FOLLOWER_GRACE_S = 10.0


class FailureBudgetSpent(RuntimeError):
    """More failures without notice than ``--max-failures`` allows (hardware faults not counted)."""


class HardwareBudgetSpent(RuntimeError):
    """More hardware faults than ``--max-hardware-faults`` allows: nodes failing this often point at
    something no new node fixes (a bad AMI or driver, the code itself), and each costs a node."""


class ProgramErrorStop(RuntimeError):
    """A worker found its CUDA error to be the program's (training/resilience/faults.py ``ProgramError``):
    the run stops with it instead of retrying what fails the same way everywhere."""


def check_hardware_budget(counts: dict, max_hardware_faults: int | None) -> None:
    """Raise :class:`HardwareBudgetSpent`, naming every fault, once they are more than the budget."""
    if max_hardware_faults is None or counts["hardware_faults"] <= max_hardware_faults:
        return
    raise HardwareBudgetSpent(
        f"{counts['hardware_faults']} hardware faults, more than --max-hardware-faults={max_hardware_faults} allows: "
        + "; ".join(f"{f.get('kind')} on node {f.get('node_name') or f.get('ray_node', '?')[:12]}: {str(f.get('reason', ''))[:200]}"
                    for f in counts["faults"])
        + ". Nodes failing this often point at something a new node does not fix (the AMI, the driver, the code); the "
        "checkpoints stay")


def program_error(error) -> str | None:
    """The message of a worker's ``ProgramError`` in a worker-group error, or None."""
    from .faults import PROGRAM_ERROR_MARK

    for failure in (getattr(error, "worker_failures", None) or {}).values():
        text = str(failure)
        if PROGRAM_ERROR_MARK in text:
            return text[text.index(PROGRAM_ERROR_MARK) + len(PROGRAM_ERROR_MARK):].strip().splitlines()[0]
    return None


def _capacity_trouble() -> list[str] | None:
    """Karpenter's NodeClaims' reasons, or None (no Karpenter, or not in a pod)."""
    from .kube import capacity_trouble

    try:
        return capacity_trouble()
    except Exception:  # noqa: BLE001 - the message without them
        return None


def died_without_a_word(error) -> bool:
    """Whether a worker-group error has a worker whose process ended with no Python error (killed,
    aborted, its node gone): a ``RayActorError``, as Ray Train's poll reports it
    (``worker_group/poll.py``, ``_is_preempted_actor`` unwraps it the same way)."""
    return any(worker_died(failure) for failure in (getattr(error, "worker_failures", None) or {}).values())


def worker_died(failure) -> bool:
    """Whether one worker's failure (a value of a worker-group error's ``worker_failures``) is its
    process or node gone, with no Python error: a ``RayActorError``."""
    from ray.exceptions import RayActorError
    from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError

    if isinstance(failure, WorkerHealthCheckFailedError):
        failure = failure.health_check_failure
    return isinstance(failure, RayActorError)


def _set_retries(text: str) -> None:
    os.environ[RETRIES_ENV] = text


def retries_seen() -> dict:
    """What Ray Train counted before this worker started (in this run's controller)."""
    seen = json.loads(os.environ.get(RETRIES_ENV) or "{}")
    return {**{count: 0 for count in COUNTS}, "last": None, "faults": [], **seen}


def new_faults(invocation_id: str, seen: set[str], wait_s: float) -> dict:
    """The hardware faults recorded in this invocation on nodes not in ``seen``, waiting up to
    ``wait_s`` for one to appear. An unreadable ledger reads as none (counted as Ray charged it)."""
    from .faults import faults_recorded

    deadline = time.monotonic() + wait_s
    while True:
        try:
            faults = {node: fault for node, fault in faults_recorded(invocation_id).items() if node not in seen}
        except Exception:  # noqa: BLE001
            faults = {}
        if faults or time.monotonic() >= deadline:
            return faults
        time.sleep(0.25)


def _program_error_recorded(invocation_id: str, attempt: int) -> str | None:
    """The program's error a follower recorded for this invocation's ``attempt``; unreadable: none."""
    from .faults import program_error_recorded

    try:
        return program_error_recorded(invocation_id, attempt)
    except Exception:  # noqa: BLE001
        return None


def _followed(invocation_id: str) -> bool:
    """Whether a follower may still record a fault for a worker of this invocation; unknown: yes."""
    from .faults import followed

    try:
        return followed(invocation_id)
    except Exception:  # noqa: BLE001
        return True


def retry_counter(invocation_id: str, max_failures: int | None = None, grace_s: float = FOLLOWER_GRACE_S,
                  replacement_timeout_s: float | None = None, max_hardware_faults: int | None = None):
    """A Ray Train callback (``RunConfig(callbacks=[...])``) that counts the controller's retries
    as its failure policy charges them (``classify``: ``DefaultFailurePolicy.make_decision``),
    at each transition to RESTARTING, RESCHEDULING or ERRORED, and gives the counts to every
    worker of each new worker group before it trains (``RETRIES_ENV``), with the size of the group
    before it (an elastic run's resize is said from it: training/resizing.py). A retry after a worker
    recorded a hardware fault in this invocation (training/resilience/faults.py, in Ray's key-value
    store) is counted as one, whatever budget Ray charged it to; at a worker that died without a
    word, it first waits up to ``grace_s`` for its follower's record, where a follower watches a
    worker of this invocation (a pod's; :func:`training.resilience.faults.followed`): elsewhere no
    record can come, and the restart goes ahead at once.

    ``max_failures``: the run's budget of failures without notice, kept here rather than by Ray
    (give Ray ``max_failures=-1``): Ray's policy charges every worker death that is not a drained
    node's to ``max_failures``, a GPU fault that torch's watchdog ended by SIGABRT among them,
    before anything else can run. Past the budget this callback raises, which the controller
    turns into a ``ControllerError`` that ends the run (``_run_controller_hook``: not retryable).

    ``replacement_timeout_s`` (:data:`REPLACEMENT_TIMEOUT_ENV`): when the worker group cannot start
    (Ray Train's start timeout, a ``ControllerError``) that long after the run lost a node (a
    preemption, a node lost without notice, a hardware fault: training/resilience/replacement.py), the
    run stops with :class:`NoReplacement`, naming the nodes and what to do.

    ``max_hardware_faults``: past it the run stops with :class:`HardwareBudgetSpent`, naming the
    faults. A worker's ``ProgramError`` (the same CUDA error on a second node) stops the run at once
    (:class:`ProgramErrorStop`)."""
    from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback

    class RetryCounter(RetryCounting, ControllerCallback, WorkerGroupCallback):
        pass

    return RetryCounter(invocation_id, max_failures=max_failures, grace_s=grace_s,
                        replacement_timeout_s=replacement_timeout_s, max_hardware_faults=max_hardware_faults)


class RetryCounting:
    """What :func:`retry_counter`'s callback does at the controller's hooks (Ray's callback classes are
    its other bases)."""

    def __init__(self, invocation_id: str, *, max_failures: int | None, grace_s: float, replacement_timeout_s: float | None,
                 max_hardware_faults: int | None) -> None:
        self.invocation_id, self.max_failures, self.grace_s = invocation_id, max_failures, grace_s
        self.replacement_timeout_s, self.max_hardware_faults = replacement_timeout_s, max_hardware_faults
        self.counts, self.nodes_seen = {**{count: 0 for count in COUNTS}, "last": None, "faults": []}, set()
        #: The losses and faults since a worker group last started: their nodes wait for a replacement.
        self.unreplaced: list[dict] = []
        #: The workers of the group that runs (None before the first starts).
        self.workers: int | None = None

    def after_controller_state_update(self, previous_state, current_state) -> None:
        """Count a retry as Ray charged it (or as the hardware fault it was); at a group that could not start, the deadline."""
        from ray.train.v2._internal.execution.controller.state import ResizingState

        if isinstance(current_state, ResizingState):  # an elastic run grows (training/resilience/elastic.py): no budget
            self.counts["last"] = "resize"
        error = getattr(current_state, "training_failed_error", None)
        cause = classify(error)
        if current_state is previous_state:
            return
        if cause is None:
            self.check_replacement(error)
            return
        invocation_id = self.invocation_id
        faults = new_faults(invocation_id, self.nodes_seen, self.grace_s if cause == "failure" and died_without_a_word(error)
                            and _followed(invocation_id) else 0)
        said = program_error(error) or (None if faults or cause != "failure" else  # or a follower's, for this attempt
                                        _program_error_recorded(invocation_id, sum(self.counts[c] for c in COUNTS)))
        if said:
            raise ProgramErrorStop(said)
        if faults:
            self.nodes_seen.update(faults)
            self.counts["faults"].extend(faults.values())
            self.unreplaced.extend(faults.values())
            count = "hardware_faults"
        else:
            count = "preemptions" if cause == "preemption" else "failures"
            self.unreplaced.append(lost_in(cause, error))  # a Spot reclaim or a node gone waits as a fault's node does
        self.counts[count] += 1
        self.counts["last"] = CAUSES[count]
        if count == "hardware_faults":
            check_hardware_budget(self.counts, self.max_hardware_faults)
        if count == "failures" and self.max_failures is not None and self.counts["failures"] > self.max_failures:
            raise FailureBudgetSpent(
                f"{self.counts['failures']} failures without notice, more than --max-failures={self.max_failures} "
                f"allows (preemptions and hardware faults are not counted); the last: {str(error)[:2000]}")

    def check_replacement(self, error) -> None:
        """At a worker group that could not start: stop if a node lost or taken out has waited too long."""
        from ray.train.v2.api.exceptions import ControllerError

        if not self.replacement_timeout_s or not self.unreplaced or not isinstance(error, ControllerError):
            return
        waited = waited_s(self.unreplaced)
        if waited > self.replacement_timeout_s:
            raise NoReplacement(no_replacement_message(self.unreplaced, waited, _capacity_trouble()))
        print(f"[train] no worker group yet: the node(s) the run lost {waited / 60:.0f} min ago have no replacement; "
              f"the run stops at {self.replacement_timeout_s / 60:.0f} min without one ({REPLACEMENT_TIMEOUT_ENV})", flush=True)

    def after_worker_group_start(self, worker_group) -> None:
        """The group is placed (Ray Train calls this once its placement group is ready): every node it
        needed is there. Its workers get the counts and the size of the group before it."""
        self.unreplaced = []
        self.counts["workers_before"], self.workers = self.workers, len(worker_group)
        worker_group.execute(_set_retries, json.dumps(self.counts))


def lost_in(cause: str, error) -> dict:
    """The loss record (training/resilience/replacement.py ``lost``) of a retry Ray charged to ``cause``:
    the nodes a preemption notice named (``PreemptionError.preemption_info``), or the ranks whose
    workers died without a Python error."""
    info = getattr(error, "preemption_info", None)
    failures = getattr(error, "worker_failures", None) or {}
    return lost(cause, nodes=list(info.preempted_node_ids) if info is not None else [],
                ranks=sorted(rank for rank, failure in failures.items() if worker_died(failure)))
