"""Worker preflight: before training, each worker checks what would otherwise fail slowly.

- The network: a short all-reduce across every worker measures bus bandwidth and reads
  which transport NCCL chose. When EFA is expected and NCCL fell back to TCP sockets
  (about half the speed) the run stops. The whole check (the group's creation, NCCL's
  connection set-up inside the first collective, the collectives) runs in a thread of its
  own that this worker waits for at most ``timeout_s``: NCCL creates and connects its
  communicator lazily inside the first ``all_reduce`` (Ray passes no ``device_id``), before
  ``work.wait(timeout)`` could apply, so only our own clock bounds it. A hung check is then
  aborted, and its group is destroyed either way (its communicator and buffers would
  otherwise stay on the GPU for the whole run).
- flash-attention, on the GPU worker that will run it (the driver is a CPU pod): imported
  and run once, since ``is_flash_attn_2_available()`` reads package metadata only
  (``transformers/utils/import_utils.py``) and a wheel built for another torch or CUDA
  passes it, then fails at model load.

A failed check is not an exception: Ray Train would retry it ``max_failures`` times and
the RayJob would start a new cluster for it. The workers agree on the verdict over a gloo
group and all return; the loop records why, and the driver exits with the reason.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import json
import os
import re
import sys
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from .nccl_log import line_buffer_c_stdout, start_follower

NCCL_LOG_PATTERN = "/tmp/ray-train-eks-nccl.%h.%p.log"
#: NCCL_DEBUG levels at which NCCL logs the INIT/NET lines the transport is read from.
_VERBOSE_LEVELS = ("INFO", "TRACE")
#: The preflight's NCCL group keeps its own (watchdog) timeout this far beyond our deadline,
#: so our verdict and the abort come first: with TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (Ray sets
#: it) the watchdog tears the process down, a worker failure Ray Train would retry.
WATCHDOG_MARGIN_S = 300


@dataclass(frozen=True)
class PreflightResult:
    """What a worker's preflight found; ``problems`` empty means go."""

    transport: str  # "efa", "socket", "ib", "libfabric" (provider not shown), "gloo", "unknown" or "skipped"
    bus_bandwidth_gbps: float | None
    lines: tuple[str, ...] = ()
    problems: tuple[str, ...] = field(default=())


def flush_c_stdio() -> None:
    """``fflush(NULL)``: write out every C stdio buffer of this process. NCCL logs with C
    stdio and never flushes (``src/debug.cc``), and a Ray worker's stdout is a file, so
    block-buffered: without this, lines NCCL printed can still sit in the buffer."""
    ctypes.CDLL(None).fflush(None)


def prepare_nccl_logging() -> str | None:
    """Make NCCL log the lines the preflight reads, respecting what the user asked for.

    With ``NCCL_DEBUG`` at INFO or TRACE (``-c ncclDebug=true`` sets INFO in the RayJob's
    workers), NCCL logs where the user said and nothing changes: the preflight reads its
    own process's output. Otherwise (unset, WARN, VERSION) NCCL logs INIT and NET at INFO
    into a file in the worker's /tmp, so the job log stays quiet; its key lines are echoed,
    and its warnings reach the job log through :func:`start_nccl_logging`'s follower. Returns
    the file pattern, or None.
    Call before the first NCCL communicator exists.
    """
    if os.environ.get("NCCL_DEBUG", "").upper() in _VERBOSE_LEVELS:
        return os.environ.get("NCCL_DEBUG_FILE")
    os.environ["NCCL_DEBUG"] = "INFO"
    os.environ["NCCL_DEBUG_SUBSYS"] = "INIT,NET"
    os.environ["NCCL_DEBUG_FILE"] = NCCL_LOG_PATTERN
    return NCCL_LOG_PATTERN


def nccl_log_text(pattern: str | None) -> str:
    """This process's NCCL log file(s) written under ``pattern`` (``%h`` host, ``%p`` pid),
    after flushing C stdio so that nothing NCCL wrote is still in its buffer."""
    if not pattern:
        return ""
    flush_c_stdio()
    paths = glob.glob(pattern.replace("%h", "*").replace("%p", str(os.getpid())))
    return "".join(open(path, errors="replace").read() for path in paths)


def start_nccl_logging(take_out: dict | None = None) -> tuple[str | None, subprocess.Popen | None]:
    """NCCL's log prepared (:func:`prepare_nccl_logging`) and on its way to the job log for
    the whole run (:mod:`training.resilience.nccl_log`): a file's WARN lines printed by a follower
    process as they are written and after this process is gone; or, when NCCL logs to
    stdout (``-c ncclDebug=true``), C stdout made line-buffered. Returns the file pattern
    (or None) and the follower (or None). Call before the first NCCL communicator exists.
    ``take_out``: the worker's identity, for the follower to take its node out at a GPU fault
    the worker did not live to handle (training/resilience/nccl_log.py)."""
    pattern = prepare_nccl_logging()
    if not pattern:
        line_buffer_c_stdout()
    if pattern or take_out:  # with NCCL on stdout the follower still watches for a GPU fault
        return pattern, start_follower(pattern, take_out=take_out)
    return None, None


class StdoutCapture:
    """Copies everything written to file descriptor 1 (NCCL's C stdio included: it is flushed
    first) into a temporary file from :meth:`start` until :meth:`release`, which puts fd 1
    back and writes the text out unchanged; ``text`` then holds it.

    :meth:`release` is idempotent and may be called from any thread: when the captured call
    hangs (the preflight's first all-reduce, in its own thread), the waiting thread releases
    the capture at the deadline, so the worker's later output is not lost in a file nobody
    reads. A disabled capture does nothing."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.text = ""
        self._lock = threading.Lock()
        self._saved: int | None = None
        self._sink = None

    def start(self) -> "StdoutCapture":
        if self.enabled:
            sys.stdout.flush()
            flush_c_stdio()
            self._saved = os.dup(1)
            self._sink = tempfile.TemporaryFile()
            os.dup2(self._sink.fileno(), 1)
        return self

    def release(self) -> str:
        with self._lock:
            if self._saved is None:
                return self.text
            sys.stdout.flush()
            flush_c_stdio()
            os.dup2(self._saved, 1)
            os.close(self._saved)
            self._saved = None
            self._sink.seek(0)
            self.text = self._sink.read().decode(errors="replace")
            self._sink.close()
        sys.stdout.write(self.text)
        sys.stdout.flush()
        return self.text


@contextlib.contextmanager
def captured_stdout(capture: bool):
    """A :class:`StdoutCapture` started for the block and released after it (unless someone
    released it already)."""
    held = StdoutCapture(capture).start()
    try:
        yield held
    finally:
        held.release()


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


class DeadlineExceeded(TimeoutError):
    """A bounded call did not return in time; it may still be running in its thread."""


def run_bounded(function: Callable[[], Any], timeout_s: float, name: str) -> Any:
    """``function()`` in a daemon thread, waited for at most ``timeout_s``: its result, its
    exception, or :class:`DeadlineExceeded` (the thread is left behind; a stuck NCCL call
    cannot be interrupted from Python, only aborted)."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = function()
        except BaseException as error:  # noqa: BLE001 - handed to the waiting thread
            outcome["error"] = error

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise DeadlineExceeded(f"{name} did not finish within {timeout_s:g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def flash_attention_problem(attn_implementation: str, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Why flash-attention cannot run on this worker's ``device``, or None: ``flash_attn``
    is imported (an ABI mismatch with torch or CUDA fails here, not at model load) and one
    tiny ``flash_attn_varlen_func`` runs on the device."""
    if attn_implementation != "flash_attention_2":
        return None
    fix = ("install a flash-attn built for this image's torch and CUDA, or use --attn-implementation sdpa (each packed "
           "sequence then runs as a row of its own with its own seq_len x seq_len mask: no flattened row, no varlen "
           "kernel, slower than flash-attn by what bench/gpu_first_hour.py measures)")
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception as error:  # noqa: BLE001 - ImportError, OSError (undefined symbol), RuntimeError
        return f"attn_implementation='flash_attention_2' but flash_attn does not import on this GPU worker ({type(error).__name__}: {error}); {fix}"
    try:
        q = torch.randn(5, 2, 64, device=device, dtype=dtype)
        cu_seqlens = torch.tensor([0, 2, 5], dtype=torch.int32, device=device)
        out = flash_attn_varlen_func(q, q, q, cu_seqlens, cu_seqlens, 3, 3, causal=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if tuple(out.shape) != tuple(q.shape):
            raise RuntimeError(f"returned shape {tuple(out.shape)} for {tuple(q.shape)}")
    except Exception as error:  # noqa: BLE001 - no kernel for this GPU, a CUDA mismatch
        return f"attn_implementation='flash_attention_2' but flash_attn_varlen_func fails on this GPU worker ({type(error).__name__}: {error}); {fix}"
    return None


def _abort(group) -> None:
    """Abort the preflight's NCCL group after its check hung or failed: its kernels stop and
    its communicator and buffers are freed (``ncclCommAbort``). Bounded, best effort. (gloo
    has no abort: a hung gloo collective ends at its group's timeout, in its own thread.)"""
    from torch.distributed.distributed_c10d import _abort_process_group

    with contextlib.suppress(Exception):
        run_bounded(lambda: _abort_process_group(group), 30, "preflight-abort")


def captures_stdout(device: torch.device) -> bool:
    """Whether the network check reads NCCL's log from this process's stdout: on a GPU, when
    NCCL logs verbosely to stdout (``-c ncclDebug=true``, no ``NCCL_DEBUG_FILE``)."""
    verbose = os.environ.get("NCCL_DEBUG", "").upper() in _VERBOSE_LEVELS and not os.environ.get("NCCL_DEBUG_FILE")
    return device.type == "cuda" and verbose


def network_check(*, device: torch.device, size_mib: int, expect_efa: bool, timeout_s: float,
                  nccl_log: str | None, iterations: int = 5) -> PreflightResult:
    """All-reduce ``size_mib`` MiB ``iterations`` times on a group of its own, all of it
    (creation, connection, collectives) bounded by ``timeout_s``; read the transport (NCCL's
    log on GPU, gloo on CPU). The group is destroyed afterwards, or aborted if it hung."""
    if size_mib <= 0:
        return PreflightResult("skipped", None)
    world = dist.get_world_size()
    backend = "nccl" if device.type == "cuda" else "gloo"
    held: dict[str, Any] = {}

    def check() -> tuple[float, str]:
        group = held["group"] = dist.new_group(backend=backend, timeout=timedelta(seconds=timeout_s + WATCHDOG_MARGIN_S))
        tensor = torch.ones(size_mib * 2**20 // 4, dtype=torch.float32, device=device)

        def all_reduce() -> None:
            dist.all_reduce(tensor, group=group)
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        # The first collective creates the communicator: NCCL logs its transport then.
        with captured_stdout(captures_stdout(device)) as printed:
            held["capture"] = printed
            all_reduce()
        start = time.perf_counter()
        for _ in range(iterations):
            all_reduce()
        return (time.perf_counter() - start) / iterations, printed.text

    try:
        seconds, printed = run_bounded(check, timeout_s, "preflight-all-reduce")
    except Exception as error:  # a hung or broken transport
        if "capture" in held:  # the hung thread never leaves its capture: give fd 1 back now
            held["capture"].release()
        if "group" in held and backend == "nccl":
            _abort(held["group"])
        return PreflightResult("unknown", None, problems=(
            f"the preflight all-reduce across {world} workers did not complete within {timeout_s:.0f} s ({error}); "
            "the network between the GPU nodes is broken or hangs (a link-local interface in NCCL_SOCKET_IFNAME, "
            "or the EFA security group does not allow all traffic to and from itself)",))
    dist.destroy_process_group(held["group"])
    if device.type == "cuda":
        transport, lines = detect_transport(nccl_log_text(nccl_log) + printed)
    else:
        transport, lines = "gloo", ()
    bandwidth = bus_bandwidth_gbps(size_bytes=size_mib * 2**20 // 4 * 4, seconds=seconds, world_size=world)
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


#: Set in the GPU worker pods (ray_train_eks.workload.pods, from charts.drain_hook): the pod's preStop command
#: with ``check`` appended, as a JSON list.
PRESTOP_CHECK_ENV = "RAY_TRAIN_EKS_PRESTOP_CHECK"


def prestop_problem(command_json: str | None, node_id: str, timeout_s: float = 60.0) -> str | None:
    """Why this pod's preStop hook would not drain this worker's Ray node, or None: the hook run
    as the kubelet will run it (its interpreter, its discovery of the node and the GCS), in check
    mode, must name this node. A hook that fails at a Spot notice costs a checkpoint interval."""
    if not command_json:
        return None
    command = json.loads(command_json)
    try:
        found = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"the pod's preStop hook could not run ({error}); a preemption would cost a checkpoint interval"
    if found.returncode != 0 or f"node {node_id} " not in found.stdout:
        said = (found.stderr.strip() or found.stdout.strip())[-400:]
        return (f"the pod's preStop hook would not drain this Ray node {node_id[:12]} (exit {found.returncode}: {said}); "
                "a preemption would cost a checkpoint interval")
    print(f"[preflight] {found.stdout.strip()}", flush=True)
    return None


def run_preflight(*, device: torch.device, size_mib: int, expect_efa: bool, attn_implementation: str,
                  timeout_s: float = 180.0, nccl_log: str | None = None, prestop_check: str | None = None,
                  node_id: str | None = None) -> PreflightResult:
    """Every check on this worker, then one verdict all workers share (collective).
    ``prestop_check`` (:data:`PRESTOP_CHECK_ENV`'s value, on one worker per pod) and ``node_id``
    (this worker's Ray node): see :func:`prestop_problem`.

    Returns the result with every worker's problems when any worker found one; the caller
    stops the run without raising (see the module docstring).
    """
    # The verdict's gloo group first, from this thread: group names follow the order of
    # creation, and the network check's group is created in a thread that may hang.
    verdict = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s + WATCHDOG_MARGIN_S))
    problems: list[str] = []
    attention = flash_attention_problem(attn_implementation, device) if device.type == "cuda" else None
    if attention:
        problems.append(attention)
    if prestop_check and node_id:
        prestop = prestop_problem(prestop_check, node_id)
        if prestop:
            problems.append(prestop)
    result = network_check(device=device, size_mib=size_mib, expect_efa=expect_efa, timeout_s=timeout_s, nccl_log=nccl_log)
    problems.extend(result.problems)
    for line in result.lines[:8]:
        print(f"[preflight] {line}", flush=True)
    if result.bus_bandwidth_gbps is not None:
        print(f"[preflight] transport={result.transport} all-reduce bus bandwidth={result.bus_bandwidth_gbps:.1f} GB/s "
              f"({size_mib} MiB x {dist.get_world_size()} workers)", flush=True)
    elif size_mib <= 0:
        print("[preflight] network check skipped (--preflight-mb 0)", flush=True)
    # One verdict for all: every worker learns every worker's problems, over gloo (it works
    # even when the GPU transport does not), so all stop together or none does.
    gathered: list = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(gathered, problems, group=verdict)
    except Exception as error:
        gathered = [problems + [f"the workers could not agree on the preflight verdict ({error})"]]
    dist.destroy_process_group(verdict)
    ranks: dict[str, list[int]] = {}
    for rank, found in enumerate(gathered):
        for problem in found:
            ranks.setdefault(problem, []).append(rank)
    every = tuple(f"worker(s) {','.join(map(str, who))}: {problem}" for problem, who in ranks.items())
    return PreflightResult(result.transport, result.bus_bandwidth_gbps, result.lines, every)
