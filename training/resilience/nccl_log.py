"""NCCL's log in the job log, as it happens, and after the worker that wrote it is gone.

NCCL reads ``NCCL_DEBUG`` and ``NCCL_DEBUG_FILE`` once per process, at its first log call
(NVIDIA/nccl v2.29.7-1 ``src/debug.cc``: ``ncclDebugInit`` under ``if (ncclDebugLevel < 0)``),
so the file the preflight reads its transport from (quiet mode, :func:`training.resilience.preflight.
prepare_nccl_logging`) also receives every warning during training. NCCL opens that file with
``fopen(..., "w")`` and ``setlinebuf`` (same file): each line is in the file as soon as it is
logged, but nobody reads it there. When torch's watchdog tears the process down
(``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``, which Ray sets), no Python code of the worker runs again.

So each GPU worker starts a **follower**: this file run as a small process of its own (no
torch, no Ray), which inherits the worker's stdout, polls the worker's NCCL log file and prints
its new WARN lines (every line with ``--all``) to that stdout, and, once the worker is gone,
prints what is left and exits. A Ray worker's stdout is its ``worker-*.out`` file (Ray 2.58
redirects fd 1 to it unless log rotation is on); Ray's log monitor keeps publishing lines
appended to that file after the worker died, until 200 log files are open on the node
(``python/ray/_private/log_monitor.py``, ``_close_all_files``, ``LOG_MONITOR_MAX_OPEN_FILES``).

With ``-c ncclDebug=true`` NCCL logs to the process's stdout instead, through C stdio, which is
block-buffered when stdout is a file: :func:`line_buffer_c_stdout` makes it line-buffered, so
those lines too reach the job log as they happen and none stays in a buffer at a crash.

    python training/resilience/nccl_log.py --pid PID --pattern '/tmp/ray-train-eks-nccl.%h.%p.log' [--all]
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import os
import subprocess
import sys
import time
from pathlib import Path

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


class Follower:
    """Reads the new complete lines of a process's NCCL log files, file by file."""

    def __init__(self, pattern: str, pid: int, *, every_line: bool) -> None:
        self.pattern, self.pid, self.every_line = pattern, pid, every_line
        self.offsets: dict[str, int] = {}

    def new_lines(self, *, final: bool = False) -> list[str]:
        """Lines written since the last call (a trailing partial line waits, unless ``final``)."""
        out = []
        for path in log_files(self.pattern, self.pid):
            with open(path, "rb") as handle:
                handle.seek(self.offsets.get(path, 0))
                chunk = handle.read()
            end = len(chunk) if final else chunk.rfind(b"\n") + 1
            self.offsets[path] = self.offsets.get(path, 0) + end
            for line in chunk[:end].decode(errors="replace").splitlines():
                if line.strip() and (self.every_line or "NCCL WARN" in line):
                    out.append(line.rstrip())
        return out

    def run(self, out=sys.stdout) -> None:
        """Print new lines every :data:`POLL_S` until the process is gone, then the rest."""
        while True:
            alive = _alive(self.pid)
            for line in self.new_lines(final=not alive):
                out.write(f"{PREFIX}{line}\n")
            out.flush()
            if not alive:
                return
            time.sleep(POLL_S)


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


def start_follower(pattern: str, *, every_line: bool = False) -> subprocess.Popen:
    """Start the follower of this process's NCCL log, on this process's stdout and stderr, in a
    session of its own: in the worker's process group it dies with the worker (seen with Ray
    2.58: a Ray worker killed by SIGABRT took the follower along, and the last line it had to
    print was lost), which is exactly when it has work left."""
    args = [sys.executable, str(Path(__file__).resolve()), "--pid", str(os.getpid()), "--pattern", pattern]
    return subprocess.Popen([*args, "--all"] if every_line else args, stdin=subprocess.DEVNULL, close_fds=True,
                            start_new_session=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Print a process's NCCL log lines as they are written.")
    parser.add_argument("--pid", type=int, required=True)
    parser.add_argument("--pattern", required=True)
    parser.add_argument("--all", action="store_true", help="every line, not only NCCL WARN lines")
    args = parser.parse_args(argv)
    Follower(args.pattern, args.pid, every_line=args.all).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
