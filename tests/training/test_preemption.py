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

The events come in two runs, each event after the previous one's resume (they do not interfere,
and a run's start, the costliest part here, is paid twice instead of five times): the Spot reclaim,
the Kubernetes stop and a node killed without notice (which recovers from the last periodic
checkpoint, counted as a failure) with ``--max-failures 1``, so a preemption charged as a failure
would end the run; a GPU that breaks, a node the monitoring agent marks and a GPU lost before a
worker starts, with ``--max-failures 0``. Each run ends at the loss of the one uninterrupted run,
with the preemptions, failures and hardware faults Ray Train counted."""

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
from local_s3 import LocalTopic, exported, free_port
from training.train import state_api_of_new_ray
from pod_node import PodNode

pytestmark = pytest.mark.distributed
#: Steps of a run: each run here takes several events in turn.
MAX_STEPS = 20
#: Steps of a second (a pause per step) so the test can act midway; checkpoints every 4.
ARGS = ["--preset", "tiny-cpu", "--max-steps", str(MAX_STEPS), "--checkpoint-every", "4", "--keep-checkpoints", "8",
        "--max-samples", "400", "--step-pause-s", "1", "--eval-fraction", "0"]
#: The GCS declares a node dead after 6 missed checks a second apart, about 6 s for a killed one
#: (defaults: 3 s x 5 misses, 10 s timeouts). Not fewer, as a margin: `make test` runs the rest of
#: the suite beside this module on the same two cores, where 3 misses of 1 s would leave a live
#: raylet that waits for CPU only 3 s before its node is declared dead.
FAST_HEALTH_CHECKS = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "2000",
                      "RAY_health_check_failure_threshold": "6"}


def prestop_command(drain_deadline_seconds: int) -> list[str]:
    """The GPU worker pod template's preStop command, as the chart writes it."""
    template = worker_group_spec(RayWorkloadSpec(drain_deadline_seconds=drain_deadline_seconds))["template"]
    return template["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]


@pytest.fixture(scope="module")
def sns():
    """moto's server as SNS for every process of the module (the driver here, the Ray nodes started
    after this, their workers and NCCL log followers inherit it): the runs' notifications go there
    (training/telemetry/notify.py), each test reads its own topic back (local_s3.LocalTopic)."""
    from bench.local_s3 import start_moto

    server, env = start_moto(None)
    with exported({"AWS_ENDPOINT_URL_SNS": env["AWS_ENDPOINT_URL"], "AWS_ACCESS_KEY_ID": "testing",
                   "AWS_SECRET_ACCESS_KEY": "testing"}):
        yield env["AWS_ENDPOINT_URL"]
    server.terminate()
    server.wait(timeout=30)


def _notified(sns: str, name: str, monkeypatch) -> LocalTopic:
    """A topic for this test's run, named to the driver as the pods name it (and the price of the default platform)."""
    from training.telemetry.notify import PLATFORM_ENV, TOPIC_ENV

    topic = LocalTopic(sns, name)
    monkeypatch.setenv(TOPIC_ENV, topic.arn)
    monkeypatch.setenv(PLATFORM_ENV, json.dumps({"instance_type": "g6.12xlarge", "node_count": 2, "gpu_usd_per_hour": 9.2032}))
    return topic


def _finished_message(messages: list[dict], summary: dict) -> dict:
    """The run's one 'finished' message: its subject names the run, the final loss and step; its text
    the cost so far and where the model is."""
    (finished,) = [m for m in messages if " finished" in m["Subject"]]
    assert finished["Subject"] == f"ray-train-eks: tiny-cpu-sft finished, loss {summary['final_loss']:.4f} at step {MAX_STEPS} of {MAX_STEPS}"
    assert f"Model: {summary['final_model']}\n" in finished["Message"]
    assert "Cost so far: " in finished["Message"] and " USD: the GPU nodes at 9.20 USD/hour" in finished["Message"]
    return finished


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, sns):
    import ray
    from ray.cluster_utils import Cluster

    overrides = {"RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "1", **FAST_HEALTH_CHECKS}  # Ray's poll: 5 s
    saved = {k: os.environ.get(k) for k in ("RAY_ADDRESS", *overrides)}
    os.environ.update(overrides)
    # Token authentication (tests/conftest.py) as KubeRay sets it in every pod: the nodes, the
    # driver and the hook's GCS call use it.
    assert os.environ.get("RAY_AUTH_MODE") == "token" and os.environ.get("RAY_AUTH_TOKEN")
    # No dashboard on the head (the API server alone): nothing here uses it, and it costs CPU. Ray
    # Train's PlacementGroupCleaner, on the head, asks Ray's state API every second whether the
    # controller lives; with no dashboard to answer it must fail at once (a refused port), not look
    # for a server through /tmp/ray/ray_current_cluster, which any `ray start` on this machine
    # rewrites: a call to a cluster that is gone hangs 40 s, and the run's end waits for the
    # cleaner's 12 s stop timeout (training/train.py start_ray points a local Ray at its dashboard).
    with state_api_of_new_ray(f"http://127.0.0.1:{free_port()}"):
        # The dashboard agent on a port of its own (Ray's default, 52365, is a local Ray's too).
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                                "dashboard_agent_listen_port": free_port()})
    logs = tmp_path_factory.mktemp("nodes")
    state = {"cluster": cluster, "logs": logs, "count": 0, "every": []}

    def add_node(env: dict[str, str] | None = None) -> PodNode:
        state["count"] += 1
        node = PodNode(cluster.address, log=logs / f"node{state['count']}.log", env=env)
        state["every"].append(node)
        return node

    state["add_node"] = add_node
    try:
        state["workers"] = [add_node() for _ in range(2)]
        os.environ["RAY_ADDRESS"] = cluster.address
        yield state
    finally:  # also when a node failed to start: nothing of this cluster may outlive the module
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


def _wait_for_resumes(storage: Path, count: int, timeout_s: float = 240) -> list[dict]:
    """The run's first ``count`` resumes (metrics lines with a ``resume_cause``), once it has them."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        resumes = [line for line in _metrics(storage) if "resume_cause" in line]
        if len(resumes) >= count:
            return resumes[:count]
        time.sleep(0.2)
    raise AssertionError(f"the run never resumed {count} time(s)")


def _finish(thread: threading.Thread, outcome: dict) -> dict:
    thread.join(timeout=600)
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


def _notice_checkpoints(storage: Path) -> dict[int, dict]:
    """The checkpoints taken at a notice (a drain), by step."""
    found = {}
    for path in (storage / "tiny-cpu-sft").glob("checkpoint_*/train_state.json"):
        state = json.loads(path.read_text())
        if state.get("preempted"):
            found[state["step"]] = state
    return found


def _resumes(storage: Path) -> list[dict]:
    return [line for line in _metrics(storage) if "resume_cause" in line]


def _check_resumed_at_the_notice(storage: Path, resumed: dict, drained_at: int) -> int:
    """``resumed`` (a metrics line) is a preemption's resume from the checkpoint taken at its notice
    (a step or two after the drain, as Ray's watcher polls), not from the last periodic one:
    nothing trained before it is trained again."""
    assert resumed["resume_cause"] == "preemption"
    notice_step = resumed["resumed_from_step"]
    assert drained_at <= notice_step <= drained_at + 3 and resumed["step"] == notice_step + 1
    assert notice_step in _notice_checkpoints(storage)
    return notice_step


def _replace(cluster, index: int, env: dict[str, str] | None = None) -> PodNode:
    """The node at ``index`` is gone; its replacement joins (Karpenter's or the node group's)."""
    cluster["workers"][index] = cluster["add_node"](env)
    return cluster["workers"][index]


def test_a_spot_reclaim_a_kubernetes_stop_and_a_node_lost_without_notice_in_one_run(cluster, uninterrupted, tmp_path, sns,
                                                                                     monkeypatch):
    """Three events on one run, each after the previous one's resume (they do not interfere):

    1. A Spot reclaim before the drain deadline: the hook drains the node (deadline 40 s), the
       training checkpoints at the notice, uploads it and releases the node; EC2 then takes the
       instance 20 s after the notice, before the hook's deadline.
    2. A node stopped by Kubernetes after the deadline: the hook drains, the training checkpoints and
       releases the node, the hook returns once its raylet is gone (after the upload, well before
       its 120 s deadline), and the kubelet's SIGTERM stops ``ray start``.
    3. A node lost without notice, once a periodic checkpoint followed the second resume: the run
       resumes from that checkpoint, counted as a failure.

    With ``--max-failures 1``: the loss of the node is Ray Train's one failure, so a preemption
    charged as a failure would end the run (FAILED). It ends at the uninterrupted run's loss with
    two preemptions and one failure. Each preemption and the run's end are published to the stack's
    topic (moto's SNS here): two preemptions, then finished."""
    topic = _notified(sns, "preemptions", monkeypatch)
    thread, outcome = _run_in_background(tmp_path, "--max-failures", "1")

    # 1. A Spot reclaim.
    reclaimed_at = _wait_for_step(tmp_path, 4)
    victim = cluster["workers"][1]
    noticed = time.time()
    hook = victim.start(prestop_command(40))
    # EC2 takes the instance 20 s after the notice, 20 s before the hook's deadline: every
    # process of the node stops where it is (if it still runs: the training released it).
    time.sleep(max(0.0, noticed + 20 - time.time()))
    victim.vanish()
    time.sleep(5)
    victim.kill()
    spot_output = hook.communicate(timeout=30)[0]
    _replace(cluster, 1)

    # 2. A Kubernetes stop, once the run resumed and went on.
    first = _wait_for_resumes(tmp_path, 1)[0]
    stopped_at = _wait_for_step(tmp_path, first["step"] + 2)
    victim = cluster["workers"][1]
    started = time.time()
    stop_hook = victim.run(prestop_command(120), timeout=150)
    held = time.time() - started
    victim.stop()  # the kubelet's SIGTERM once the hook returned; then the replacement
    _replace(cluster, 1)

    # 3. A node lost without notice, after the first periodic checkpoint that follows the resume.
    second = _wait_for_resumes(tmp_path, 2)[-1]
    periodic = (second["resumed_from_step"] // 4 + 1) * 4
    assert periodic < MAX_STEPS - 2, second
    # Two steps past it: an asynchronous checkpoint is reported with the next step's report, and a
    # resume from an older one would drop the metrics lines after it (the second resume's among them).
    lost_at = _wait_for_step(tmp_path, periodic + 2)
    cluster["workers"][1].kill()
    time.sleep(3)
    _replace(cluster, 1)
    summary = _finish(thread, outcome)

    assert (summary["preemptions"], summary["failures"], summary["steps"]) == (2, 1, MAX_STEPS)
    assert summary["final_loss"] == pytest.approx(uninterrupted["final_loss"], abs=1e-5)
    assert [line["step"] for line in _metrics(tmp_path)] == list(range(1, MAX_STEPS + 1))
    spot, kubernetes, lost = _resumes(tmp_path)

    assert "accepted=True" in spot_output, spot_output
    spot_step = _check_resumed_at_the_notice(tmp_path, spot, reclaimed_at)

    assert stop_hook.returncode == 0, stop_hook.stdout + stop_hook.stderr
    assert "accepted=True" in stop_hook.stdout and "the raylet exited" in stop_hook.stdout, stop_hook.stdout
    # Released once the checkpoint was uploaded, not at the deadline: 120 s.
    assert held < 40, f"the hook held the node {held:.0f} s"
    stop_step = _check_resumed_at_the_notice(tmp_path, kubernetes, stopped_at)

    assert lost["resume_cause"] == "failure"
    assert lost["resumed_from_step"] % 4 == 0 and stop_step < lost["resumed_from_step"] <= lost_at

    # Published: each preemption by rank 0 once its checkpoint at the notice was uploaded, and the end.
    messages = topic.messages()
    preempted = [m for m in messages if " preempted, resuming" in m["Subject"]]
    assert len(messages) == 3 and len(preempted) == 2, [m["Subject"] for m in messages]
    for message, step in zip(preempted, (spot_step, stop_step)):
        assert message["Subject"].startswith(f"ray-train-eks: tiny-cpu-sft preempted, resuming, loss ")
        assert message["Subject"].endswith(f" at step {step} of {MAX_STEPS}")
        assert f"every rank checkpointed step {step} and the nodes were released" in message["Message"]
        assert f"Checkpoint: {tmp_path}/tiny-cpu-sft/checkpoint_* (step {step}'s, taken at the notice)" in message["Message"]
    _finished_message(messages, summary)
    print(f"spot: drained after step {reclaimed_at}, checkpoint at the notice: step {spot_step}, hook: {spot_output.strip()}; "
          f"kubernetes: drained after step {stopped_at}, checkpoint at the notice: step {stop_step}, the node was held "
          f"{held:.1f} s of the 120 s deadline; lost after step {lost_at}, resumed from step {lost['resumed_from_step']}")


def test_the_prestop_hook_finds_the_pods_ray_node_and_interpreter(cluster):
    node = cluster["workers"][0]
    found = node.run([*prestop_command(90), "check"], timeout=60)
    assert found.returncode == 0, found.stderr
    assert f"node {node.node_id} " in found.stdout and f"python {os.path.dirname(sys.executable)}" in found.stdout


# ---------------------------------------------------------------------- a GPU that breaks

def test_a_gpu_that_breaks_a_node_the_monitoring_agent_marks_a_gpu_lost_at_start_and_a_watchdog_abort_in_one_run(
        cluster, uninterrupted, tmp_path, sns, monkeypatch):
    """Four hardware faults on one run, each on the previous one's replacement:

    1. The worker's GPU on one node raises CUDA's uncorrectable-ECC error after step 6. The worker
       records the fault, taints its Kubernetes node and drains its Ray node; Ray Train restarts the
       worker group, which waits until the replacement node joins seconds later, and resumes from
       the last periodic checkpoint (step 4).
    2. The EKS node monitoring agent sets AcceleratedHardwareReady=False on the replacement's node
       mid-run (an XID the training did not hit). At its next health check the worker there reads
       it, taints the node and drains it with notice: the training checkpoints at the notice and
       resumes on the next replacement one step or two later.
    3. That replacement's GPU was lost since its node started: the worker's ``set_device`` fails at
       its start, before any step; the worker takes the node out as in 1.
    4. The next replacement's GPU breaks inside a collective after step 18: NCCL logs the CUDA error
       into its log file and torch's watchdog onto stderr, then aborts the worker (SIGABRT: no
       Python runs). The NCCL log follower, which outlived it, takes the node out; the controller,
       which saw a worker die, waits for that record and counts a hardware fault; the run resumes
       from step 16's checkpoint. (On CPU there is no NCCL and no watchdog: the worker writes their
       lines as they do, NCCL's through C stdio, and calls abort() itself.)

    All counted as hardware faults, nothing charged to --max-failures (0); the run ends at the
    uninterrupted run's loss. Each node taken out is published once (by its worker, or by the follower
    of the aborted one), then the run's end."""
    import ray

    from training.resilience.faults import (FAKE_FAULT_ENV, FAKE_NCCL_ABORT_ENV, FAKE_START_FAULT_ENV, NODE_NAME_ENV,
                                            UNHEALTHY_TAINT_ENV)
    from training.resilience.kube import API_ENV

    taint_key = RayWorkloadSpec().unhealthy_taint_key
    kube = FakeKubernetes("gpu-node-a", "gpu-node-b", "gpu-node-c", "gpu-node-d", "gpu-node-e")
    # The taint to use, the API, NCCL_DEBUG as the chart sets it; the node's name: downward API.
    pod = {UNHEALTHY_TAINT_ENV: taint_key, API_ENV: kube.url, "NCCL_DEBUG": "WARN"}
    # The node whose GPU breaks, as its pod.
    cluster["workers"][1].kill()
    broken = _replace(cluster, 1, {**pod, FAKE_FAULT_ENV: "6", NODE_NAME_ENV: "gpu-node-b"})
    # The worker on the replacement's node reads its node at its preflight and every 2 steps: resumed
    # from step 4, it reads at the preflight, step 6 and step 8; the fault shows from the third read on.
    kube.status_after_gets["gpu-node-c"] = (2, {"conditions": [
        {"type": "Ready", "status": "True"},
        {"type": "AcceleratedHardwareReady", "status": "False", "reason": "NvidiaXID48Error",
         "message": "Xid 48: uncorrectable double-bit ECC error"}]})
    marked_at = 8
    started = time.time()
    topic = _notified(sns, "hardware", monkeypatch)
    # Four nodes taken out in one run: more than the default budget of hardware faults (2) allows.
    thread, outcome = _run_in_background(tmp_path, "--max-failures", "0", "--health-check-every", "2",
                                         "--max-hardware-faults", "4")

    # 1. The GPU breaks. The broken node stays (Karpenter consolidates it once empty, the node
    # group's repair replaces it after 10 minutes); its pod ends once the kubelet's liveness probe
    # finds its Ray node gone, and only then does KubeRay create the replacement pod (the old one
    # counts as a replica until its container has ended), which lands on another node.
    _wait_for_taint(kube, "gpu-node-b")
    tainted_after = time.time() - started
    gpu_pod_ended = _kubelet_ends_when_not_live(broken)
    marked = _replace(cluster, 1, {**pod, NODE_NAME_ENV: "gpu-node-c"})

    # 2. The agent marks the replacement's node; that pod ends in the same way once its Ray node,
    # drained with notice, has gone. Its replacement lands on a node whose GPU was lost since it
    # started: the worker's torch.cuda.set_device raises (FAKE_START_FAULT_ENV raises c10's message
    # where the worker sets its device up; a CPU worker has no device to set).
    _wait_for_taint(kube, "gpu-node-c")
    condition_pod_ended = _kubelet_ends_when_not_live(marked)
    lost = _replace(cluster, 1, {**pod, FAKE_START_FAULT_ENV: "1", NODE_NAME_ENV: "gpu-node-d"})

    # 3. The GPU broken at the worker's start: a hardware fault like any other.
    _wait_for_taint(kube, "gpu-node-d")
    _kubelet_ends_when_not_live(lost)
    aborts = _replace(cluster, 1, {**pod, FAKE_NCCL_ABORT_ENV: "18", NODE_NAME_ENV: "gpu-node-e"})
    _wait_until_live(aborts)  # the kubelet's probe passes while it trains

    # 4. A CUDA error inside a collective: the watchdog's SIGABRT; the follower takes the node out.
    _wait_for_taint(kube, "gpu-node-e")
    aborted_at = time.time()
    abort_pod_ended = _kubelet_ends_when_not_live(aborts, seen_live=True)
    replacement = _replace(cluster, 1)
    summary = _finish(thread, outcome)

    assert (summary["hardware_faults"], summary["preemptions"], summary["failures"], summary["steps"]) == (4, 0, 0, MAX_STEPS)
    assert summary["final_loss"] == pytest.approx(uninterrupted["final_loss"], abs=1e-5)
    assert [line["step"] for line in _metrics(tmp_path)] == list(range(1, MAX_STEPS + 1))
    # The worker group on the node lost at start trained no step: the run resumed once after the
    # condition and the lost GPU together, from the checkpoint at the condition's notice.
    gpu, condition, aborted = _resumes(tmp_path)
    assert (gpu["resume_cause"], gpu["resumed_from_step"]) == ("hardware fault", 4)
    assert (aborted["resume_cause"], aborted["resumed_from_step"]) == ("hardware fault", 16)
    assert condition["resume_cause"] == "hardware fault"
    # Resumed from the checkpoint at the notice, not from the last periodic one (step 8).
    assert condition["resumed_from_step"] in _notice_checkpoints(tmp_path)
    assert marked_at <= condition["resumed_from_step"] <= marked_at + 6
    # Still unschedulable for pods: the taints stay, ours only; and Ray ran nothing more there.
    assert kube.taints("gpu-node-b") == [{"key": taint_key, "value": "gpu-error", "effect": "NoSchedule"}]
    assert kube.taints("gpu-node-c") == [{"key": taint_key, "value": "node-condition", "effect": "NoSchedule"}]
    assert kube.taints("gpu-node-d") == [{"key": taint_key, "value": "gpu-error", "effect": "NoSchedule"}]
    assert kube.taints("gpu-node-e") == [{"key": taint_key, "value": "gpu-error", "effect": "NoSchedule"}]
    assert kube.taints("gpu-node-a") == []
    ray.init(address=cluster["cluster"].address)
    try:
        nodes = {node["NodeID"]: node for node in ray.nodes()}
    finally:
        ray.shutdown()
    assert not any(nodes[node.node_id]["Alive"] for node in (broken, marked, lost, aborts)) and nodes[replacement.node_id]["Alive"]
    messages = topic.messages()
    taken_out = [m for m in messages if " node taken out, resuming" in m["Subject"]]
    assert len(messages) == 5 and len(taken_out) == 4, [m["Subject"] for m in messages]
    for message, (kind, node) in zip(taken_out, [("gpu error", "b"), ("node condition", "c"), ("gpu error", "d"),
                                                 ("gpu error", "e")]):
        assert f"What happened: {kind} on node gpu-node-{node}" in message["Message"], message["Message"]
    _finished_message(messages, summary)

    print(f"the pods ended {gpu_pod_ended:.1f} s and {condition_pod_ended:.1f} s after their probe first failed; "
          f"the worker tainted its node {tainted_after:.1f} s after the run started; the broken Ray node ended: "
          f"{nodes[broken.node_id].get('DeathReasonMessage') or nodes[broken.node_id].get('DeathReason')}; the condition "
          f"seen at step {marked_at}'s health check, checkpoint at the notice: step {condition['resumed_from_step']}; "
          f"the aborted worker's pod ended {abort_pod_ended:.1f} s after its probe first failed, the run resumed "
          f"{aborted['time'] - aborted_at:.1f} s after the taint")
    print("what each fault cost the run, per GPU (s): " + _costs(tmp_path, {"gpu error": gpu, "node condition + lost at start":
                                                                            condition, "watchdog abort": aborted}))


def _costs(storage: Path, resumes: dict[str, dict]) -> str:
    """Per fault: the seconds from the step it resumed from to the first step after it, less one
    step's own time: what the GPUs spent re-training lost steps or waiting."""
    by_step = {line["step"]: line for line in _metrics(storage)}
    parts = []
    for what, resumed in resumes.items():
        before = by_step[resumed["resumed_from_step"]]
        wasted = resumed["time"] - before["time"] - resumed["step_seconds"]
        parts.append(f"{what}: {wasted:.0f} s")
    return ", ".join(parts)


#: The GPU worker container's liveness probe, as the pod template states it.
LIVENESS_PROBE = worker_group_spec(RayWorkloadSpec())["template"]["spec"]["containers"][0]["livenessProbe"]


def _live(node: PodNode) -> bool:
    """One liveness probe of the pod, as the kubelet makes it (GET its path on the pod's dashboard
    agent, with its timeout)."""
    import urllib.request

    url = f"http://127.0.0.1:{node.agent_port}{LIVENESS_PROBE['httpGet']['path']}"
    try:
        with urllib.request.urlopen(url, timeout=LIVENESS_PROBE["timeoutSeconds"]) as answer:
            return 200 <= answer.status < 400
    except OSError:  # refused, reset, or a 503 (HTTPError): a failure, as the kubelet counts it
        return False


def _wait_until_live(node: PodNode, timeout_s: float = 60) -> None:
    deadline = time.time() + timeout_s
    while not _live(node):
        assert time.time() < deadline, "the liveness probe of a new pod never passed"
        time.sleep(0.5)


def _kubelet_ends_when_not_live(node: PodNode, timeout_s: float = 240, seen_live: bool = False) -> float:
    """The kubelet's liveness probe of a GPU worker pod (:func:`_live`), every second instead of
    every 10 s: after its failure threshold in a row, the kubelet runs the preStop hook and stops
    the container. Returns the seconds from the probe's first failure to the container's end.
    ``seen_live``: the probe passed before (a fault that ends the Ray node within a second, as the
    follower's drain of a node with nothing else to run does, leaves no live probe to see here)."""
    probe = LIVENESS_PROBE
    failures, first_failure = 0, None
    deadline = time.time() + timeout_s
    while failures < probe["failureThreshold"]:
        assert time.time() < deadline, f"the liveness probe of the pod never failed {probe['failureThreshold']} times"
        live = _live(node)
        seen_live = seen_live or live
        failures = 0 if live else failures + 1
        first_failure = None if live else (first_failure or time.time())
        time.sleep(1)
    assert seen_live, "the probe never passed: it would have ended a healthy pod"
    hook = node.run(prestop_command(120), timeout=60)
    # Its Ray node is gone, so the hook has nothing to drain (the kubelet logs a failed hook and goes on).
    assert "no raylet runs in this pod" in hook.stderr, hook.stdout + hook.stderr
    node.stop()
    return time.time() - first_failure


def _wait_for_taint(kube: FakeKubernetes, name: str, timeout_s: float = 180) -> None:
    deadline = time.time() + timeout_s
    while not kube.taints(name) and time.time() < deadline:
        time.sleep(0.2)
    assert kube.taints(name), f"the worker never tainted its node {name}"


def test_a_deterministic_illegal_address_on_two_nodes_stops_the_run_as_the_programs_error_with_no_node_out(cluster, tmp_path):
    """A kernel bug: every worker, on both nodes, raises CUDA's illegal-address error at step 6,
    every time it gets there. The first time it is retried from step 4's checkpoint as a failure
    (nothing says a retry cannot help); when it comes back the run stops with it, as the program's
    error, long before --max-failures (5) is spent; no node is tainted or drained (the GPUs are
    fine, and a new node would fail the same way), so both Ray nodes are still alive at the end."""
    import ray

    from training.resilience.faults import FAKE_FAULT_ENV, NODE_NAME_ENV, UNHEALTHY_TAINT_ENV
    from training.resilience.kube import API_ENV

    kube = FakeKubernetes("gpu-node-x", "gpu-node-y")
    pod = {UNHEALTHY_TAINT_ENV: RayWorkloadSpec().unhealthy_taint_key, API_ENV: kube.url, "NCCL_DEBUG": "WARN",
           FAKE_FAULT_ENV: "6:illegal-address"}
    pause = ARGS.index("--step-pause-s")
    try:
        for index, name in enumerate(("gpu-node-x", "gpu-node-y")):
            cluster["workers"][index].kill()
            _replace(cluster, index, {**pod, NODE_NAME_ENV: name})
        # Synchronous checkpoints: step 4's is reported before step 5 starts, so the restart resumes from it.
        thread, outcome = _run_in_background(tmp_path, "--max-failures", "5", "--checkpoint-mode", "sync",
                                             args=ARGS[:pause] + ARGS[pause + 2:])
        thread.join(timeout=300)
        assert not thread.is_alive(), "the run did not stop"
        error = str(outcome.get("error"))
        assert "an illegal memory access (cudaErrorIllegalAddress; XID 13/31)" in error, error
        assert "as before the restart from the last checkpoint" in error and "no node is taken out" in error
        resumes = _resumes(tmp_path)
        assert [(r["resume_cause"], r["resumed_from_step"]) for r in resumes] == [("failure", 4)]
        assert max(line["step"] for line in _metrics(tmp_path)) == 5  # step 6 raised before its line
        assert kube.taints("gpu-node-x") == kube.taints("gpu-node-y") == []
        ray.init(address=cluster["cluster"].address)
        try:
            alive = {node["NodeID"]: node["Alive"] for node in ray.nodes()}
        finally:
            ray.shutdown()
        assert all(alive[node.node_id] for node in cluster["workers"])  # not drained
    finally:  # the module's other runs get nodes without the bug
        for index in range(2):
            cluster["workers"][index].kill()
            _replace(cluster, index)


# ---------------------------------------------------------------------- an elastic run (--min-nodes)

#: How far an elastic run's loss may be from the fixed-size run's at each step, at the same global batch:
#: the same rows and updates, summed in another order (one worker's micro-batches accumulated, or two
#: workers' all-reduced; HSDP of 1 x 2 or FSDP of 1), in fp32.
ELASTIC_LOSS_TOLERANCE = 1e-4


def test_an_elastic_run_goes_on_with_the_node_it_has_grows_back_at_a_checkpoint_and_trains_as_a_fixed_size_run(
        cluster, uninterrupted, tmp_path, sns, monkeypatch):
    """``--min-nodes 1`` on the two nodes (one worker each, standing in for a GPU node's workers: whole-node
    counting with 8 a node, and a node's HSDP shard group at a new size, are unit-tested in test_elastic.py
    and test_lora.py), two resizes in a row:

    1. A node lost without notice right after step 4, whose checkpoint went to its background upload (the
       loss may come before or after the upload ends: not controlled here), and nothing replaces it: the
       run resumes on the node left, from the latest checkpoint Ray Train registered (step 2's or 4's: a
       checkpoint whose upload did not end is never resumed from), resharded onto one worker.
    2. A node joins: with ``--elastic-settle-s 0`` the workers are asked at once, checkpoint at their next
       checkpoint step, uploaded, and once Ray Train registered it the run restarts on both nodes from it.

    Every step is trained once (one metrics line each), at the global batch of the fixed-size run, and
    each step's loss is the uninterrupted two-worker run's within ``ELASTIC_LOSS_TOLERANCE``. Each resize is
    said in the step's record (``workers``, ``resized_from_workers``) and published; the shrink is charged
    as a fixed-size run's restart is (a failure), the growth to no budget. A shrink at a notice takes the
    same start of a worker group, on the nodes not draining; the notice itself is the fixed-size run's
    path (test_a_spot_reclaim_a_kubernetes_stop_and_a_node_lost_without_notice_in_one_run)."""
    topic = _notified(sns, "elastic", monkeypatch)
    started = time.time()
    thread, outcome = _run_in_background(tmp_path, "--min-nodes", "1", "--workers-per-node", "1", "--elastic-settle-s", "0",
                                         "--checkpoint-every", "2", "--step-pause-s", "0.5")

    # 1. Lost without notice, step 4's checkpoint just reported for upload; no replacement.
    lost_at = _wait_for_step(tmp_path, 4)
    cluster["workers"][1].kill()
    lost_time = time.time()
    shrunk = _wait_for_resumes(tmp_path, 1)[0]

    # 2. A node joins (Karpenter's, or capacity back in the node group).
    _replace(cluster, 1)
    joined_time = time.time()
    grown = _wait_for_resumes(tmp_path, 2)[-1]
    summary = _finish(thread, outcome)

    lines = _metrics(tmp_path)
    assert [line["step"] for line in lines] == list(range(1, MAX_STEPS + 1))
    fixed = {line["step"]: line["loss"] for line in _metrics(Path(uninterrupted["metrics"]).parents[1])}
    worst = max(abs(line["loss"] - fixed[line["step"]]) for line in lines)
    assert worst <= ELASTIC_LOSS_TOLERANCE, worst
    assert [(r["resume_cause"], r["workers"], r.get("resized_from_workers")) for r in _resumes(tmp_path)] == [
        ("failure", 1, 2), ("resize", 2, 1)]
    assert shrunk["resumed_from_step"] in (2, 4) and shrunk["resumed_from_step"] <= lost_at
    assert grown["resumed_from_step"] % 2 == 0 and grown["step"] == grown["resumed_from_step"] + 1
    assert [line["workers"] for line in lines if line["step"] > grown["resumed_from_step"]] == [2] * (
        MAX_STEPS - grown["resumed_from_step"])
    assert (summary["preemptions"], summary["failures"], summary["steps"]) == (0, 1, MAX_STEPS)
    resized = [m for m in topic.messages() if " resized" in m["Subject"]]
    assert [m["Subject"].split(",")[0] for m in resized] == ["ray-train-eks: tiny-cpu-sft resized"] * 2
    assert "shrank from 2 to 1 of its 2 nodes (1 workers) after a node lost without notice" in resized[0]["Message"]
    assert "grew from 1 to 2 of its 2 nodes (2 workers) after nodes came back" in resized[1]["Message"]

    print(f"elastic: loss within {worst:.2e} of the fixed-size run's; lost after step {lost_at}, training again on 1 "
          f"node {shrunk['time'] - lost_time:.1f} s later (from step {shrunk['resumed_from_step']}); a node joined, "
          f"training on 2 nodes {grown['time'] - joined_time:.1f} s later (from step {grown['resumed_from_step']}); "
          f"the run took {time.time() - started:.0f} s")
