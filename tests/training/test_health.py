"""GPU health (training/resilience/health.py, training/resilience/kube.py): which errors are the hardware's, the
straggler decision on injected measurements, the preflight's GPU check across workers, and the
taint a worker puts on its node through the Kubernetes API."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from processes import run_workers

from fake_kube import FakeKubernetes
from training.resilience.faults import hardware_fault
from training.resilience.health import (STRAGGLER_SHARE, GpuSpeed, describe_speeds, missing_gpus_problem, slowest_share,
                                        stragglers)


@pytest.mark.parametrize("message", [
    "CUDA error: uncorrectable ECC error encountered",
    "CUDA error: uncorrectable NVLink error detected during the execution",
    "NVML: GPU is lost",
    "CUDA error: CUDA-capable device(s) is/are busy or unavailable",
])
def test_cudas_hardware_errors_are_faults_of_the_node(message):
    assert hardware_fault(RuntimeError(message))


@pytest.mark.parametrize("message", [
    "CUDA error: an illegal memory access was encountered",  # a kernel's bug: a new node fails alike
    "CUDA out of memory. Tried to allocate 2.00 GiB",
    "CUDA error: device-side assert triggered",
    "NCCL error: remote process exited or there was a network error",  # another rank's fault, not this GPU's
    "shapes cannot be multiplied (4x8 and 7x2)",
])
def test_a_programs_own_errors_are_not(message):
    assert hardware_fault(RuntimeError(message)) is None


@pytest.mark.parametrize(("message", "kind"), [
    ("CUDA error: uncorrectable ECC error encountered", "hardware"),
    ("CUDA error: an illegal memory access was encountered", "program"),
    ("CUDA error: misaligned address", "program"),
    ("CUDA error: hardware stack error", "program"),  # "stack corruption or exceeding the stack size limit"
    ("CUDA error: device-side assert triggered", "program"),
    ("CUDA error: unspecified launch failure\nCUDA kernel errors might be asynchronously reported", "ambiguous"),
    ("CUDA error: unknown error", "ambiguous"),
])
def test_cuda_errors_fall_in_the_class_the_cuda_documentation_gives(message, kind):
    """Hardware only where the device says so; the program's where CUDA's documentation gives the
    program as the cause; an unspecified launch failure or unknown error is decided by evidence."""
    from training.resilience.faults import classify_cuda_error

    assert classify_cuda_error(RuntimeError(message))[0] == kind


def test_a_fault_is_found_in_the_error_it_caused():
    try:
        try:
            raise RuntimeError("CUDA error: uncorrectable ECC error encountered")
        except RuntimeError as cause:
            raise ValueError("the step failed") from cause
    except ValueError as error:
        assert "ECC" in hardware_fault(error)


def _speeds(*tflops: float, source: str = "cuda") -> list[GpuSpeed]:
    return [GpuSpeed(rank, f"node-{rank // 8}", str(rank % 8), value, source) for rank, value in enumerate(tflops)]


def test_a_gpu_below_the_share_of_the_median_is_a_straggler():
    healthy = [700 * (1 + 0.02 * ((rank % 5) - 2) / 2) for rank in range(15)]  # within 2 %, as one type's GPUs run
    (found,) = stragglers(_speeds(*healthy, 560))  # throttled: 80 % of the median
    assert found[0].rank == 15 and found[1] == pytest.approx(0.8, abs=0.01)
    assert stragglers(_speeds(*healthy, 620)) == []  # 89 %: within the bar (85 %)
    assert stragglers(_speeds(*healthy)) == []
    assert slowest_share(_speeds(*healthy, 560)) == pytest.approx(0.8, abs=0.01)


def test_two_gpus_one_slow_and_what_is_not_judged():
    (found,) = stragglers(_speeds(700, 450))  # median 575: 0.78
    assert found[0].rank == 1
    assert stragglers(_speeds(700)) == []  # nothing to compare with
    assert stragglers(_speeds(700, 300, source="cpu")) == []  # CPU workers share cores: not judged
    assert slowest_share(_speeds(700, 300, source="cpu")) is None


def test_the_share_is_the_configured_one():
    assert stragglers(_speeds(700, 700, 650), share=0.95) and not stragglers(_speeds(700, 700, 650))
    assert STRAGGLER_SHARE == 0.85


def test_the_probes_line_names_the_straggler_with_its_node_and_gpu_and_the_ranks_step_times():
    speeds = [GpuSpeed(0, "ip-10-0-1-5", "0", 700, "cuda", 1.02), GpuSpeed(1, "ip-10-0-1-6", "3", 420, "cuda", 1.03),
              GpuSpeed(2, "ip-10-0-1-6", "4", 702, "cuda", 1.02)]
    line = describe_speeds(40, speeds)
    assert "slowest rank 1 (node ip-10-0-1-6) 420;" in line and "step time per rank 1.020-1.030 s" in line
    assert "STRAGGLER below 85% of the median: rank 1 (node ip-10-0-1-6 GPU 3) at 60%" in line
    assert "STRAGGLER" not in describe_speeds(40, speeds[::2])


def test_a_gpu_missing_from_the_pod():
    listed = [f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i})" for i in range(7)]
    problem = missing_gpus_problem(8, listed)
    assert "given 8 GPUs but nvidia-smi lists 7" in problem and "XID 79" in problem
    assert missing_gpus_problem(7, listed) is None
    assert missing_gpus_problem(8, None) is None  # no nvidia-smi: nothing to count


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_gpus_worker(rank: int, port: int, tflops: list[str], results) -> None:
    import training.resilience.health as health

    os.environ[health.FAKE_TFLOPS_ENV] = tflops[rank]
    health.here = lambda device, rank: {"ray_node": f"raynode{rank}", "node_name": f"ip-10-0-1-{rank}", "gpu": "2",
                                        "rank": rank}
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=len(tflops))
    try:
        results[rank] = health.check_gpus(torch.device("cpu"), rank)
    finally:
        dist.destroy_process_group()


def test_the_preflight_gpu_check_gathers_every_worker_and_names_the_stragglers_node_and_gpu():
    with mp.Manager() as manager:
        results = manager.dict()
        run_workers(_check_gpus_worker, args=(_free_port(), ["710", "705", "430"], results), nprocs=3)
        results = dict(results)
    faults, lines, _reads_node = results[1]
    assert not any(results[rank][2] for rank in range(3))  # outside a pod no rank reads a node
    assert results[0][0] == faults  # every worker has the same verdict
    (fault,) = faults
    assert (fault.kind, fault.node_name, fault.gpu, fault.rank, fault.ray_node) == ("straggler", "ip-10-0-1-2", "2", 2, "raynode2")
    assert "430 TFLOPS, at best 61% of the median 705 in 5 samples" in fault.reason
    assert "median 705 TFLOPS, slowest 430 (rank 2) over 3 workers" in lines[0]


def test_a_worker_taints_its_node_and_keeps_the_nodes_other_taints(monkeypatch):
    from training.resilience.kube import API_ENV, taint_node

    kube = FakeKubernetes("ip-10-0-1-6")
    kube.nodes["ip-10-0-1-6"]["spec"]["taints"] = [{"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}]
    monkeypatch.setenv(API_ENV, kube.url)
    kube.race_next_patch = True  # the kubelet updates the node meanwhile: the guarded patch is retried
    said = taint_node("ip-10-0-1-6", key="ray-train-eks/gpu-unhealthy", value="straggler")
    assert "tainted ray-train-eks/gpu-unhealthy=straggler:NoSchedule" in said and len(kube.patches) == 2
    assert kube.taints("ip-10-0-1-6") == [{"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"},
                                          {"key": "ray-train-eks/gpu-unhealthy", "value": "straggler", "effect": "NoSchedule"}]
    assert "already has" in taint_node("ip-10-0-1-6", key="ray-train-eks/gpu-unhealthy", value="straggler")
    with pytest.raises(RuntimeError, match="HTTP 404"):
        taint_node("ip-10-0-9-9", key="ray-train-eks/gpu-unhealthy", value="x")


def test_a_straggler_share_outside_zero_to_one_is_refused():
    from training.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match=r"straggler_share=1.5 must be between 0 and 1"):
        parse_config(["--preset", "tiny-cpu", "--straggler-share", "1.5"])
    with pytest.raises(ConfigError, match=r"health_check_every=-1"):
        parse_config(["--preset", "tiny-cpu", "--health-check-every", "-1"])


def test_a_false_condition_of_the_node_monitoring_agent_is_a_fault(monkeypatch):
    from training.resilience.health import node_condition_fault
    from training.resilience.kube import API_ENV

    kube = FakeKubernetes("ip-10-0-1-6")
    monkeypatch.setenv(API_ENV, kube.url)
    assert node_condition_fault("ip-10-0-1-6") is None  # no agent: no conditions
    kube.nodes["ip-10-0-1-6"]["status"] = {"conditions": [
        {"type": "Ready", "status": "True"}, {"type": "MemoryPressure", "status": "False"},  # false is fine there
        {"type": "AcceleratedHardwareReady", "status": "True"}]}
    assert node_condition_fault("ip-10-0-1-6") is None
    kube.nodes["ip-10-0-1-6"]["status"]["conditions"][2] = {
        "type": "AcceleratedHardwareReady", "status": "False", "reason": "NvidiaXID79Error", "message": "GPU fell off the bus"}
    assert node_condition_fault("ip-10-0-1-6") == "AcceleratedHardwareReady=False (NvidiaXID79Error: GPU fell off the bus)"


def test_a_monitoring_restart_is_not_a_fault_and_an_xid_after_it_is(monkeypatch, capsys):
    """The agent's conditions as the agent writes them (node_exporter.go ``Fatal``: false, the latest
    Fatal reason, the messages joined): DCGM restarted, so the agent cannot reach it a minute on and
    latches DCGMError, which it never clears: the node stays in the run (and says so). Then DCGM
    reports XID 79: the reason is the XID's, the messages both, and the node is out."""
    from training.resilience.health import node_condition_fault
    from training.resilience.kube import API_ENV

    kube = FakeKubernetes("ip-10-0-1-6")
    monkeypatch.setenv(API_ENV, kube.url)
    dcgm_lost = "failed to initialize DCGM: dial tcp 127.0.0.1:5555: connect: connection refused"
    kube.nodes["ip-10-0-1-6"]["status"] = {"conditions": [
        {"type": "AcceleratedHardwareReady", "status": "False", "reason": "DCGMError", "message": dcgm_lost}]}
    assert node_condition_fault("ip-10-0-1-6") is None
    assert "is the monitoring agent's own health, not a GPU fault" in capsys.readouterr().out
    kube.nodes["ip-10-0-1-6"]["status"]["conditions"][0].update(
        reason="NvidiaXID79Error", message=f"{dcgm_lost}; detected XID-79 on the instance, review kernel logs for additional "
                                           "information.")
    assert node_condition_fault("ip-10-0-1-6").startswith("AcceleratedHardwareReady=False (NvidiaXID79Error: ")
    # The reverse order (an XID, then DCGM lost): the reason is DCGMError, the XID still in the message.
    kube.nodes["ip-10-0-1-6"]["status"]["conditions"][0].update(
        reason="DCGMError", message="detected XID-48 on the instance, review kernel logs for additional information.; "
                                    + dcgm_lost)
    assert node_condition_fault("ip-10-0-1-6").startswith("AcceleratedHardwareReady=False (NvidiaXID48Error: ")
    kube.nodes["ip-10-0-1-6"]["status"]["conditions"][0].update(
        reason="DCGMError", message="detected 2 Nvidia Double Bit error(s) on GPU 3; " + dcgm_lost)
    assert node_condition_fault("ip-10-0-1-6").startswith("AcceleratedHardwareReady=False (NvidiaDoubleBitError: ")
    # An application-class XID the agent only warns about never sets the condition; its reason is no fault either.
    kube.nodes["ip-10-0-1-6"]["status"]["conditions"][0].update(reason="NvidiaXID13Warning", message="detected unknown XID-13")
    assert node_condition_fault("ip-10-0-1-6") is None


def test_the_first_rank_of_each_node_reads_its_conditions():
    from training.resilience.health import first_on_node

    labels = ["ip-10-0-1-5", "ip-10-0-1-6", "ip-10-0-1-5", "ip-10-0-1-6"]
    assert [first_on_node(labels, rank) for rank in range(4)] == [True, True, False, False]


def test_a_straggler_is_slow_in_every_sample_not_in_one():
    healthy = [GpuSpeed(rank, "node-0", str(rank), 700, "cuda", samples=(690, 700, 710)) for rank in range(7)]
    # One sample of 20 ms caught a clock change: 77 % once, at full speed in the others. Not a straggler.
    once = GpuSpeed(7, "node-0", "7", 700, "cuda", samples=(540, 700, 705))
    assert stragglers([*healthy, once]) == []
    # Throttled through every sample: one.
    throttled = GpuSpeed(7, "node-0", "7", 560, "cuda", samples=(555, 560, 580))
    ((found, share),) = stragglers([*healthy, throttled])
    assert found.rank == 7 and share == pytest.approx(580 / 700)  # judged by its best sample


def test_the_preflight_measures_several_samples_each_long_enough(monkeypatch):
    from training.resilience.health import PREFLIGHT_SAMPLES, matmul_tflops

    monkeypatch.delenv("RAY_TRAIN_EKS_FAKE_GPU_TFLOPS", raising=False)
    samples, source = matmul_tflops(torch.device("cpu"), 64, 2, 3, 0.05)
    assert source == "cpu" and len(samples) == 3 and all(value > 0 for value in samples)
    count, seconds = PREFLIGHT_SAMPLES
    assert count >= 5 and seconds >= 0.1  # an H100's 20 ms sample moved 15 %; 0.1 s are 60 matmuls


def test_a_nodes_conditions_are_read_on_a_clock_whatever_the_step_time(monkeypatch):
    """Node repair acts 10 minutes after a condition turns false: the first rank of each node reads
    the node about every minute, not every N steps (a step of 15 minutes would miss it)."""
    from training import loop

    reads = []
    now = [1000.0]
    monkeypatch.setattr(loop.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(loop, "check_node_conditions", lambda worker: (reads.append(now[0]),
                                                                        setattr(worker, "node_read_at", now[0])))
    worker = loop.Worker(config=None, invocation_id="i", rank=0, world=1, device=torch.device("cpu"),
                         reads_node=True, node_read_at=1000.0)  # the preflight read it
    for now[0] in (1010.0, 1059.0, 1060.0, 1100.0, 2000.0):  # after each step
        loop.read_node_on_clock(worker)
    assert reads == [1060.0, 2000.0]
    worker.reads_node = False  # another rank of the node reads it
    now[0] = 5000.0
    loop.read_node_on_clock(worker)
    assert reads == [1060.0, 2000.0]


@pytest.mark.parametrize("message", [
    # c10/cuda/CUDAFunctions.cpp, what torch.cuda.set_device raises once a GPU was lost (pytorch/pytorch#49081)
    "CUDA unknown error - this may be due to an incorrectly set up environment, e.g. changing env variable "
    "CUDA_VISIBLE_DEVICES after program start. Setting the available devices to be zero.",
    "CUDA error: invalid device ordinal",
])
def test_a_gpu_lost_before_the_first_kernel_is_a_fault_at_the_workers_start_only(message):
    from training.resilience.faults import start_fault

    assert start_fault(RuntimeError(message)) and hardware_fault(RuntimeError(message)) is None
    assert "ECC" in start_fault(RuntimeError("CUDA error: uncorrectable ECC error encountered"))
    assert start_fault(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")) is None
