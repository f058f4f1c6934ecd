"""Worker preflight: before training, each worker checks what would otherwise fail slowly.

- The network: a short all-reduce across every worker measures bus bandwidth and reads
  which transport NCCL chose. When EFA is expected and NCCL fell back to TCP sockets
  (about half the speed) the run stops; a transport that hangs stops it within
  ``timeout_s`` (its own process group with a short timeout), not after the default 30 minutes.
- flash-attention, on the GPU worker that will run it (the driver is a CPU pod).

A failed check is not an exception: Ray Train would retry it ``max_failures`` times and
the RayJob would start a new cluster for it. The workers agree on the verdict over a gloo
group and all return; the loop records why, and the driver exits with the reason.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

NCCL_LOG_PATTERN = "/tmp/ray-train-eks-nccl.%h.%p.log"
#: NCCL_DEBUG levels at which NCCL logs the INIT/NET lines the transport is read from.
_VERBOSE_LEVELS = ("INFO", "TRACE")


@dataclass(frozen=True)
class PreflightResult:
    """What a worker's preflight found; ``problems`` empty means go."""

    transport: str  # "efa", "socket", "ib", "libfabric" (provider not shown), "gloo", "unknown" or "skipped"
    bus_bandwidth_gbps: float | None
    lines: tuple[str, ...] = ()
    problems: tuple[str, ...] = field(default=())


def prepare_nccl_logging() -> str | None:
    """Make NCCL log the lines the preflight reads, respecting what the user asked for.

    With ``NCCL_DEBUG`` at INFO or TRACE (``-c ncclDebug=true`` sets INFO in the RayJob's
    workers), NCCL logs where the user said and nothing changes: the preflight reads its
    own process's output. Otherwise (unset, WARN, VERSION) NCCL logs INIT and NET at INFO
    into a file in the worker's /tmp, so the job log stays quiet; its key lines are echoed,
    and its warnings are printed if the run fails. Returns the file pattern, or None.
    Call before the first NCCL communicator exists.
    """
    if os.environ.get("NCCL_DEBUG", "").upper() in _VERBOSE_LEVELS:
        return os.environ.get("NCCL_DEBUG_FILE")
    os.environ["NCCL_DEBUG"] = "INFO"
    os.environ["NCCL_DEBUG_SUBSYS"] = "INIT,NET"
    os.environ["NCCL_DEBUG_FILE"] = NCCL_LOG_PATTERN
    return NCCL_LOG_PATTERN


def nccl_log_text(pattern: str | None) -> str:
    """This process's NCCL log file(s) written under ``pattern`` (``%h`` host, ``%p`` pid)."""
    if not pattern:
        return ""
    paths = glob.glob(pattern.replace("%h", "*").replace("%p", str(os.getpid())))
    return "".join(open(path, errors="replace").read() for path in paths)


def nccl_warnings(pattern: str | None) -> list[str]:
    """NCCL's WARN lines from the log file (quiet mode), to print when a run fails."""
    return [line.strip() for line in nccl_log_text(pattern).splitlines() if "NCCL WARN" in line]


@contextlib.contextmanager
def captured_stdout(capture: bool):
    """Copy everything written to file descriptor 1 inside the block (NCCL's C stdout
    included) and write it back out unchanged afterwards. Yields a list that then holds the text."""
    text: list[str] = []
    if not capture:
        yield text
        return
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 1)
        try:
            yield text
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
            sink.seek(0)
            text.append(sink.read().decode(errors="replace"))
            sys.stdout.write(text[0])
            sys.stdout.flush()


def detect_transport(log_text: str) -> tuple[str, tuple[str, ...]]:
    """Which network NCCL selected, from its debug log, and the lines that say so.

    EFA only when aws-ofi-nccl says the provider it selected is efa (``NET/OFI Selected
    provider is efa`` and ``Selected Provider is efa`` are both seen): "Using network
    Libfabric" alone means the OFI plugin loaded, not which provider it took.
    """
    lines = tuple(line.strip() for line in log_text.splitlines() if re.search(r"NET/|Using network|OFI", line))
    text = "\n".join(lines)
    if re.search(r"Selected provider is efa\b", text, re.IGNORECASE):
        return "efa", lines
    if re.search(r"Using network Socket|NET/Socket", text):
        return "socket", lines
    if re.search(r"Using network IB", text):
        return "ib", lines
    if re.search(r"Using network (AWS )?Libfabric", text, re.IGNORECASE):
        return "libfabric", lines
    return "unknown", lines


def bus_bandwidth_gbps(*, size_bytes: int, seconds: float, world_size: int) -> float:
    """All-reduce bus bandwidth as nccl-tests defines it: size x 2(n-1)/n / time, in GB/s."""
    return size_bytes * 2 * (world_size - 1) / world_size / seconds / 1e9


def flash_attention_problem(attn_implementation: str) -> str | None:
    """Why flash-attention cannot run on this worker, or None."""
    if attn_implementation != "flash_attention_2":
        return None
    from transformers.utils import is_flash_attn_2_available

    if not is_flash_attn_2_available():
        return ("attn_implementation='flash_attention_2' but flash-attn is not usable on this GPU worker "
                "(not installed, or no supported GPU); use --attn-implementation sdpa")
    return None


def network_check(*, device: torch.device, size_mib: int, expect_efa: bool, timeout_s: float,
                  nccl_log: str | None, iterations: int = 5) -> PreflightResult:
    """All-reduce ``size_mib`` MiB ``iterations`` times on a group of its own that times
    out after ``timeout_s``; read the transport (NCCL's log on GPU, gloo on CPU)."""
    if size_mib <= 0:
        return PreflightResult("skipped", None)
    world = dist.get_world_size()
    backend = "nccl" if device.type == "cuda" else "gloo"
    # The group's own timeout (after which the NCCL watchdog may end the process: a worker
    # failure, which Ray Train retries) is a minute longer than the wait below, so a hung
    # transport reaches this code as an exception first and becomes a verdict.
    group = dist.new_group(backend=backend, timeout=timedelta(seconds=timeout_s + 60))
    tensor = torch.ones(size_mib * 2**20 // 4, dtype=torch.float32, device=device)

    def all_reduce() -> None:
        work = dist.all_reduce(tensor, group=group, async_op=True)
        work.wait(timeout=timedelta(seconds=timeout_s))
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    verbose = os.environ.get("NCCL_DEBUG", "").upper() in _VERBOSE_LEVELS and not os.environ.get("NCCL_DEBUG_FILE")
    try:
        # The first collective creates the communicator: NCCL logs its transport then.
        with captured_stdout(device.type == "cuda" and verbose) as printed:
            all_reduce()
        start = time.perf_counter()
        for _ in range(iterations):
            all_reduce()
        seconds = (time.perf_counter() - start) / iterations
    except Exception as error:  # a hung or broken transport: the group timed out or failed
        return PreflightResult("unknown", None, problems=(
            f"the preflight all-reduce across {world} workers did not complete within {timeout_s:.0f} s ({error}); "
            "the network between the GPU nodes is broken or hangs (a link-local interface in NCCL_SOCKET_IFNAME, "
            "or the EFA security group does not allow all traffic to and from itself)",))
    if device.type == "cuda":
        transport, lines = detect_transport(nccl_log_text(nccl_log) + "".join(printed))
    else:
        transport, lines = "gloo", ()
    bandwidth = bus_bandwidth_gbps(size_bytes=tensor.numel() * 4, seconds=seconds, world_size=world)
    problems = ()
    if expect_efa and transport != "efa":
        problems = (
            f"the workers' transport is {transport!r}, not EFA. Likely causes: the EFA device "
            "plugin is not running on this node (kubectl -n kube-system get ds aws-efa-k8s-device-plugin: desired "
            "must equal the GPU node count), so the pod got no vpc.amazonaws.com/efa device; FI_PROVIDER is not "
            "'efa' or NCCL_NET_PLUGIN is not 'ofi' in the pod; or the EFA security group does not allow all traffic "
            "to and from itself. Deploy with -c ncclDebug=true for NCCL's whole log.",
        )
    return PreflightResult(transport, bandwidth, lines, problems)


def run_preflight(*, device: torch.device, size_mib: int, expect_efa: bool, attn_implementation: str,
                  timeout_s: float = 180.0, nccl_log: str | None = None) -> PreflightResult:
    """Every check on this worker, then one verdict all workers share (collective).

    Returns the result with every worker's problems when any worker found one; the caller
    stops the run without raising (see the module docstring).
    """
    problems: list[str] = []
    attention = flash_attention_problem(attn_implementation) if device.type == "cuda" else None
    if attention:
        problems.append(attention)
    result = network_check(device=device, size_mib=size_mib, expect_efa=expect_efa, timeout_s=timeout_s, nccl_log=nccl_log)
    problems.extend(result.problems)
    for line in result.lines[:8]:
        print(f"[preflight] {line}", flush=True)
    if result.bus_bandwidth_gbps is not None:
        print(f"[preflight] transport={result.transport} all-reduce bus bandwidth={result.bus_bandwidth_gbps:.1f} GB/s "
              f"({size_mib} MiB x {dist.get_world_size()} workers)", flush=True)
    else:
        print("[preflight] network check skipped (--preflight-mb 0)", flush=True)
    # One verdict for all: every worker learns every worker's problems, over gloo (it works
    # even when the GPU transport does not), so all stop together or none does.
    verdict = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    gathered: list = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(gathered, problems, group=verdict)
    except Exception as error:
        gathered = [problems + [f"the workers could not agree on the preflight verdict ({error})"]]
    ranks: dict[str, list[int]] = {}
    for rank, found in enumerate(gathered):
        for problem in found:
            ranks.setdefault(problem, []).append(rank)
    every = tuple(f"worker(s) {','.join(map(str, who))}: {problem}" for problem, who in ranks.items())
    return PreflightResult(result.transport, result.bus_bandwidth_gbps, result.lines, every)
