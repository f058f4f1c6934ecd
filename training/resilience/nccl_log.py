"""NCCL's log in the job log, as it happens, and after the worker that wrote it is gone.

NCCL reads ``NCCL_DEBUG`` and ``NCCL_DEBUG_FILE`` once per process, at its first log call
(NVIDIA/nccl v2.29.7-1 ``src/debug.cc``: ``ncclDebugInit`` under ``if (ncclDebugLevel < 0)``),
so the file the preflight reads its transport from (quiet mode, :func:`training.resilience.preflight.
prepare_nccl_logging`) also receives every warning during training. NCCL opens that file with
``fopen(..., "w")`` and ``setlinebuf`` (same file): each line is in the file as soon as it is
logged, but nobody reads it there. When torch's watchdog tears the process down
(``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``, which Ray sets), no Python code of the worker runs again.

So each GPU worker (and each worker in a pod) starts a **follower**: this module run as a small
process of its own (no torch; Ray only when it must act), which inherits the worker's stdout,
polls the worker's NCCL log file and prints its new WARN lines (every line with ``--all``) to that
stdout, and, once the worker is gone, prints what is left and exits.

It also **takes the node out** (``--take-out``, training/resilience/faults.py ``take_node_out``:
recorded, tainted, drained) at the first line that reports a CUDA hardware error, in NCCL's
WARN lines (``Cuda failure %d '%s'``, NVIDIA/nccl src/include/checks.h) or in the worker's own stderr, where torch's watchdog writes
``Process group watchdog thread terminated with exception: CUDA error: ...`` before it aborts
the process (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp). With FSDP2 a collective is
nearly always in flight, so a sticky CUDA error usually ends the worker there, by SIGABRT,
before the loop's ``except`` could act: the follower, in a session of its own, is still there
to record the fault, so the controller counts the restart as a hardware fault (never against
``--max-failures``) and the next worker pod cannot land on the node. A Ray worker's stdout is its ``worker-*.out`` file (Ray 2.58
redirects fd 1 to it unless log rotation is on); Ray's log monitor keeps publishing lines
appended to that file after the worker died, until 200 log files are open on the node
(``python/ray/_private/log_monitor.py``, ``_close_all_files``, ``LOG_MONITOR_MAX_OPEN_FILES``).

With ``-c ncclDebug=true`` NCCL logs to the process's stdout instead, through C stdio, which is
block-buffered when stdout is a file: :func:`line_buffer_c_stdout` makes it line-buffered, so
those lines too reach the job log as they happen and none stays in a buffer at a crash.

    python -m training.resilience.nccl_log --pid PID --pattern '/tmp/ray-train-eks-nccl.%h.%p.log' [--all]
        [--take-out '{"invocation_id": ..., "gcs_address": ..., "ray_node": ..., "node_name": ..., "gpu": ..., "rank": ...}']
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from .faults import FAKE_NCCL_ABORT_ENV

#: How often the follower looks for new lines (seconds).
POLL_S = 0.2
PREFIX = "[nccl] "


def line_buffer_c_stdout() -> None:
    """``setvbuf(stdout, NULL, _IOLBF, 0)``: C stdio's stdout (NCCL's log when it has no file)
    written out at every newline instead of every 4 KiB. Call before NCCL logs anything."""
    libc = ctypes.CDLL(None)
    stdout = ctypes.c_void_p.in_dll(libc, "stdout")
    libc.setvbuf.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_size_t]
    libc.setvbuf(stdout, None, 1, 0)  # _IOLBF


def log_files(pattern: str, pid: int) -> list[str]:
    """The NCCL log files process ``pid`` writes under ``pattern`` (``%h`` host, ``%p`` pid)."""
    return sorted(glob.glob(pattern.replace("%h", "*").replace("%p", str(pid))))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _new_text(path: str, offsets: dict[str, int], final: bool) -> str:
    """The complete lines appended to ``path`` since ``offsets[path]`` (a trailing partial line
    waits, unless ``final``); ``offsets`` moves on. A file shorter than its offset was written
    anew (NCCL opens its log with ``fopen(..., "w")``): read from its start."""
    if os.path.getsize(path) < offsets.get(path, 0):
        offsets[path] = 0
    with open(path, "rb") as handle:
        handle.seek(offsets.get(path, 0))
        chunk = handle.read()
    end = len(chunk) if final else chunk.rfind(b"\n") + 1
    offsets[path] = offsets.get(path, 0) + end
    return chunk[:end].decode(errors="replace")


def remove_stale_logs(pattern: str, pid: int) -> list[str]:
    """Remove the NCCL log files under ``pattern`` that name ``pid`` before its NCCL starts: they
    are another process's (PIDs repeat: a pod's first worker is often pid 101 in its PID namespace,
    the tests' pod-like nodes share one /tmp), and their lines would pass for this worker's."""
    stale = log_files(pattern, pid)
    for path in stale:
        try:
            os.remove(path)
        except OSError:
            pass
    return stale


def output_file(fd: int = 2) -> str | None:
    """This process's stderr (or ``fd``) when it is a regular file (a Ray worker's ``worker-*.err``
    and ``.out``), else None. The follower inherits the worker's, so this is the file torch's
    watchdog writes to (and NCCL, when it logs to stdout)."""
    try:
        path = os.readlink(f"/proc/self/fd/{fd}")
        return path if os.path.isfile(path) else None
    except OSError:
        return None


class Follower:
    """Reads the new complete lines of a process's NCCL log files, file by file, and of its stderr;
    takes the node out at the first that reports a hardware fault (``take_out``: who and where)."""

    def __init__(self, pattern: str | None, pid: int, *, every_line: bool, take_out: dict | None = None,
                 stderr: str | None = None, watched: tuple[str | None, ...] = ()) -> None:
        self.pattern, self.pid, self.every_line = pattern, pid, every_line
        self.offsets: dict[str, int] = {}
        self.take_out, self.took_out = take_out, False
        #: Files read for a hardware fault only (never printed): the worker's stderr, and its stdout
        #: when NCCL logs there.
        self.watched = [path for path in dict.fromkeys((stderr, *watched)) if path]
        for path in self.watched:  # from where the worker is now: what it wrote before is not news
            self.offsets[path] = os.path.getsize(path)

    def new_lines(self, *, final: bool = False) -> list[str]:
        """Lines written since the last call (a trailing partial line waits, unless ``final``)."""
        out = []
        for path in log_files(self.pattern, self.pid) if self.pattern else []:
            for line in _new_text(path, self.offsets, final).splitlines():
                if line.strip() and (self.every_line or "NCCL WARN" in line):
                    out.append(line.rstrip())
        return out

    def new_stderr_lines(self, *, final: bool = False) -> list[str]:
        """Lines the process wrote to its stderr (and the other watched files) since the last call."""
        return [line for path in self.watched if os.path.isfile(path)
                for line in _new_text(path, self.offsets, final).splitlines()]

    def act(self, lines: list[str], out) -> None:
        """Take the node out at the first line that reports a hardware fault (once); else judge the
        first that reports a CUDA error that may be either (:func:`judge_ambiguous`, once)."""
        if not self.take_out or self.took_out:
            return
        from .faults import AMBIGUOUS_ERRORS, hardware_line
        from .faults import PROGRAM_ERRORS as WATCHDOG_PROGRAM_ERRORS

        for line in lines:
            what = hardware_line(line)
            if what:
                self.took_out = True
                out.write(f"{PREFIX}a GPU hardware error in the worker's log (pid {self.pid}): {line.strip()[:300]}\n")
                out.flush()
                take_out_of_the_run(self.take_out, f"{what}, in the worker's log: {line.strip()[:300]}")
                return
        for patterns, judge in ((AMBIGUOUS_ERRORS, judge_ambiguous), (WATCHDOG_PROGRAM_ERRORS, judge_program)):
            for line in lines:
                what = hardware_line(line, patterns)
                if what:
                    self.took_out = True
                    judge(self.take_out, what, line.strip()[:300], out)
                    return

    def run(self, out=sys.stdout) -> None:
        """Print new lines every :data:`POLL_S` until the process is gone, then the rest; act on them."""
        while True:
            alive = _alive(self.pid)
            lines = self.new_lines(final=not alive)
            for line in lines:
                out.write(f"{PREFIX}{line}\n")
            out.flush()
            self.act(lines + self.new_stderr_lines(final=not alive), out)
            if not alive:
                return
            time.sleep(POLL_S)


def take_out_of_the_run(where: dict, reason: str) -> None:
    """:func:`training.resilience.faults.take_node_out` from outside Ray's worker (this follower):
    through a GCS client of its own, with the worker's identity (``where``)."""
    from ray._raylet import GcsClient

    from .faults import Fault, take_node_out

    fault = Fault.from_record({**where, "kind": "gpu error", "reason": reason})
    take_node_out(fault, invocation_id=where["invocation_id"], gcs=GcsClient(address=where["gcs_address"]))


def judge_ambiguous(where: dict, what: str, line: str, out) -> None:
    """An unspecified launch failure or unknown error in the log of a worker torch's watchdog is
    ending, judged on evidence as the worker's own ``judge_cuda_error`` (training/loop.py) judges
    one it caught: hardware when the node's monitoring agent reports a GPU fault or the same error
    came on this node in an earlier attempt (the node is taken out); the program's when it came on
    another node (recorded for the controller, which stops the run with it; no node taken out);
    otherwise not known, and the restart counts as a failure."""
    from ray._raylet import GcsClient

    from .faults import UNHEALTHY_TAINT_ENV, record_program_error, record_suspect
    from .health import node_condition_fault
    from .preemption import COUNTS, retries_seen

    def say(text: str) -> None:
        out.write(f"{PREFIX}{text}\n")
        out.flush()

    node = where.get("node_name") or str(where.get("ray_node", ""))[:12]
    condition = None
    if where.get("node_name") and os.environ.get(UNHEALTHY_TAINT_ENV):
        try:
            condition = node_condition_fault(where["node_name"])
        except Exception as reading:  # noqa: BLE001 - the evidence is missing, not the decision
            say(f"could not read node {node}'s conditions ({type(reading).__name__}: {reading})")
    if condition:
        take_out_of_the_run(where, f"{what}, and the node's monitoring agent reports {condition}, in the worker's log: {line}")
        return
    gcs = GcsClient(address=where["gcs_address"])
    seen = retries_seen()  # the worker's, inherited: this attempt's number
    attempt = sum(seen[c] for c in COUNTS)
    earlier = record_suspect(where["invocation_id"], RuntimeError(line), node, attempt, int(where.get("rank", -1)), gcs=gcs)
    others = sorted({seen[1] for seen in earlier if seen[1] != node})
    if others:
        message = (f"{what} on node {node} (rank {where.get('rank')}), as in an earlier attempt on node(s) {', '.join(others)}: "
                   f"the same error on another node follows the code, not a GPU: the run stops with it and no node is taken "
                   f"out. {line}")
        record_program_error(where["invocation_id"], attempt, message, gcs=gcs)
        say(message)
    elif earlier:
        take_out_of_the_run(where, f"{what}, a second time on this node (it follows the node, not the code), in the "
                                   f"worker's log: {line}")
    else:
        say(f"{what} on node {node} in the worker's log: not known to be the GPU's (no fault on the node's conditions); "
            "retried from the last checkpoint as a failure. Again on this node takes it out; on another node stops the "
            "run as the program's error")


def judge_program(where: dict, what: str, line: str, out) -> None:
    """A program's CUDA error (an illegal address, a device-side assert) in the log of a worker
    torch's watchdog is ending (the usual way these errors end a worker under FSDP: asynchronously,
    inside a collective): never a node taken out; when the attempt before this one ended with the
    same error, it does not go away by retrying: recorded for the controller, which stops the run.
    (The follower does not know the step; a deterministic bug comes back in the very next attempt.)"""
    from ray._raylet import GcsClient

    from .faults import record_program_error, record_suspect
    from .preemption import COUNTS, retries_seen

    out.write(f"{PREFIX}{what} in the worker's log: the program's error, not the GPU's; no node is taken out\n")
    out.flush()
    gcs = GcsClient(address=where["gcs_address"])
    seen = retries_seen()
    attempt = sum(seen[c] for c in COUNTS)
    node = where.get("node_name") or str(where.get("ray_node", ""))[:12]
    earlier = record_suspect(where["invocation_id"], RuntimeError(line), node, attempt, int(where.get("rank", -1)), gcs=gcs)
    if any(seen[0] == attempt - 1 for seen in earlier):
        message = (f"{what} on node {node} (rank {where.get('rank')}), as in the attempt before: the program's error, not the "
                   f"GPU's, and retrying does not make it go away: the run stops with it and no node is taken out. {line}")
        record_program_error(where["invocation_id"], attempt, message, gcs=gcs)
        out.write(f"{PREFIX}{message}\n")
        out.flush()


class NcclStyleLog:
    """A log file written the way NCCL writes ``NCCL_DEBUG_FILE`` (``fopen(..., "w")``,
    ``setlinebuf``, one ``vfprintf`` per line: src/debug.cc), through this process's C stdio,
    at ``pattern`` with ``%h`` as ``host`` and ``%p`` as this process's id. It stands in for
    NCCL where there is none (the tests, on CPU)."""

    def __init__(self, pattern: str) -> None:
        self.libc = ctypes.CDLL(None)
        self.libc.fopen.restype = ctypes.c_void_p
        self.libc.setlinebuf.argtypes = [ctypes.c_void_p]
        self.libc.fprintf.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p]
        self.path = pattern.replace("%h", "host").replace("%p", str(os.getpid()))
        self.stream = self.libc.fopen(self.path.encode(), b"w")
        self.libc.setlinebuf(self.stream)

    def write(self, line: str) -> None:
        self.libc.fprintf(self.stream, b"%s\n", line.encode())


def maybe_fake_nccl_abort(step: int, nccl_log: str | None) -> None:
    """Testing aid: after ``step`` on a node whose environment has :data:`FAKE_NCCL_ABORT_ENV` at
    that step, end this process as torch's NCCL watchdog ends it at a CUDA error inside a
    collective (``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``, which Ray sets): NCCL's warning into its
    log file through C stdio (``nccl_log``, the file pattern NCCL writes), the watchdog's
    message on stderr (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp), then ``abort()``:
    SIGABRT, no Python handler, no ``finally``."""
    at = os.environ.get(FAKE_NCCL_ABORT_ENV)
    if not at or int(at) != step:
        return
    if nccl_log:
        NcclStyleLog(nccl_log).write(f"{os.uname().nodename}:{os.getpid()}:{os.getpid()} [0] transport/net.cc:1083 "
                                     "NCCL WARN Cuda failure 214 'uncorrectable ECC error encountered' "
                                     f"(injected: {FAKE_NCCL_ABORT_ENV}={at} on this node)")
    os.write(2, b"[rank0]:[E ProcessGroupNCCL.cpp:1595] [PG ID 0 PG GUID 0(default_pg) Rank 0] Process group "
                b"watchdog thread terminated with exception: CUDA error: uncorrectable ECC error encountered\n"
                b"terminate called after throwing an instance of 'c10::DistBackendError'\n")
    os.abort()



def start_follower(pattern: str | None, *, every_line: bool = False, take_out: dict | None = None) -> subprocess.Popen:
    """Start the follower of this process's NCCL log, on this process's stdout and stderr, in a
    session of its own: in the worker's process group it dies with the worker (seen with Ray
    2.58: a Ray worker killed by SIGABRT took the follower along, and the last line it had to
    print was lost), which is exactly when it has work left. ``take_out``: this worker's identity
    (:func:`take_out_of_the_run`), to take its node out at a hardware fault; None: only print."""
    if pattern:
        remove_stale_logs(pattern, os.getpid())
    package_root = str(Path(__file__).resolve().parents[2])  # the folder that holds ``training``
    args = [sys.executable, "-m", "training.resilience.nccl_log", "--pid", str(os.getpid())]
    if pattern:
        args += ["--pattern", pattern]
    if every_line:
        args.append("--all")
    if take_out:
        args += ["--take-out", json.dumps(take_out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen(args, stdin=subprocess.DEVNULL, close_fds=True, start_new_session=True, env=env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Print a process's NCCL log lines as they are written.")
    parser.add_argument("--pid", type=int, required=True)
    parser.add_argument("--pattern", help="NCCL's log files (NCCL_DEBUG_FILE); none: NCCL logs to stdout")
    parser.add_argument("--all", action="store_true", help="every line, not only NCCL WARN lines")
    parser.add_argument("--take-out", type=json.loads, help="the worker's identity (JSON): take its node out at a GPU fault")
    args = parser.parse_args(argv)
    Follower(args.pattern, args.pid, every_line=args.all, take_out=args.take_out,
             stderr=output_file(2) if args.take_out else None,
             watched=(output_file(1),) if args.take_out and not args.pattern else ()).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
