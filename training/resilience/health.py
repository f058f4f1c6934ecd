"""GPU and node health: a GPU that breaks costs one checkpoint interval and no person.

Found four ways, on every worker:

- **before the first step** (:func:`check_gpus`, from the preflight): every GPU the pod was given
  is visible (``nvidia-smi``), and a short bf16 matmul on each worker's GPU is timed; the
  throughputs are compared across all workers and a GPU below :data:`STRAGGLER_SHARE` of the
  median is a straggler (:func:`stragglers`);
- **during the run** (:func:`probe_speeds`, every ``--health-check-every`` steps): the same
  matmul, smaller, with each rank's step time; the slowest GPU against the median goes to the
  log, the metrics and the dashboard;
- **a worker's error** that CUDA raises for a hardware fault (:func:`hardware_fault`): an
  uncorrectable ECC error, a GPU that fell off the bus, an NVLink error, no device;
- **the node's conditions** (:func:`node_condition_fault`, with the probe, one worker per node):
  the EKS node monitoring agent found a fault (``AcceleratedHardwareReady`` and the others false)
  that the training has not hit. Node repair will take the node 10 minutes (30 for the others)
  after the condition turned; the worker drains its node now with :data:`CONDITION_DRAIN_S` of
  notice, so the training checkpoints at the notice and resumes elsewhere one step later, and
  taints it, so the new pod does not come back to it.

Then the worker takes its node out (training/resilience/faults.py ``take_node_out``: recorded,
tainted, drained). A fault that kills the worker before Python can act (torch's NCCL watchdog)
is seen by the NCCL log follower, which outlives the worker and takes the node out the same way.

Testing aid: ``RAY_TRAIN_EKS_FAKE_GPU_TFLOPS=<x>`` makes the matmul measure x (the fault aids are in
training/resilience/faults.py).
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import time
from dataclasses import dataclass

import torch

from .faults import NODE_NAME_ENV, Fault

#: A GPU whose matmul throughput is below this share of the median of all the run's GPUs is a
#: straggler. Synchronous data parallelism runs at the slowest rank's pace, so a GPU at share s
#: costs every GPU of the run (1 - s) of its time for as long as it stays: below 0.85 that is
#: more than 15 %, which on two 8-GPU nodes is 2.4 GPUs' worth, more than a replacement node
#: costs within an hour (a checkpoint interval plus the new node's start). GPUs of one type run
#: within a few percent of each other when healthy (the same clocks under the same power cap);
#: a throttled GPU (thermal or power brake) loses tens of percent; the bar sits between the two.
STRAGGLER_SHARE = 0.85

#: The preflight's matmul: n x n bf16 (a GPU's dense bf16 peak needs large tiles), timed over
#: iterations after one warm-up. 8192^3 x 2 = 1.1 TFLOP: about 1.6 ms on an H100, 20 ms a sample.
PREFLIGHT_MATMUL = (8192, 12)
#: The run's probe: smaller, a few ms every ``--health-check-every`` steps.
PROBE_MATMUL = (4096, 8)
#: On CPU (the tests' gloo runs) the matmul is timed but not judged: the workers share cores.
CPU_MATMUL = (256, 4)
#: A verdict rests on repeated samples, each long enough that clock and boost changes average out
#: (one 20 ms sample moves 15 %): a sample repeats its matmuls until it has run this long (on an
#: H100 the preflight's ~0.1 s is 60 of them), and a GPU is a straggler only if every one of its
#: samples is below the bar. The probe takes fewer: it only logs and is judged at the next start.
PREFLIGHT_SAMPLES = (5, 0.1)
PROBE_SAMPLES = (3, 0.02)

#: GPUs the pod asked for (``nvidia.com/gpu``), set in the GPU worker pods.
POD_GPUS_ENV = "RAY_TRAIN_EKS_POD_GPUS"
FAKE_TFLOPS_ENV = "RAY_TRAIN_EKS_FAKE_GPU_TFLOPS"
#: The conditions the EKS node monitoring agent sets (EKS User Guide, "node-health"); false is a fault.
NODE_CONDITIONS = ("AcceleratedHardwareReady", "NetworkingReady", "StorageReady", "KernelReady", "ContainerRuntimeReady")
#: The notice a worker gives when its node's condition turned false: time for the checkpoint at the
#: notice (its write and upload) well inside the 10 minutes node repair waits.
CONDITION_DRAIN_S = 180


def gpu_label(device: torch.device) -> str:
    """This worker's GPU: its index on the node as Ray assigned it, and its UUID when CUDA has one."""
    if device.type != "cuda":
        return ""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    index = visible[device.index or 0] if visible and visible[0] else str(device.index or 0)
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return f"{index} ({uuid})" if uuid else index


def here(device: torch.device, rank: int) -> dict:
    """This worker's Ray node (none outside Ray: asking would start a Ray of its own), Kubernetes node and GPU."""
    import ray

    node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
    return {"ray_node": node, "node_name": os.environ.get(NODE_NAME_ENV, ""),
            "gpu": gpu_label(device), "rank": rank}


def node_label(where: dict) -> str:
    """How the logs name a worker's node: its Kubernetes name, else its Ray node id's start."""
    return where["node_name"] or where["ray_node"][:12] or "local"


def first_on_node(labels: list[str], rank: int) -> bool:
    """Whether ``rank`` is the lowest rank on its node (``labels``: every rank's :func:`node_label`):
    the one that reads the node's conditions. (Ray Train's local rank groups workers by IP address,
    which several nodes may share, as the tests' nodes do.)"""
    return labels.index(labels[rank]) == rank


# ---------------------------------------------------------------------- measure and judge

@dataclass(frozen=True)
class GpuSpeed:
    """One worker's matmul throughput, where it ran, and how it was measured."""

    rank: int
    node: str
    gpu: str
    tflops: float  # the median of ``samples``
    source: str  # "cuda", "cpu" or "fake"
    step_seconds: float | None = None
    samples: tuple[float, ...] = ()

    @property
    def best(self) -> float:
        """The fastest sample: below the bar, every sample was."""
        return max(self.samples, default=self.tflops)


def matmul_tflops(device: torch.device, size: int, iterations: int, samples: int = 1,
                  min_seconds: float = 0.0) -> tuple[list[float], str]:
    """The device's throughput on n x n matmuls (bf16 on a GPU), after one warm-up: ``samples``
    samples of at least ``iterations`` matmuls each, repeated until the sample has run
    ``min_seconds``. Returns every sample's TFLOPS."""
    faked = os.environ.get(FAKE_TFLOPS_ENV)
    if faked:
        return [float(faked)] * samples, "fake"
    cuda = device.type == "cuda"
    if not cuda:  # timed, not judged: small, and no sample is held to a length
        (size, iterations), min_seconds = CPU_MATMUL, 0.0
    dtype = torch.bfloat16 if cuda else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)

    def finish():
        if cuda:
            torch.cuda.synchronize(device)

    torch.matmul(a, b)
    finish()
    found = []
    for _ in range(samples):
        started, done = time.perf_counter(), 0
        while done < iterations or time.perf_counter() - started < min_seconds:
            for _ in range(iterations):
                torch.matmul(a, b)
            done += iterations
            finish()
        found.append(2 * size**3 * done / max(time.perf_counter() - started, 1e-9) / 1e12)
    del a, b
    return found, "cuda" if cuda else "cpu"


def stragglers(speeds: list[GpuSpeed], share: float = STRAGGLER_SHARE) -> list[tuple[GpuSpeed, float]]:
    """The GPUs below ``share`` of the median throughput, each with its share; none when the
    speeds are not comparable (fewer than two, or a CPU among them)."""
    if len(speeds) < 2 or any(speed.source == "cpu" for speed in speeds):
        return []
    median = statistics.median(speed.tflops for speed in speeds)
    if median <= 0:
        return []
    return [(speed, speed.best / median) for speed in speeds if speed.best < share * median]


def slowest_share(speeds: list[GpuSpeed]) -> float | None:
    """The slowest GPU's throughput as a share of the median (1.0: all alike); None on CPU."""
    if not speeds or any(speed.source == "cpu" for speed in speeds):
        return None
    median = statistics.median(speed.tflops for speed in speeds)
    return min(speed.tflops for speed in speeds) / median if median > 0 else None


def visible_gpus() -> list[str] | None:
    """The GPUs this pod sees (``nvidia-smi -L``: every GPU of the container, whatever
    ``CUDA_VISIBLE_DEVICES`` Ray set for this worker); None when nvidia-smi is not there."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line for line in listed.stdout.splitlines() if line.startswith("GPU ")]


def missing_gpus_problem(expected: int | None, found: list[str] | None) -> str | None:
    """Why the pod's GPUs are not all there, or None (also when nothing can be counted)."""
    if expected is None or found is None:
        return None
    if len(found) < expected:
        return (f"the pod was given {expected} GPUs but nvidia-smi lists {len(found)} "
                f"({'; '.join(found) or 'none'}): a GPU fell off the bus or its driver lost it (XID 79)")
    return None


def check_gpus(device: torch.device, rank: int, share: float = STRAGGLER_SHARE, *,
               read_node: bool = False) -> tuple[list[Fault], list[str], bool]:
    """The preflight's GPU checks (collective): the GPUs every pod was given are visible, no GPU is
    a straggler, and (``read_node``: in a pod; the node's first rank reads it) no node condition of the node
    monitoring agent is false. Returns every worker's faults (each names node, GPU and rank), the
    lines to log, and whether this rank is the one that reads its node (then and on a clock)."""
    import torch.distributed as dist

    where = here(device, rank)
    node = node_label(where)
    labels: list = [None] * dist.get_world_size()
    dist.all_gather_object(labels, node)
    problems = []
    expected = os.environ.get(POD_GPUS_ENV)
    missing = missing_gpus_problem(int(expected), visible_gpus()) if expected and device.type == "cuda" else None
    if missing:
        problems.append(("gpu missing", missing))
    reads_node = bool(read_node and where["node_name"] and first_on_node(labels, rank))
    if reads_node:
        try:
            condition = node_condition_fault(where["node_name"])
        except Exception as error:  # noqa: BLE001 - the agent's view is extra
            condition = None
            print(f"[preflight] could not read node {where['node_name']}'s conditions ({type(error).__name__}: {error})",
                  flush=True)
        if condition:
            problems.append(("node condition", condition))
    samples, source = matmul_tflops(device, *PREFLIGHT_MATMUL, *PREFLIGHT_SAMPLES)
    mine = (GpuSpeed(rank, node, where["gpu"], statistics.median(samples), source, samples=tuple(samples)), problems, where)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    speeds = [speed for speed, _, _ in gathered]
    faults = [Fault(kind, problem, **place) for _, found, place in gathered for kind, problem in found]
    median = statistics.median(speed.tflops for speed in speeds)
    for speed, ratio in stragglers(speeds, share):
        place = gathered[speed.rank][2]
        faults.append(Fault("straggler", f"bf16 matmul at {speed.tflops:.0f} TFLOPS, at best {ratio:.0%} of the median "
                                         f"{median:.0f} in {len(speed.samples)} samples (the bar: {share:.0%})", **place))
    slowest = min(speeds, key=lambda s: s.tflops)
    lines = [f"GPU speed ({speeds[0].source}): median {median:.3g} TFLOPS, slowest {slowest.tflops:.3g} (rank {slowest.rank}) "
             f"over {len(speeds)} workers" + ("; not judged on CPU" if speeds[0].source == "cpu" else "")]
    return faults, lines, reads_node


def probe_speeds(device: torch.device, rank: int, step_seconds: float) -> list[GpuSpeed]:
    """The run's probe (collective): every rank's matmul throughput and its mean step time."""
    import torch.distributed as dist

    samples, source = matmul_tflops(device, *PROBE_MATMUL, *PROBE_SAMPLES)
    where = here(device, rank)
    mine = GpuSpeed(rank, node_label(where), where["gpu"], statistics.median(samples), source, step_seconds, tuple(samples))
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered


def describe_speeds(step: int, speeds: list[GpuSpeed], share: float = STRAGGLER_SHARE) -> str:
    """The probe's log line: the slowest GPU against the median, and the ranks' step times."""
    slowest = min(speeds, key=lambda s: s.tflops)
    median = statistics.median(s.tflops for s in speeds)
    steps = [s.step_seconds for s in speeds if s.step_seconds is not None]
    flagged = [f"rank {s.rank} (node {s.node} GPU {s.gpu or '-'}) at {ratio:.0%}" for s, ratio in stragglers(speeds, share)]
    text = (f"[health] step {step}: GPU matmul median {median:.3g} TFLOPS, slowest rank {slowest.rank} "
            f"(node {slowest.node}) {slowest.tflops:.3g}")
    if steps:
        text += f"; step time per rank {min(steps):.3f}-{max(steps):.3f} s"
    if flagged:
        text += f"; STRAGGLER below {share:.0%} of the median: {', '.join(flagged)}"
    return text


# ---------------------------------------------------------------------- act

def node_condition_fault(node_name: str) -> str | None:
    """Which of the node monitoring agent's conditions of ``node_name`` reports a fault, with the
    agent's reason and message; None when all are true or absent (no agent). A false
    ``AcceleratedHardwareReady`` is a fault only for a GPU reason (training/resilience/agent_reasons.py):
    ``DCGMError`` is the agent's own health (it cannot reach DCGM, as after a DCGM restart, and it
    stays false until the agent restarts), reported in the log, never a reason to take nodes out."""
    from .agent_reasons import CONDITION, gpu_fault
    from .kube import get_node

    for condition in get_node(node_name).get("status", {}).get("conditions") or []:
        if condition.get("type") not in NODE_CONDITIONS or condition.get("status") != "False":
            continue
        reason, message = condition.get("reason", ""), condition.get("message", "")
        if condition["type"] == CONDITION:
            fault = gpu_fault(reason, message)
            if fault is None:
                print(f"[health] node {node_name}: {CONDITION}=False ({reason}: {message[:200]}) is the monitoring agent's "
                      "own health, not a GPU fault: reported, the node stays in the run", flush=True)
                continue
            reason = fault
        return f"{condition['type']}=False ({reason}: {message})".replace(" (: )", "")
    return None
