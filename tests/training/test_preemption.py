"""A preemption costs one step, on Ray's own multi-node cluster (ray.cluster_utils.Cluster: a
head without CPUs for the driver and Ray Train's controller, two worker nodes of one CPU, one
training worker each; token authentication on, as in the pods): the GPU worker pods' preStop hook drains a node with reason preemption
(the same script, pointed at that node), the training checkpoints at the notice and waits, the
node goes, a new one comes, and the run resumes from that checkpoint to the loss of an
uninterrupted run, counting one preemption and no failure. A node killed without notice still
recovers, from the last periodic checkpoint, counted as a failure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ray_train_eks.charts.ray_workload import DRAIN_HOOK

pytestmark = pytest.mark.distributed
#: 12 steps of a second (a pause per step) so the test can act midway; checkpoints every 4.
ARGS = ["--preset", "tiny-cpu", "--max-steps", "12", "--checkpoint-every", "4", "--keep-checkpoints", "6",
        "--max-samples", "400", "--step-pause-s", "1", "--eval-fraction", "0"]
DRAIN_DEADLINE_S = 8


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    saved = {k: os.environ.get(k) for k in ("RAY_ADDRESS", "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S")}
    os.environ["RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"] = "1"  # Ray's default is 5 s; the same code path
    # Token authentication (tests/conftest.py) as KubeRay sets it in every pod: the nodes, the
    # driver and the hook's GCS call use it.
    assert os.environ.get("RAY_AUTH_MODE") == "token" and os.environ.get("RAY_AUTH_TOKEN")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    workers = [cluster.add_node(num_cpus=1) for _ in range(2)]
    cluster.wait_for_nodes()
    os.environ["RAY_ADDRESS"] = cluster.address
    yield {"cluster": cluster, "workers": workers}
    ray.shutdown()
    cluster.shutdown()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _run_in_background(storage: Path, *extra: str) -> tuple[threading.Thread, dict]:
    from training.config import parse_config
    from training.train import run

    outcome: dict = {}
    config = parse_config([*ARGS, "--storage-path", str(storage), *extra])

    def target():
        try:
            outcome["summary"] = run(config)
        except BaseException as error:  # noqa: BLE001 - reported by the test
            outcome["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, outcome


def _metrics(storage: Path) -> list[dict]:
    from training.runlog import parse_lines

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
    storage = tmp_path_factory.mktemp("uninterrupted")
    return _finish(*_run_in_background(storage))


def test_a_drained_node_costs_one_step_and_the_run_ends_where_an_uninterrupted_one_does(cluster, uninterrupted, tmp_path):
    thread, outcome = _run_in_background(tmp_path)
    drained_at = _wait_for_step(tmp_path, 4)
    victim = cluster["workers"][1]
    # The preStop hook's own script: drain with reason preemption, hold until the deadline.
    hook = subprocess.Popen(
        [sys.executable, "-c", DRAIN_HOOK, str(DRAIN_DEADLINE_S)],
        env={**os.environ, "RAY_TRAIN_EKS_DRAIN_NODE_ID": victim.node_id, "RAY_TRAIN_EKS_GCS_ADDRESS": cluster["cluster"].gcs_address},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output, _ = hook.communicate(timeout=60)
    assert hook.returncode == 0 and "accepted=True" in output, output
    # Kubernetes then stops the pod, and the node goes; a replacement comes some seconds later.
    cluster["cluster"].remove_node(victim, allow_graceful=True)
    time.sleep(5)
    cluster["workers"][1] = cluster["cluster"].add_node(num_cpus=1)
    summary = _finish(thread, outcome)

    assert (summary["preemptions"], summary["failures"], summary["steps"]) == (1, 0, 12)
    assert summary["final_loss"] == pytest.approx(uninterrupted["final_loss"], abs=1e-5)
    lines = _metrics(tmp_path)
    assert [line["step"] for line in lines] == list(range(1, 13))
    (resumed,) = [line for line in lines if "resume_cause" in line]
    assert resumed["resume_cause"] == "preemption"
    notice_step = resumed["resumed_from_step"]
    # Resumed from the checkpoint taken at the notice (a step or two after the drain, as Ray's
    # watcher polls), not from the last periodic one: nothing trained before it is trained again.
    assert drained_at <= notice_step <= drained_at + 3 and resumed["step"] == notice_step + 1
    states = [json.loads(p.read_text()) for p in (tmp_path / "tiny-cpu-sft").glob("checkpoint_*/train_state.json")]
    assert [s["step"] for s in states if s.get("preempted")] == [notice_step]
    print(f"drained after step {drained_at}; checkpoint at the notice: step {notice_step}")


def test_a_node_lost_without_notice_recovers_from_the_last_periodic_checkpoint(cluster, uninterrupted, tmp_path):
    thread, outcome = _run_in_background(tmp_path)
    lost_at = _wait_for_step(tmp_path, 6)
    victim = cluster["workers"][1]
    cluster["cluster"].remove_node(victim, allow_graceful=False)
    time.sleep(3)
    cluster["workers"][1] = cluster["cluster"].add_node(num_cpus=1)
    summary = _finish(thread, outcome)

    assert (summary["preemptions"], summary["failures"], summary["steps"]) == (0, 1, 12)
    assert summary["final_loss"] == pytest.approx(uninterrupted["final_loss"], abs=1e-5)
    (resumed,) = [line for line in _metrics(tmp_path) if "resume_cause" in line]
    assert resumed["resume_cause"] == "failure"
    assert resumed["resumed_from_step"] % 4 == 0 and resumed["resumed_from_step"] <= lost_at
