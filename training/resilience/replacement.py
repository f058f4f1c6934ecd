"""The replacement deadline: how long a run that lost nodes may wait for a worker group before it stops,
saying what it waited for and what to do (:class:`NoReplacement`).

Every lost node starts the clock, whatever took it (training/resilience/preemption.py ``RetryCounter``):

- a preemption (a Spot reclaim, a Kubernetes stop, a Capacity Block's end: a drain with notice, Ray
  Train's ``PreemptionError``), by the nodes the notice named;
- a node lost without notice (an instance failure, a Spot reclaim whose notice never reached the run:
  a worker that died with no Python error, in Ray Train's ``WorkerGroupError``), by its ranks;
- a node taken out for a hardware fault, by the fault a worker or its NCCL log follower recorded.

A worker group that starts (Ray Train calls back once its placement group is ready) ends the wait:
every node it needed was there. Until then Ray Train retries the start at each of its start timeouts
(``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S``, training/train.py), and at the first one past the deadline
the run stops. A fixed-size run and an elastic run below ``--min-nodes`` wait the same way; an elastic
run at or above its minimum starts on the nodes it has, so it never waits (training/resilience/elastic.py).
"""

from __future__ import annotations

import time

#: Set on the head (the driver's environment) in both capacity modes: how long after a node was lost
#: the run may wait for a worker group before it stops with :class:`NoReplacement` (a fixed node group
#: replaces a node taken out only by repair, and a lost instance only where EC2 has capacity; Karpenter may
#: find no capacity or quota for a new one). Checked when Ray Train's worker-group start times out.
REPLACEMENT_TIMEOUT_ENV = "RAY_TRAIN_EKS_REPLACEMENT_TIMEOUT_S"

#: What a lost node is called, by the cause Ray Train's failure policy charged (training/resilience/preemption.py ``classify``).
LOSSES = {"preemption": "preempted with notice (a Spot reclaim, a Kubernetes stop or a Capacity Block's end)",
          "failure": "lost without notice (the instance or its Ray pod ended)"}


class NoReplacement(RuntimeError):
    """A node the run lost has had no replacement for longer than the platform allows."""


def lost(cause: str, *, nodes: list[str], ranks: list[int], at: float | None = None) -> dict:
    """The record of nodes lost to ``cause`` ("preemption" or "failure") that now wait for a replacement:
    the Ray nodes a notice named, or the ranks whose workers died with them."""
    return {"lost": cause, "ray_nodes": list(nodes), "ranks": list(ranks), "time": time.time() if at is None else at}


def waited_s(unreplaced: list[dict]) -> float:
    """Seconds since the latest of the losses and faults that wait for a replacement."""
    return time.time() - max(record.get("time", 0) for record in unreplaced)


def no_replacement_message(unreplaced: list[dict], waited_s: float, claims: list[str] | None = None) -> str:
    """What stopped the run and what to do, naming each node lost or taken out (``unreplaced``: the
    retry counter's loss records, :func:`lost`, and hardware faults as training/resilience/faults.py
    records them); ``claims``: what Karpenter's NodeClaims say (training/resilience/kube.py
    ``capacity_trouble``), None under a managed node group."""
    faults = [record for record in unreplaced if "lost" not in record]
    if claims is not None:
        said = "; ".join(claims) if claims else ("no NodeClaim is pending and Karpenter said nothing about one: the NodePool's "
                                                   "limit may be spent (kubectl describe nodepool), or Karpenter is not running")
        why = (f"Karpenter launched none for the worker pod that replaces it: {said}. With no capacity for the type in the GPU AZ "
               "(InsufficientInstanceCapacity) or the vCPU quota spent, try later, raise the quota (Service Quotas), or use a "
               "capacity reservation; the GPU nodes are idle meanwhile, so the run stops rather than wait for its deadline.")
    elif faults:
        why = ("and nothing will: the GPU node group has a fixed size, and node repair replaces a node only once the EKS "
               "node monitoring agent reports it (a straggler, or a CUDA error the agent did not see, is never repaired; "
               "a reboot keeps the node's taint).")
    else:
        why = ("and none joined: the GPU node group's Auto Scaling group launches an instance for each one that ended, to keep "
               "its desired size, only where EC2 has capacity for the type in the GPU AZ (Spot, or a reservation that is full "
               "or has ended); its activity says why (aws autoscaling describe-scaling-activities --auto-scaling-group-name "
               "<the GPU node group's>). The GPU nodes are idle meanwhile, so the run stops rather than wait for its deadline.")
    what = "taken out of the run" if len(faults) == len(unreplaced) else "the run lost"
    lines = [f"no node took the place of the node(s) {what} {waited_s / 60:.0f} min ago, {why} "
             "The checkpoints stay; the job resumes from the last one when run again."]
    for record in unreplaced:
        lines.append(_loss_line(record) if "lost" in record else _fault_line(record))
    return "\n".join(lines)


def _loss_line(record: dict) -> str:
    when = time.strftime("%H:%M:%S UTC", time.gmtime(record.get("time", 0)))
    which = (f"node(s) {', '.join(node[:12] for node in record['ray_nodes'])}" if record.get("ray_nodes")
             else f"the node of rank(s) {', '.join(str(rank) for rank in record.get('ranks') or ()) or '?'}")
    return f"- {which}: {LOSSES.get(record['lost'], record['lost'])} at {when}; its worker pod waits Pending for a node"


def _fault_line(fault: dict) -> str:
    node, taint = fault.get("node_name") or fault.get("ray_node", "?"), fault.get("taint") or "ray-train-eks/gpu-unhealthy"
    return (f"- node {node}: {fault.get('kind')}: {fault.get('reason', '')[:300]}. If the node is healthy now "
            f"(rebooted, or a false alarm): kubectl taint node {node} {taint}- ; else have the node group replace "
            f"it: aws ec2 terminate-instances --instance-ids $(kubectl get node {node} -o "
            "jsonpath='{.spec.providerID}' | cut -d/ -f5)")
