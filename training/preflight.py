"""Network preflight: before training, a short all-reduce across every worker measures
bus bandwidth and reads which transport NCCL chose. When EFA is expected and NCCL fell
back to TCP sockets (about half the speed, or hangs on a link-local interface), the job
fails at once instead of running slowly for hours."""

from __future__ import annotations

import glob
import os
import re
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

NCCL_LOG_PATTERN = "/tmp/ray-train-eks-nccl.%h.%p.log"


class NetworkPreflightError(RuntimeError):
    """NCCL is not using the network it should."""


@dataclass(frozen=True)
class PreflightResult:
    """What the preflight measured."""

    transport: str  # "efa", "socket", "ib", or "unknown"
    bus_bandwidth_gbps: float
    lines: tuple[str, ...]


def prepare_nccl_logging() -> None:
    """Make NCCL write its INIT/NET lines to a file we can read. NCCL reads these when
    its first communicator is created, which is the preflight's all-reduce."""
    os.environ["NCCL_DEBUG"] = "INFO"  # to the file below, not stdout; key lines are echoed
    os.environ["NCCL_DEBUG_SUBSYS"] = os.environ.get("NCCL_DEBUG_SUBSYS", "INIT,NET")
    os.environ["NCCL_DEBUG_FILE"] = NCCL_LOG_PATTERN


def detect_transport(log_text: str) -> tuple[str, tuple[str, ...]]:
    """Which network NCCL selected, from its debug log, and the lines that say so."""
    lines = tuple(line.strip() for line in log_text.splitlines() if re.search(r"NET/|Using network|OFI", line))
    text = "\n".join(lines)
    if re.search(r"NET/OFI Selected provider is efa|Using network (AWS )?Libfabric", text, re.IGNORECASE):
        return "efa", lines
    if re.search(r"Using network Socket|NET/Socket", text):
        return "socket", lines
    if re.search(r"Using network IB", text):
        return "ib", lines
    return "unknown", lines


def bus_bandwidth_gbps(*, size_bytes: int, seconds: float, world_size: int) -> float:
    """All-reduce bus bandwidth as nccl-tests defines it: size x 2(n-1)/n / time, in GB/s."""
    return size_bytes * 2 * (world_size - 1) / world_size / seconds / 1e9


def run_preflight(*, device: torch.device, size_mib: int, expect_efa: bool, iterations: int = 5) -> PreflightResult | None:
    """All-reduce ``size_mib`` MiB ``iterations`` times; fail if EFA was expected and not used.
    Returns None (and says so) on CPU or when ``size_mib`` is 0."""
    if device.type != "cuda" or size_mib <= 0:
        print("[preflight] network preflight skipped (CPU run or --preflight-mb 0)", flush=True)
        return None
    world = dist.get_world_size()
    tensor = torch.ones(size_mib * 2**20 // 4, dtype=torch.float32, device=device)
    dist.all_reduce(tensor)  # first collective: creates the NCCL communicator
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(iterations):
        dist.all_reduce(tensor)
    torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - start) / iterations
    log_text = "".join(open(path, errors="replace").read() for path in glob.glob(NCCL_LOG_PATTERN.replace("%h", "*").replace("%p", str(os.getpid()))))
    transport, lines = detect_transport(log_text)
    result = PreflightResult(transport, bus_bandwidth_gbps(size_bytes=tensor.numel() * 4, seconds=seconds, world_size=world), lines)
    for line in lines[:8]:
        print(f"[preflight] {line}", flush=True)
    print(f"[preflight] transport={result.transport} all-reduce bus bandwidth={result.bus_bandwidth_gbps:.1f} GB/s "
          f"({size_mib} MiB x {world} workers)", flush=True)
    if expect_efa and transport != "efa":
        raise NetworkPreflightError(
            f"NCCL uses {transport!r}, not EFA, between nodes ({result.bus_bandwidth_gbps:.1f} GB/s). Likely causes: "
            "the EFA device plugin is not running on this node (kubectl -n kube-system get ds "
            "aws-efa-k8s-device-plugin: desired must equal the GPU node count), so the pod got no "
            "vpc.amazonaws.com/efa device; FI_PROVIDER is not 'efa' or NCCL_NET_PLUGIN is not 'ofi' in the pod; or the "
            "EFA security group does not allow all traffic to and from itself. Set NCCL_DEBUG=INFO for the full log."
        )
    return result
