"""A preemption costs one step and is counted as one, in the order EKS stops a node, on Ray's own
multi-node cluster: a head without CPUs (the driver, Ray Train's controller) and two worker
nodes of one CPU, each run as in its pod (``pod_node.py`` beside this file: ``ray start --block``
in a PID namespace of its own), one training worker each; token authentication on, as in the
pods. The GPU worker pods' preStop hook runs as the kubelet runs it: the pod template's own
command, in the node's namespace, finding its interpreter, node and GCS by itself.

- A Spot reclaim: the hook drains the node (deadline 40 s), the training checkpoints at the
  notice, uploads it and releases the node; EC2 then takes the instance (every process stops at
  once, 20 s after the notice: before the hook's deadline).
- A node stopped by Kubernetes (a consolidation, a node-group update): the hook drains, the
  training checkpoints and releases the node, the hook returns once its raylet is gone, and the
  kubelet's SIGTERM stops ``ray start``: the node goes after the deadline.

Both with ``--max-failures 0``: the run ends at the loss of an uninterrupted one, with the one
preemption and no failure that Ray Train counted. A node killed without notice still recovers,
from the last periodic checkpoint, counted as a failure."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from ray_train_eks.charts import RayWorkloadSpec, worker_group_spec
from fake_kube import FakeKubernetes
from pod_node import PodNode

pytestmark = pytest.mark.distributed
#: 12 steps of a second (a pause per step) so the test can act midway; checkpoints every 4.
ARGS = ["--preset", "tiny-cpu", "--max-steps", "12", "--checkpoint-every", "4", "--keep-checkpoints", "6",
        "--max-samples", "400", "--step-pause-s", "1", "--eval-fraction", "0"]
#: The GCS declares a silent node dead after about 3 s (defaults: 3 s x 5 misses, 10 s timeouts).
FAST_HEALTH_CHECKS = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "1000",
                      "RAY_health_check_failure_threshold": "3"}


def prestop_command(drain_deadline_seconds: int) -> list[str]:
    """The GPU worker pod template's preStop command, as the chart writes it."""
    template = worker_group_spec(RayWorkloadSpec(drain_deadline_seconds=drain_deadline_seconds))["template"]
    return template["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    import ray
    from ray.cluster_utils import Cluster

    overrides = {"RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "1", **FAST_HEALTH_CHECKS}  # Ray's poll: 5 s
    saved = {k: os.environ.get(k) for k in ("RAY_ADDRESS", *overrides)}
    os.environ.update(overrides)
    # Token authentication (tests/conftest.py) as KubeRay sets it in every pod: the nodes, the
    # driver and the hook's GCS call use it.
    assert os.environ.get("RAY_AUTH_MODE") == "token" and os.environ.get("RAY_AUTH_TOKEN")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    logs = tmp_path_factory.mktemp("nodes")
    state = {"cluster": cluster, "logs": logs, "count": 0, "every": []}

    def add_node(env: dict[str, str] | None = None) -> PodNode:
        state["count"] += 1
        node = PodNode(cluster.address, log=logs / f"node{state['count']}.log", env=env)
        state["every"].append(node)
        return node

    state["add_node"] = add_node
    state["workers"] = [add_node() for _ in range(2)]
    os.environ["RAY_ADDRESS"] = cluster.address
    yield state
    for node in state["every"]:  # replaced ones too: a node left running would join the next test's Ray
        node.kill()
    ray.shutdown()
    cluster.shutdown()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _run_in_background(storage: Path, *extra: str, args: list[str] = ARGS) -> tuple[threading.Thread, dict]:
    from training.config import parse_config
    from training.train import run

    outcome: dict = {}
    config = parse_config([*args, "--storage-path", str(storage), *extra])

    def target():
        try:
            outcome["summary"] = run(config)
        except BaseException as error:  # noqa: BLE001 - reported by the test
            outcome["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, outcome


def _metrics(storage: Path) -> list[dict]:
    from training.telemetry.runlog import parse_lines

    path = storage / "tiny-cpu-sft" / "metrics.jsonl"
    try:
        return parse_lines(path.read_text())
    except (FileNotFoundError, ValueError):
        return []


def _wait_for_step(storage: Path, step: int, timeout_s: float = 180) -> int:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        steps = [r["step"] for r in _metrics(storage)]
        if steps and max(steps) >= step:
            return max(steps)
        time.sleep(0.2)
    raise AssertionError(f"the run never reached step {step}")


def _finish(thread: threading.Thread, outcome: dict) -> dict:
    thread.join(timeout=420)
    assert not thread.is_alive(), "the run did not finish"
    assert "error" not in outcome, outcome.get("error")
    return outcome["summary"]


@pytest.fixture(scope="module")
def uninterrupted(cluster, tmp_path_factory):
    """The run every scenario compares against, without the per-step pause (a pause only gives
    the scenarios time to act; it changes no number)."""
    storage = tmp_path_factory.mktemp("uninterrupted")
    pause = ARGS.index("--step-pause-s")
    return _finish(*_run_in_background(storage, args=ARGS[:pause] + ARGS[pause + 2:]))


def _notice_checkpoint(storage: Path) -> dict | None:
    for path in (storage / "tiny-cpu-sft").glob("checkpoint_*/train_state.json"):
        state = json.loads(path.read_text())
        if state.get("preempted"):
            return state
    return None


def _check_resumed_at_the_notice(storage: Path, summary: dict, uninterrupted: dict, drained_at: int) -> int:
    assert (summary["preemptions"], summary["failures"], summary["steps"]) == (1, 0, 12)
    assert summary["final_loss"] == pytest.approx(uninterrupted["final_loss"], abs=1e-5)
    lines = _metrics(storage)
    assert [line["step"] for line in lines] == list(range(1, 13))
    (resumed,) = [line for line in lines if "resume_cause" in line]
    assert resumed["resume_cause"] == "preemption"
    notice_step = resumed["resumed_from_step"]
    # Resumed from the checkpoint taken at the notice (a step or two after the drain, as Ray's
    # watcher polls), not from the last periodic one: nothing trained before it is trained again.
    assert drained_at <= notice_step <= drained_at + 3 and resumed["step"] == notice_step + 1
    assert _notice_checkpoint(storage)["step"] == notice_step
    return notice_step


def _replace(cluster, index: int) -> PodNode:
    """The node at ``index`` is gone; its replacement joins (Karpenter's or the node group's)."""
    cluster["workers"][index] = cluster["add_node"]()
    return cluster["workers"][index]


def test_a_spot_reclaim_before_the_drain_deadline_is_one_preemption_and_no_failure(cluster, uninterrupted, tmp_path):
    thread, outcome = _run_in_background(tmp_path, "--max-failures", "0")
    drained_at = _wait_for_step(tmp_path, 4)
    victim = cluster["workers"][1]
    noticed = time.time()
    hook = victim.start(prestop_command(40))
    # EC2 takes the instance 20 s after the notice, 20 s before the hook's deadline: every
    # process of the node stops where it is (if it still runs: the training released it).
    time.sleep(max(0.0, noticed + 20 - time.time()))
    victim.vanish()
    time.sleep(5)
    victim.kill()
    output = hook.communicate(timeout=30)[0]
    _replace(cluster, 1)
    summary = _finish(thread, outcome)

    assert "accepted=True" in output, output
    notice_step = _check_resumed_at_the_notice(tmp_path, summary, uninterrupted, drained_at)
    print(f"drained after step {drained_at}; checkpoint at the notice: step {notice_step}; hook: {output.strip()}")


def test_a_node_stopped_by_kubernetes_after_the_deadline_is_one_preemption_and_its_gpus_wait_only_for_the_upload(
        cluster, uninterrupted, tmp_path):
    thread, outcome = _run_in_background(tmp_path, "--max-failures", "0")
    drained_at = _wait_for_step(tmp_path, 4)
    victim = cluster["workers"][1]
    started = time.time()
    hook = victim.run(prestop_command(120), timeout=150)
    held = time.time() - started
    # The kubelet's SIGTERM once the hook returned; then the replacement.
    victim.stop()
    _replace(cluster, 1)
    summary = _finish(thread, outcome)

    assert hook.returncode == 0, hook.stdout + hook.stderr
    assert "accepted=True" in hook.stdout and "the raylet exited" in hook.stdout, hook.stdout
    # Released once the checkpoint was uploaded, not at the deadline: 120 s.
    assert held < 40, f"the hook held the node {held:.0f} s"
    notice_step = _check_resumed_at_the_notice(tmp_path, summary, uninterrupted, drained_at)
    print(f"drained after step {drained_at}; checkpoint at the notice: step {notice_step}; the node was held "
          f"{held:.1f} s of the 120 s deadline")


def test_the_prestop_hook_finds_the_pods_ray_node_and_interpreter(cluster):
    node = cluster["workers"][0]
    found = node.run([*prestop_command(90), "check"], timeout=60)
    assert found.returncode == 0, found.stderr
    assert f"node {node.node_id} " in found.stdout and f"python {os.path.dirname(sys.executable)}" in found.stdout


def test_a_node_lost_without_notice_recovers_from_the_last_periodic_checkpoint(cluster, uninterrupted, tmp_path):
    thread, outcome = _run_in_background(tmp_path)
    lost_at = _wait_for_step(tmp_path, 6)
    cluster["workers"][1].kill()
    time.sleep(3)
    _replace(cluster, 1)
    summary = _finish(thread, outcome)

    assert (summary["preemptions"], summary["failures"], summary["steps"]) == (0, 1, 12)
    assert summary["final_loss"] == pytest.approx(uninterrupted["final_loss"], abs=1e-5)
    (resumed,) = [line for line in _metrics(tmp_path) if "resume_cause" in line]
    assert resumed["resume_cause"] == "failure"
    assert resumed["resumed_from_step"] % 4 == 0 and resumed["resumed_from_step"] <= lost_at


# ---------------------------------------------------------------------- a GPU that breaks

def test_a_gpu_that_breaks_takes_its_node_out_and_the_run_resumes_on_a_replacement_as_a_hardware_fault(
        cluster, uninterrupted, tmp_path):
    """The worker's GPU on one node raises CUDA's uncorrectable-ECC error after step 6. The worker
    records the fault, taints its Kubernetes node and drains its Ray node; Ray Train restarts the
    worker group, which waits until the replacement node joins seconds later, and the run finishes
    at the uninterrupted loss with one hardware fault and nothing charged to --max-failures (0)."""
    import ray

    from training.resilience.health import FAKE_FAULT_ENV, NODE_NAME_ENV, UNHEALTHY_TAINT_ENV
    from training.resilience.kube import API_ENV

    taint_key = RayWorkloadSpec().unhealthy_taint_key
    kube = FakeKubernetes("gpu-node-a", "gpu-node-b")
    # The node whose GPU breaks, as its pod: its name from the downward API, the taint to use.
    cluster["workers"][1].kill()
    broken = cluster["workers"][1] = cluster["add_node"]({
        FAKE_FAULT_ENV: "6", NODE_NAME_ENV: "gpu-node-b", UNHEALTHY_TAINT_ENV: taint_key, API_ENV: kube.url})
    started = time.time()
    thread, outcome = _run_in_background(tmp_path, "--max-failures", "0")
    deadline = time.time() + 180
    while not kube.taints("gpu-node-b") and time.time() < deadline:
        time.sleep(0.2)
    tainted_at = time.time()
    assert kube.taints("gpu-node-b"), "the worker never tainted its node"
    # The broken node stays (Karpenter consolidates it once empty, the node group's repair replaces
    # it after 10 minutes); its replacement joins some seconds later.
    time.sleep(5)
    replacement = _replace(cluster, 1)
    summary = _finish(thread, outcome)

    assert (summary["hardware_faults"], summary["preemptions"], summary["failures"], summary["steps"]) == (1, 0, 0, 12)
    assert summary["final_loss"] == pytest.approx(uninterrupted["final_loss"], abs=1e-5)
    (resumed,) = [line for line in _metrics(tmp_path) if "resume_cause" in line]
    assert (resumed["resume_cause"], resumed["resumed_from_step"]) == ("hardware fault", 4)
    # Still unschedulable for pods: the taint stays, ours only; and Ray ran nothing more there.
    assert kube.taints("gpu-node-b") == [{"key": taint_key, "value": "gpu-error", "effect": "NoSchedule"}]
    assert kube.taints("gpu-node-a") == []
    ray.init(address=cluster["cluster"].address)
    try:
        nodes = {node["NodeID"]: node for node in ray.nodes()}
    finally:
        ray.shutdown()
    assert not nodes[broken.node_id]["Alive"] and nodes[replacement.node_id]["Alive"]
    print(f"the worker tainted its node {tainted_at - started:.1f} s after the run started; the broken Ray node ended: "
          f"{nodes[broken.node_id].get('DeathReasonMessage') or nodes[broken.node_id].get('DeathReason')}")


def test_a_node_the_monitoring_agent_marks_unhealthy_costs_one_step_and_counts_as_a_hardware_fault(
        cluster, uninterrupted, tmp_path):
    """The EKS node monitoring agent sets AcceleratedHardwareReady=False on one node mid-run (an
    XID the training did not hit). At its next health check the worker there reads it, taints the
    node and drains it with notice: the training checkpoints at the notice and resumes on the
    replacement one step or two later, as a hardware fault, with nothing charged to --max-failures (0)."""
    from training.resilience.health import NODE_NAME_ENV, UNHEALTHY_TAINT_ENV
    from training.resilience.kube import API_ENV

    taint_key = RayWorkloadSpec().unhealthy_taint_key
    kube = FakeKubernetes("gpu-node-a", "gpu-node-b")
    cluster["workers"][1].kill()
    cluster["workers"][1] = cluster["add_node"]({NODE_NAME_ENV: "gpu-node-b", UNHEALTHY_TAINT_ENV: taint_key, API_ENV: kube.url})
    # The worker there reads its node at the preflight and every 2 steps: the fault shows from the
    # third read on, at step 4's health check.
    kube.status_after_gets["gpu-node-b"] = (2, {"conditions": [
        {"type": "Ready", "status": "True"},
        {"type": "AcceleratedHardwareReady", "status": "False", "reason": "NvidiaXID48Error",
         "message": "Xid 48: uncorrectable double-bit ECC error"}]})
    marked_at = 4
    thread, outcome = _run_in_background(tmp_path, "--max-failures", "0", "--health-check-every", "2")
    deadline = time.time() + 180
    while not kube.taints("gpu-node-b") and time.time() < deadline:
        time.sleep(0.2)
    assert kube.taints("gpu-node-b") == [{"key": taint_key, "value": "node-condition", "effect": "NoSchedule"}]
    time.sleep(5)
    _replace(cluster, 1)
    summary = _finish(thread, outcome)

    assert (summary["hardware_faults"], summary["preemptions"], summary["failures"], summary["steps"]) == (1, 0, 0, 12)
    assert summary["final_loss"] == pytest.approx(uninterrupted["final_loss"], abs=1e-5)
    (resumed,) = [line for line in _metrics(tmp_path) if "resume_cause" in line]
    assert resumed["resume_cause"] == "hardware fault"
    # Resumed from the checkpoint at the notice, not from the last periodic one (step 4).
    notice = _notice_checkpoint(tmp_path)
    assert notice and resumed["resumed_from_step"] == notice["step"] and marked_at <= notice["step"] <= marked_at + 6
    print(f"the condition seen at step {marked_at}'s health check; checkpoint at the notice: step {notice['step']}")
