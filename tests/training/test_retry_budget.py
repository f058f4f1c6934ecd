"""The run's budget of failures without notice (``--max-failures``), kept by the retry counter
(training/resilience/preemption.py) rather than by Ray: a restart after a recorded hardware fault is
never charged to it, a worker that died without a word waits for its follower's record, and the
failure past the budget ends the run. The controller's states and errors are Ray Train 2.58's own
classes, as its controller hands them to the callback; the fault ledger is a dict here (the
multi-node run in test_preemption.py reads it from Ray's key-value store)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from ray.exceptions import ActorDiedError
from ray.train.v2._internal.execution.controller.state import RestartingState, RunningState
from ray.train.v2.api.exceptions import WorkerGroupError

from training.resilience import faults
from training.resilience.preemption import FailureBudgetSpent, died_without_a_word, retry_counter


def _failure(error: Exception) -> RestartingState:
    return RestartingState(training_failed_error=WorkerGroupError("rank 1 failed", {1: error}))


@pytest.fixture
def ledger(monkeypatch):
    """The fault records; a follower watches a worker of the invocation (as in a pod) unless a
    test empties ``followed``."""
    recorded = Ledger()
    monkeypatch.setattr(faults, "faults_recorded", lambda invocation: dict(recorded))
    monkeypatch.setattr(faults, "followed", lambda invocation: invocation in recorded.followers)
    return recorded


class Ledger(dict):
    """Fault records by node, and the invocations whose workers a follower watches."""

    def __init__(self) -> None:
        super().__init__()
        self.followers = {"inv"}


def test_failures_past_the_budget_end_the_run_and_hardware_faults_are_not_charged(ledger):
    counter = retry_counter("inv", max_failures=1, grace_s=0)
    running = RunningState()
    ledger["node-a"] = {"kind": "gpu error", "reason": "uncorrectable ECC error"}
    counter.after_controller_state_update(running, _failure(ActorDiedError()))  # the GPU: not charged
    counter.after_controller_state_update(running, _failure(RuntimeError("a bug")))  # the budget's one failure
    assert (counter.counts["hardware_faults"], counter.counts["failures"]) == (1, 1)
    with pytest.raises(FailureBudgetSpent, match=r"(?s)2 failures without notice, more than --max-failures=1 .*rank 1 failed"):
        counter.after_controller_state_update(running, _failure(RuntimeError("a bug")))


def test_a_worker_that_died_without_a_word_waits_for_its_followers_record(ledger):
    """The follower records the fault a moment after the controller saw the worker die (it must
    first reach the GCS): the counter waits for it, and the restart is a hardware fault."""
    counter = retry_counter("inv", max_failures=0, grace_s=10)
    timer = threading.Timer(1.0, lambda: ledger.update({"node-b": {"kind": "gpu error"}}))
    timer.start()
    started = time.monotonic()
    counter.after_controller_state_update(RunningState(), _failure(ActorDiedError()))
    waited = time.monotonic() - started
    assert counter.counts["hardware_faults"] == 1 and counter.counts["failures"] == 0
    assert 0.9 < waited < 5, waited


def test_a_worker_that_died_where_no_follower_watches_is_charged_at_once(ledger):
    """Outside a pod (a local run) no follower watches the workers, so no record can come: the
    restart goes ahead without the wait, charged as the failure it is."""
    ledger.followers.clear()
    counter = retry_counter("inv", max_failures=1, grace_s=10)
    started = time.monotonic()
    counter.after_controller_state_update(RunningState(), _failure(ActorDiedError()))
    assert time.monotonic() - started < 1
    assert (counter.counts["failures"], counter.counts["hardware_faults"]) == (1, 0)


def test_a_python_error_is_charged_at_once(ledger):
    """A Python error is no process death: no follower will record anything, so no wait."""
    counter = retry_counter("inv", max_failures=0, grace_s=10)
    started = time.monotonic()
    with pytest.raises(FailureBudgetSpent):
        counter.after_controller_state_update(RunningState(), _failure(ValueError("bad row")))
    assert time.monotonic() - started < 1
    assert not died_without_a_word(WorkerGroupError("x", {0: ValueError("bad row")}))
    assert died_without_a_word(WorkerGroupError("x", {0: ValueError("collateral"), 1: ActorDiedError()}))


def test_a_node_never_replaced_stops_the_run_naming_the_node_and_what_to_do(ledger, monkeypatch):
    """A fixed-size node group: a straggler (which the monitoring agent does not report) is never
    repaired, so the next worker group cannot start. At Ray Train's start timeout past the bound,
    the run stops with the node's name and the two ways on; before the bound it waits."""
    from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError
    from ray.train.v2._internal.execution.controller.state import ReschedulingState
    from ray.train.v2.api.exceptions import ControllerError

    from training.resilience.preemption import NoReplacement

    counter = retry_counter("inv", max_failures=0, grace_s=0, replacement_timeout_s=1500)
    now = time.time()
    ledger["raynode-b"] = {"kind": "straggler", "reason": "matmul at 61% of the median", "node_name": "ip-10-0-1-7",
                           "ray_node": "raynode-b", "gpu": "3", "rank": 5, "time": now - 900,
                           "taint": "ray-train-eks/gpu-unhealthy"}
    counter.after_controller_state_update(RunningState(), _failure(ActorDiedError()))  # the restart: a hardware fault
    timed_out = ReschedulingState(training_failed_error=ControllerError(WorkerGroupStartupTimeoutError(num_workers=2)))
    counter.after_controller_state_update(RunningState(), timed_out)  # 15 min after the fault: still waiting
    monkeypatch.setattr(time, "time", lambda: now + 900)  # the next start timeout, 30 min after the fault
    with pytest.raises(NoReplacement) as stopped:
        counter.after_controller_state_update(RunningState(), timed_out)
    message = str(stopped.value)
    assert "taken out of the run 30 min ago" in message and "node ip-10-0-1-7: straggler: matmul at 61%" in message
    assert "kubectl taint node ip-10-0-1-7 ray-train-eks/gpu-unhealthy-" in message
    assert "aws ec2 terminate-instances" in message and "resumes from the last one" in message
    assert "the GPU node group has a fixed size" in message
    # Without a bound, it waits as long as it takes.
    waits = retry_counter("inv", max_failures=0, grace_s=0)
    waits.after_controller_state_update(RunningState(), _failure(ActorDiedError()))
    waits.after_controller_state_update(RunningState(), timed_out)
    assert waits.counts["hardware_faults"] == 1


def test_a_fault_whose_node_was_replaced_never_stops_the_run_later(ledger, monkeypatch):
    """The bound counts from a fault whose node still waits: once a worker group started after it
    (Ray Train calls back only when its placement group is ready), a later start timeout, say while
    Spot capacity comes back hours on, is no reason to stop."""
    from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError
    from ray.train.v2._internal.execution.controller.state import ReschedulingState
    from ray.train.v2.api.exceptions import ControllerError

    counter = retry_counter("inv", max_failures=0, grace_s=0, replacement_timeout_s=1500)
    now = time.time()
    ledger["raynode-b"] = {"kind": "gpu error", "node_name": "ip-10-0-1-7", "time": now - 7200}
    counter.after_controller_state_update(RunningState(), _failure(ActorDiedError()))
    started = type("WorkerGroup", (list,), {"execute": lambda self, *args: None})(range(2))
    counter.after_worker_group_start(started)  # the replacement came; the run trained on
    timed_out = ReschedulingState(training_failed_error=ControllerError(WorkerGroupStartupTimeoutError(num_workers=2)))
    counter.after_controller_state_update(RunningState(), timed_out)  # two hours after the fault: no stop
    assert counter.counts["hardware_faults"] == 1


def test_under_karpenter_a_replacement_that_never_comes_stops_the_run_with_karpenters_reason(ledger, monkeypatch):
    """Karpenter mode has the bound too (charts give the head REPLACEMENT_TIMEOUT_ENV in both modes): a
    NodeClaim EC2 has no capacity for stays not Launched; at the start timeout past the bound the run
    stops naming the node taken out and what Karpenter's NodeClaim says, read as the pod reads it."""
    from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError
    from ray.train.v2._internal.execution.controller.state import ReschedulingState
    from ray.train.v2.api.exceptions import ControllerError

    from fake_kube import FakeKubernetes
    from training.resilience.kube import API_ENV
    from training.resilience.preemption import NoReplacement

    from datetime import datetime, timezone

    kube = FakeKubernetes("ip-10-0-1-7")
    # As Karpenter leaves it: the NodeClaim EC2 refused is deleted, its event stays; a new one waits.
    kube.nodeclaims = [{"metadata": {"name": "gpu-x7k2p"}, "status": {"conditions": [
        {"type": "Launched", "status": "Unknown", "reason": "AwaitingReconciliation", "message": "object is awaiting reconciliation"}]}}]
    kube.events = [{"type": "Warning", "reason": "InsufficientCapacityError", "involvedObject": {"kind": "NodeClaim", "name": "gpu-4q9zt"},
                    "lastTimestamp": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                    "message": "NodeClaim gpu-4q9zt event: creating instance, insufficient capacity, all requests for "
                               "p5.48xlarge in us-east-1b failed: InsufficientInstanceCapacity"},
                   {"type": "Warning", "reason": "InsufficientCapacityError", "involvedObject": {"kind": "NodeClaim", "name": "old"},
                    "lastTimestamp": "2026-01-01T00:00:00Z", "message": "a day-old event"}]
    monkeypatch.setenv(API_ENV, kube.url)
    counter = retry_counter("inv", max_failures=0, grace_s=0, replacement_timeout_s=1500)
    now = time.time()
    ledger["raynode-b"] = {"kind": "gpu error", "reason": "uncorrectable ECC error", "node_name": "ip-10-0-1-7",
                           "ray_node": "raynode-b", "time": now - 1800, "taint": "ray-train-eks/gpu-unhealthy"}
    counter.after_controller_state_update(RunningState(), _failure(ActorDiedError()))
    timed_out = ReschedulingState(training_failed_error=ControllerError(WorkerGroupStartupTimeoutError(num_workers=2)))
    with pytest.raises(NoReplacement) as stopped:
        counter.after_controller_state_update(RunningState(), timed_out)
    message = str(stopped.value)
    assert ("Karpenter launched none for the worker pod that replaces it: NodeClaim gpu-4q9zt: InsufficientCapacityError: "
            "NodeClaim gpu-4q9zt event: creating instance, insufficient capacity") in message
    assert "InsufficientInstanceCapacity" in message and "node ip-10-0-1-7: gpu error" in message
    assert "NodeClaim gpu-x7k2p not launched (AwaitingReconciliation" in message and "a day-old event" not in message
    kube.server.shutdown()


@pytest.mark.parametrize("loss", ["a spot reclaim", "a node lost without notice"])
def test_a_lost_node_never_replaced_stops_the_run_at_the_deadline_whatever_took_it(ledger, monkeypatch, loss):
    """The deadline counts from every loss, not only from a node taken out for a hardware fault: a Spot
    reclaim (Ray Train's ``PreemptionError``, naming the node) or a node lost without notice (a worker that
    died with no Python error, no fault recorded) whose replacement never comes would otherwise keep the
    other nodes idle until the job's ``activeDeadlineSeconds``. A fixed-size run and an elastic run below
    its minimum wait alike (the counter is the same); once a worker group started, nothing waits."""
    from ray.train import PreemptionInfo
    from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError
    from ray.train.v2._internal.execution.controller.state import ReschedulingState
    from ray.train.v2.api.exceptions import ControllerError, PreemptionError

    from training.resilience import preemption
    from training.resilience.preemption import NoReplacement

    ledger.followers.clear()  # outside a pod: no fault record can come, no wait for one
    monkeypatch.setattr(preemption, "_capacity_trouble", lambda: None)  # a managed node group
    error = (PreemptionError(PreemptionInfo(deadline_ms=None, preempted_node_to_ranks={"5f1c0e9a77d2aa": [2, 3]}))
             if loss == "a spot reclaim" else WorkerGroupError("rank 3 died", {3: ActorDiedError(), 2: RuntimeError("peer")}))
    counter = retry_counter("inv", max_failures=5, grace_s=10, replacement_timeout_s=1500)
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now)
    counter.after_controller_state_update(RunningState(), RestartingState(training_failed_error=error))
    timed_out = ReschedulingState(training_failed_error=ControllerError(WorkerGroupStartupTimeoutError(num_workers=4)))
    monkeypatch.setattr(time, "time", lambda: now + 900)
    counter.after_controller_state_update(RunningState(), timed_out)  # the first placement wait: 15 min, waits on
    monkeypatch.setattr(time, "time", lambda: now + 1800)
    with pytest.raises(NoReplacement) as stopped:
        counter.after_controller_state_update(RunningState(), timed_out)
    message = str(stopped.value)
    assert message.startswith("no node took the place of the node(s) the run lost 30 min ago, and none joined: the GPU "
                              "node group's Auto Scaling group launches an instance for each one that ended")
    assert "aws autoscaling describe-scaling-activities" in message and "resumes from the last one" in message
    assert ("- node(s) 5f1c0e9a77d2: preempted with notice (a Spot reclaim, a Kubernetes stop or a Capacity Block's end)"
            if loss == "a spot reclaim" else "- the node of rank(s) 3: lost without notice") in message
    assert (counter.counts["preemptions"], counter.counts["failures"]) == ((1, 0) if loss == "a spot reclaim" else (0, 1))
    # Placed again (the replacement came): a later start timeout is no reason to stop.
    counter.after_worker_group_start(type("WorkerGroup", (list,), {"execute": lambda self, *args: None})(range(4)))
    monkeypatch.setattr(time, "time", lambda: now + 7200)
    counter.after_controller_state_update(RunningState(), timed_out)


def test_both_capacity_modes_bound_the_wait_for_a_replacement():
    from ray_train_eks.config import PlatformConfig

    for mode in ("nodegroup", "karpenter"):
        assert PlatformConfig.from_context({"gpuCapacity": mode}, environ={}).workload_spec().replacement_timeout_s == 1500


def test_hardware_faults_past_their_budget_stop_the_run_naming_them(ledger):
    """--max-hardware-faults (default 2): a third node taken out stops the run, naming each fault,
    instead of buying nodes until the job's deadline."""
    from training.resilience.preemption import HardwareBudgetSpent

    counter = retry_counter("inv", max_failures=0, grace_s=0, max_hardware_faults=2)
    for index, node in enumerate(("ip-10-0-1-5", "ip-10-0-1-6", "ip-10-0-1-7")):
        ledger[f"raynode-{index}"] = {"kind": "gpu error", "reason": "GPU lost (XID 79: fallen off the bus)", "node_name": node}
        if index < 2:
            counter.after_controller_state_update(RunningState(), _failure(ActorDiedError()))
    with pytest.raises(HardwareBudgetSpent) as stopped:
        counter.after_controller_state_update(RunningState(), _failure(ActorDiedError()))
    message = str(stopped.value)
    assert "3 hardware faults, more than --max-hardware-faults=2 allows" in message
    assert all(f"gpu error on node {node}" in message for node in ("ip-10-0-1-5", "ip-10-0-1-6", "ip-10-0-1-7"))


def test_a_workers_program_error_stops_the_run_without_a_retry(ledger):
    """A worker that found its CUDA error on a second node raises ProgramError; the controller's
    counter ends the run with its message rather than charge a retry that fails the same way."""
    from training.resilience.faults import ProgramError
    from training.resilience.preemption import ProgramErrorStop

    counter = retry_counter("inv", max_failures=5, grace_s=0)
    error = ProgramError("unspecified launch failure on node ip-10-0-1-6 (rank 4), as before on node(s) ip-10-0-1-5")
    with pytest.raises(ProgramErrorStop, match="as before on node\\(s\\) ip-10-0-1-5"):
        counter.after_controller_state_update(RunningState(), _failure(RuntimeError(f"worker raised: {error}")))
    assert counter.counts["hardware_faults"] == 0


class SuspectLedger:
    """Ray's key-value store as faults.record_suspect uses it (a stand-in: no Ray here): put-if-absent, list by prefix."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}

    def _internal_kv_put(self, key, value, overwrite=True, namespace=None):
        if overwrite or key not in self.values:
            self.values[key] = value

    def _internal_kv_list(self, prefix, namespace=None):
        return [key.encode() for key in self.values if key.startswith(prefix)]


def test_an_ambiguous_cuda_error_is_judged_by_where_it_comes_back(monkeypatch):
    """A kernel bug that shows as an unspecified launch failure fails every rank of every node in
    the same step: in that attempt no rank reads another as an earlier time (two ranks of node A,
    one of node B), so it is retried as a failure; when it comes back in the next attempt it has
    followed the code to another node: ProgramError, no node out. An error that comes back on its
    node alone follows the node: hardware. The key-value store and the Ray node are stand-ins here;
    the classification, the keys and the attempt count are the production code's."""
    import json
    import types

    import ray
    from ray.experimental import internal_kv

    from training.loop import judge_cuda_error
    from training.resilience.faults import ProgramError
    from training.resilience.preemption import RETRIES_ENV

    kv = SuspectLedger()
    for name in ("_internal_kv_put", "_internal_kv_list"):
        monkeypatch.setattr(internal_kv, name, getattr(kv, name))
    monkeypatch.setattr(ray, "get_runtime_context", lambda: types.SimpleNamespace(get_node_id=lambda: "raynode-x"))

    def fails(node: str, rank: int, attempt: int, address: str = "7f00aa"):
        monkeypatch.setenv("RAY_TRAIN_EKS_NODE_NAME", node)
        monkeypatch.setenv(RETRIES_ENV, json.dumps({"failures": attempt}))
        error = RuntimeError(f"CUDA error: unspecified launch failure at 0x{address}\nCUDA kernel errors might be "
                             "asynchronously reported")
        return judge_cuda_error(types.SimpleNamespace(invocation_id="inv", rank=rank), error)

    assert [fails("node-a", 0, 0), fails("node-a", 1, 0, "7f00bb"), fails("node-b", 2, 0)] == [None, None, None]
    with pytest.raises(ProgramError, match="as in an earlier attempt on node\\(s\\) node-b: the same error on another node"):
        fails("node-a", 0, 1)
    # Another run's fault (another invocation's keys aside): on one node only, it comes back there.
    kv.values.clear()
    assert fails("node-c", 0, 0) is None
    assert "a second time on this node" in fails("node-c", 1, 1)
    # The program's own errors are never a node's, the device's always.
    worker = types.SimpleNamespace(invocation_id="inv", rank=3)
    assert judge_cuda_error(worker, RuntimeError("CUDA error: an illegal memory access was encountered")) is None
    assert "ECC" in judge_cuda_error(worker, RuntimeError("CUDA error: uncorrectable ECC error encountered"))


def test_a_program_error_crosses_to_the_controller_with_its_mark_once():
    import pickle

    from training.resilience.faults import PROGRAM_ERROR_MARK, ProgramError

    error = pickle.loads(pickle.dumps(ProgramError("the same error on another node")))
    assert str(error) == f"{PROGRAM_ERROR_MARK} the same error on another node"


def test_a_programs_error_that_comes_back_after_the_restart_stops_the_run(monkeypatch):
    """An illegal address (the program's, by CUDA's documentation) never takes a node out; it is
    retried once from the last checkpoint, and when it comes back in the next attempt, on any
    node, the run stops with it instead of spending --max-failures on a deterministic bug."""
    import json
    import types

    from ray.experimental import internal_kv

    from training.loop import judge_cuda_error
    from training.resilience.faults import ProgramError
    from training.resilience.preemption import RETRIES_ENV

    kv = SuspectLedger()
    for name in ("_internal_kv_put", "_internal_kv_list"):
        monkeypatch.setattr(internal_kv, name, getattr(kv, name))

    def fails(node: str, rank: int, attempt: int, step: int, message: str = "an illegal memory access was encountered"):
        monkeypatch.setenv("RAY_TRAIN_EKS_NODE_NAME", node)
        monkeypatch.setenv(RETRIES_ENV, json.dumps({"failures": attempt}))
        error = RuntimeError(f"CUDA error: {message}\nCUDA kernel errors might be asynchronously reported")
        return judge_cuda_error(types.SimpleNamespace(invocation_id="inv", rank=rank), error, step=step)

    assert [fails("node-a", 0, 0, 6), fails("node-b", 1, 0, 6)] == [None, None]  # every rank, one attempt: retried
    with pytest.raises(ProgramError, match="at step 6, as before the restart from the last checkpoint \\(on node\\(s\\) node-a, node-b\\)"):
        fails("node-b", 1, 1, 6)
    # Out of memory at another step each time (fragmentation, another process on the GPU): retried.
    assert fails("node-a", 0, 2, 9, "out of memory") is None
    assert fails("node-a", 0, 3, 14, "out of memory") is None


class FakeGcs:
    """What the follower reaches through ``ray._raylet.GcsClient``: its key-value calls, on a dict
    shared by every "process" of the test (the cluster's GCS)."""

    values: dict[bytes, bytes] = {}

    def __init__(self, address: str) -> None:
        self.address = address

    def internal_kv_put(self, key, value, overwrite, namespace):
        if overwrite or (namespace, key) not in self.values:
            self.values[(namespace, key)] = value
        return 0

    def internal_kv_keys(self, prefix, namespace):
        return [key for ns, key in self.values if ns == namespace and key.startswith(prefix)]

    def internal_kv_get(self, key, namespace):
        return self.values.get((namespace, key))


def test_the_follower_judges_an_ambiguous_error_a_watchdog_abort_leaves_where_it_comes_back(monkeypatch, capsys):
    """torch's watchdog ends a worker at an unspecified launch failure inside a collective (SIGABRT:
    no Python of the worker runs): its follower judges the line as the worker would. Every rank of
    nodes A and B hit it in the first attempt: not known, no node out; in the next attempt node B
    has it again after node A had it: the program's, recorded for the controller, which stops the
    run (ProgramErrorStop) instead of a restart, with no node out. A fault that comes back on its
    own node alone takes that node out. The GCS is a dict here; the multi-node run in
    test_preemption.py delivers the program's error through real Ray nodes."""
    import io
    import json

    import ray._raylet

    from training.resilience import nccl_log
    from training.resilience.preemption import RETRIES_ENV, ProgramErrorStop

    FakeGcs.values = {}
    monkeypatch.setattr(ray._raylet, "GcsClient", FakeGcs)
    monkeypatch.delenv("RAY_TRAIN_EKS_UNHEALTHY_TAINT", raising=False)
    taken = []
    monkeypatch.setattr(nccl_log, "take_out_of_the_run", lambda where, reason: taken.append((where["node_name"], reason)))
    watchdog = ("[rank{rank}]:[E ProcessGroupNCCL.cpp:1595] [PG ID 0 PG GUID 0(default_pg) Rank {rank}] Process group "
                "watchdog thread terminated with exception: CUDA error: unspecified launch failure")

    def aborted(node: str, rank: int, attempt: int, invocation: str = "inv") -> str:
        monkeypatch.setenv(RETRIES_ENV, json.dumps({"failures": attempt}))
        follower = nccl_log.Follower(None, os.getpid(), every_line=False, take_out={
            "invocation_id": invocation, "gcs_address": "head:6379", "ray_node": "ab" * 14, "node_name": node, "rank": rank})
        out = io.StringIO()
        follower.act([f"host-{node}:{rank}:{rank} NCCL WARN Cuda failure 719 'unspecified launch failure'",
                      watchdog.format(rank=rank)], out)
        return out.getvalue()

    assert "not known to be the GPU's" in aborted("node-a", 0, 0) and "not known" in aborted("node-b", 1, 0)
    said = aborted("node-b", 1, 1)
    assert "as in an earlier attempt on node(s) node-a: the same error on another node follows the code" in said
    assert taken == []
    kv_of = faults._kv  # the controller reads the store through its own connection: the same dict here
    monkeypatch.setattr(faults, "_kv", lambda gcs=None: kv_of(gcs or FakeGcs("head:6379")))
    counter = retry_counter("inv", max_failures=5, grace_s=0)
    counter.after_controller_state_update(RunningState(), _failure(ActorDiedError()))  # attempt 0: a failure
    with pytest.raises(ProgramErrorStop, match="the same error on another node follows the code"):
        counter.after_controller_state_update(RunningState(), _failure(ActorDiedError()))  # attempt 1: recorded
    # Another run: the same fault twice on one node follows the node.
    aborted("node-c", 0, 0, "inv-2")
    aborted("node-c", 1, 1, "inv-2")
    assert [node for node, _ in taken] == ["node-c"] and "a second time on this node" in taken[0][1]


def test_the_follower_stops_a_run_whose_program_error_a_watchdog_abort_left_twice(monkeypatch):
    """An illegal address under FSDP ends the worker through torch's watchdog (SIGABRT), so the
    loop's own judgment never runs: the follower reads it in the log, takes no node out, and when
    the attempt before ended the same way records the program's error for the controller."""
    import io
    import json

    import ray._raylet

    from training.resilience import nccl_log
    from training.resilience.preemption import RETRIES_ENV, ProgramErrorStop

    FakeGcs.values = {}
    monkeypatch.setattr(ray._raylet, "GcsClient", FakeGcs)
    taken = []
    monkeypatch.setattr(nccl_log, "take_out_of_the_run", lambda where, reason: taken.append(where))
    kv_of = faults._kv
    monkeypatch.setattr(faults, "_kv", lambda gcs=None: kv_of(gcs or FakeGcs("head:6379")))
    counter = retry_counter("inv", max_failures=5, grace_s=0)

    def aborted(node: str, attempt: int) -> str:
        monkeypatch.setenv(RETRIES_ENV, json.dumps({"failures": attempt}))
        follower = nccl_log.Follower(None, os.getpid(), every_line=False, take_out={
            "invocation_id": "inv", "gcs_address": "head:6379", "ray_node": "cd" * 14, "node_name": node, "rank": 0})
        out = io.StringIO()
        follower.act(["[rank0]:[E ProcessGroupNCCL.cpp:1595] Process group watchdog thread terminated with exception: "
                      "CUDA error: an illegal memory access was encountered"], out)
        return out.getvalue()

    assert "the program's error, not the GPU's; no node is taken out" in aborted("node-a", 0)
    counter.after_controller_state_update(RunningState(), _failure(ActorDiedError()))  # attempt 0: retried
    assert "retrying does not make it go away" in aborted("node-b", 1)
    with pytest.raises(ProgramErrorStop, match="an illegal memory access .* as in the attempt before"):
        counter.after_controller_state_update(RunningState(), _failure(ActorDiedError()))
    assert taken == []
