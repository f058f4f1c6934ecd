"""A preemption that costs one step: Ray's graceful path, used as Ray 2.58 built it.

- A node about to go is drained in Ray's GCS with reason ``DRAIN_NODE_REASON_PREEMPTION`` and a
  deadline: by the Ray worker pod's ``preStop`` hook (``ray_train_eks.charts.drain_hook``
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
#: "last": cause, "faults": [...]}``.
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


def _set_retries(text: str) -> None:
    os.environ[RETRIES_ENV] = text


def retries_seen() -> dict:
    """What Ray Train counted before this worker started (in this run's controller)."""
    seen = json.loads(os.environ.get(RETRIES_ENV) or "{}")
    return {**{count: 0 for count in COUNTS}, "last": None, "faults": [], **seen}


def retry_counter(invocation_id: str):
    """A Ray Train callback (``RunConfig(callbacks=[...])``) that counts the controller's retries
    as its failure policy charges them (``classify``: ``DefaultFailurePolicy.make_decision``),
    at each transition to RESTARTING, RESCHEDULING or ERRORED, and gives the counts to every
    worker of each new worker group before it trains (``RETRIES_ENV``). A retry after a worker
    recorded a hardware fault in this invocation (training/resilience/health.py, in Ray's key-value store)
    is counted as one, whatever budget Ray charged it to."""
    from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback

    from .health import faults_recorded

    class RetryCounter(ControllerCallback, WorkerGroupCallback):
        def __init__(self) -> None:
            self.counts = {**{count: 0 for count in COUNTS}, "last": None, "faults": []}
            self.nodes_seen: set[str] = set()

        def after_controller_state_update(self, previous_state, current_state) -> None:
            cause = classify(getattr(current_state, "training_failed_error", None))
            if cause is None or current_state is previous_state:
                return
            try:
                faults = {node: fault for node, fault in faults_recorded(invocation_id).items() if node not in self.nodes_seen}
            except Exception:  # noqa: BLE001 - counted as Ray charged it
                faults = {}
            if faults:
                self.nodes_seen.update(faults)
                self.counts["faults"].extend(faults.values())
                count = "hardware_faults"
            else:
                count = "preemptions" if cause == "preemption" else "failures"
            self.counts[count] += 1
            self.counts["last"] = CAUSES[count]

        def after_worker_group_start(self, worker_group) -> None:
            worker_group.execute(_set_retries, json.dumps(self.counts))

    return RetryCounter()
