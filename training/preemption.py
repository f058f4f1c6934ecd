"""A preemption that costs one step: Ray's graceful path, used as Ray 2.58 built it.

- A node about to go is drained in Ray's GCS with reason ``DRAIN_NODE_REASON_PREEMPTION`` and a
  deadline: by the Ray worker pod's ``preStop`` hook (``ray_train_eks.charts.ray_workload``
  ``DRAIN_HOOK``) when Kubernetes stops the pod (a Spot reclaim through Karpenter's
  interruption queue, a drift replacement, a node-group update), or by ``ray start`` itself
  on SIGTERM.
- Ray Train V2's ``PreemptionWatcher`` (``ray/train/v2/_internal/execution/preemption.py``)
  polls the draining nodes every 5 s and marks every worker; ``ray.train.get_preemption_info()``
  (``ray/train/v2/api/train_fn_utils.py``) reads the mark. It is a barrier that broadcasts rank
  0's view, so all ranks see the notice at the same step even though the watcher marks them
  one by one: no rank enters a checkpoint while another enters a training step.
- On a notice every rank writes one checkpoint, reports it, and stops training but does not
  return: a run whose workers all return is FINISHED (``controller.py``, the PREEMPTING
  state), not restarted. Ray Train tears the workers down when the node goes or the deadline
  passes, counts a ``PreemptionError`` against ``FailureConfig.max_preemption_failures`` (apart
  from ``max_failures``), waits for capacity (worker-group start timeouts count against
  ``controller_failure_limit``, unlimited), and resumes from that checkpoint.

A node that dies without notice still recovers, from the last periodic checkpoint, against
``max_failures``.
"""

from __future__ import annotations

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


def hold_until_replaced() -> None:
    """Stop training and wait for Ray Train to tear this worker down (the node goes, or the
    deadline passes); it then restarts the run from the checkpoint just reported. Never
    returns on its own: returning would finish the run."""
    while True:
        time.sleep(5.0)
