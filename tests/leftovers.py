"""What a test run may not leave behind: a child process (a Ray node, a moto server, a
``ray start`` head), a non-daemon thread, or a connected Ray driver. Read from ``/proc``, so
that the check needs nothing installed (Ray vendors its psutil)."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

#: Children that live as long as the interpreter by design: jsii's node runtime, which
#: aws-cdk-lib starts at its first import and ends at exit, multiprocessing's resource tracker,
#: started at the first use of a multiprocessing lock or queue and ended at exit, and its fork
#: server, which the tests' gloo workers are forked from (tests/training/processes.py).
ALLOWED = ("jsii-runtime.js", "/lib/program.js", "multiprocessing.resource_tracker", "multiprocessing.forkserver")


def descendants(root: int) -> list[tuple[int, str]]:
    """Every live process below ``root``, with its command line."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[0] != "Z":  # a zombie has ended; only its parent's wait is missing
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, frontier = [], [root]
    while frontier:
        for child in children.get(frontier.pop(), []):
            try:
                command = (Path("/proc") / str(child) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            found.append((child, command.strip()))
            frontier.append(child)
    return found


def left_behind(*, wait_s: float = 15.0) -> list[str]:
    """What is still running, after up to ``wait_s`` for things that are on their way out."""
    deadline = time.time() + wait_s
    while True:
        problems = [f"process {pid}: {command[:200]}" for pid, command in descendants(os.getpid())
                    if not any(marker in command for marker in ALLOWED)]
        problems += [f"thread {thread.name!r} (not a daemon)" for thread in threading.enumerate()
                     if thread is not threading.main_thread() and not thread.daemon and thread.is_alive()]
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            problems.append("a Ray driver still connected (ray.shutdown() was not called)")
        if not problems or time.time() > deadline:
            return problems
        time.sleep(0.5)
