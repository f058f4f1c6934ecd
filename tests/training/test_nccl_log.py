"""NCCL's warnings during training reach the job log as they happen, and the last ones still
do when the worker dies hard (as torch's watchdog kills it): a follower process prints them
from NCCL's log file; with NCCL logging to stdout, C stdout is line-buffered."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: A process that logs as NCCL does (fopen "w" + setlinebuf, src/debug.cc), with the follower
#: the training worker starts, and then dies by SIGABRT as the watchdog's abort does.
_DYING_WORKER = r"""
import os, sys, time
from training.resilience.nccl_log import NcclStyleLog
from training.resilience.preflight import start_nccl_logging

pattern, follower = start_nccl_logging()
log = NcclStyleLog(pattern)
log.write("host:1:1 [0] NCCL INFO NET/OFI Selected provider is efa")
log.write("host:1:1 [0] NCCL WARN NET/OFI Request completed with error")
print("worker: warned", flush=True)
time.sleep(float(sys.argv[1]))
log.write("host:1:1 [0] NCCL WARN last words before the watchdog")
os.abort()
"""


def test_the_follower_prints_warnings_as_they_come_and_the_last_ones_after_the_worker_died(tmp_path, monkeypatch):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for name in ("NCCL_DEBUG", "NCCL_DEBUG_FILE", "NCCL_DEBUG_SUBSYS"):
        env.pop(name, None)
    out = tmp_path / "worker.out"
    with out.open("wb") as stdout:
        worker = subprocess.Popen([sys.executable, "-c", _DYING_WORKER, "2"], stdout=stdout, env=env, cwd=tmp_path)
        deadline = time.monotonic() + 60
        while "NCCL WARN NET/OFI Request" not in out.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        live = out.read_text()
        worker.wait(timeout=60)
    assert worker.returncode == -6  # SIGABRT
    # While the worker still ran: its first warning, not the INFO line.
    assert "[nccl] host:1:1 [0] NCCL WARN NET/OFI Request completed with error" in live
    assert "last words" not in live
    deadline = time.monotonic() + 10
    while "last words" not in out.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    text = out.read_text()
    assert "[nccl] host:1:1 [0] NCCL WARN last words before the watchdog" in text
    assert "Selected provider" not in text
    assert text.count("NCCL WARN NET/OFI Request") == 1


def test_with_nccl_on_stdout_c_stdout_is_line_buffered(tmp_path):
    """-c ncclDebug=true: NCCL logs to C stdout, a file under Ray, block-buffered: a hard death
    would lose what the buffer holds. After start_nccl_logging each line is out at once."""
    script = ("import ctypes, os\nfrom training.resilience.preflight import start_nccl_logging\n"
              "assert start_nccl_logging() == (None, None)\n"
              "ctypes.CDLL(None).printf(b'host:1:1 [0] NCCL INFO Channel 00 via NET/OFI\\n')\nos.abort()\n")
    out = tmp_path / "worker.out"
    with out.open("wb") as stdout:
        done = subprocess.run([sys.executable, "-c", script], stdout=stdout, cwd=tmp_path,
                              env={**os.environ, "PYTHONPATH": str(ROOT), "NCCL_DEBUG": "INFO"})
    assert done.returncode == -6
    assert "NCCL INFO Channel 00 via NET/OFI" in out.read_text()


_DEDUP_PROBE = r'''
import json
import training.train  # sets what the driver reads when it imports ray
from ray._private.ray_logging import stdout_deduplicator

out = []
for rank in range(8):
    for line in (f"[nccl] ip-10-0-1-{rank}:{100 + rank}:{200 + rank} [{rank}] NCCL WARN NET/OFI peer {rank + 8} closed",
                 f"[train] step 10 loss 1.{rank}"):
        batch = {"ip": f"10.0.1.{rank}", "pid": 100 + rank, "lines": [line]}
        for emitted in stdout_deduplicator.deduplicate(batch):
            out.extend(emitted["lines"])
print(json.dumps(out))
'''


def test_every_ranks_nccl_warning_reaches_the_driver_log_not_one_for_all():
    """Through Ray's own deduplicator, as the driver runs it: eight ranks' NCCL warnings, which
    differ only in digits, all come through; a line of another kind still collapses."""
    import json
    import subprocess
    import sys

    found = json.loads(subprocess.run([sys.executable, "-c", _DEDUP_PROBE], capture_output=True, text=True, check=True,
                                      timeout=120).stdout.strip().splitlines()[-1])
    assert [line for line in found if line.startswith("[nccl]")] == [
        f"[nccl] ip-10-0-1-{rank}:{100 + rank}:{200 + rank} [{rank}] NCCL WARN NET/OFI peer {rank + 8} closed" for rank in range(8)]
    assert len([line for line in found if line.startswith("[train]")]) == 1  # the others wait to be counted as repeats


def test_the_follower_takes_the_node_out_at_the_first_hardware_error_in_either_log(tmp_path, monkeypatch):
    """What NCCL (its WARN lines) and torch's watchdog (the worker's stderr) say about a CUDA error
    inside a collective, just before the watchdog aborts the worker: the follower takes the node
    out once, at the first such line; a network warning or what the worker wrote before the
    follower started is no hardware fault. (The multi-node hardware run in test_preemption.py
    delivers it through a real SIGABRT and a real GCS.)"""
    import io

    from training.resilience import nccl_log

    taken = []
    monkeypatch.setattr(nccl_log, "take_out_of_the_run", lambda where, reason: taken.append((where, reason)))
    pattern = str(tmp_path / "nccl.%h.%p.log")
    stderr = tmp_path / "worker-1.err"
    stderr.write_text("an earlier attempt's line: CUDA error: unknown error\n")
    follower = nccl_log.Follower(pattern, os.getpid(), every_line=False, take_out={"ray_node": "n1"}, stderr=str(stderr))
    log = nccl_log.NcclStyleLog(pattern)
    out = io.StringIO()
    log.write("host:1:1 [0] NCCL WARN NET/OFI Request completed with error")
    follower.act(follower.new_lines() + follower.new_stderr_lines(), out)
    assert taken == []
    with stderr.open("a") as err:
        err.write("[rank0]:[E ProcessGroupNCCL.cpp:1595] [PG ID 0 PG GUID 0(default_pg) Rank 0] Process group watchdog "
                  "thread terminated with exception: CUDA error: uncorrectable ECC error encountered\n")
    log.write("host:1:1 [0] transport/net.cc:1083 NCCL WARN Cuda failure 220 'uncorrectable NVLink error detected during "
              "the execution'")
    follower.act(follower.new_lines() + follower.new_stderr_lines(), out)
    assert [where for where, _ in taken] == [{"ray_node": "n1"}]
    assert taken[0][1].startswith("uncorrectable NVLink error"), taken  # NCCL's line came first in the batch
    assert "a GPU hardware error in the worker's log" in out.getvalue()
    log.write("host:1:1 [0] NCCL WARN Cuda failure 214 'uncorrectable ECC error encountered'")
    follower.act(follower.new_lines(), out)
    assert len(taken) == 1  # once


def test_with_nccl_on_stdout_the_follower_still_watches_for_a_gpu_fault(tmp_path, monkeypatch):
    """-c ncclDebug=true: NCCL logs to the worker's stdout, so there is no NCCL file to follow; in a
    pod the follower still runs, reading the worker's stdout and stderr for a hardware error."""
    import io

    from training.resilience import nccl_log
    from training.resilience.preflight import start_nccl_logging

    taken = []
    monkeypatch.setattr(nccl_log, "take_out_of_the_run", lambda where, reason: taken.append(reason))
    stdout = tmp_path / "worker-1.out"
    stdout.write_text("")
    follower = nccl_log.Follower(None, os.getpid(), every_line=False, take_out={"ray_node": "n1"}, watched=(str(stdout),))
    with stdout.open("a") as out:
        out.write("host:1:1 [0] NCCL INFO Channel 00 via NET/OFI\nhost:1:1 [0] NCCL WARN Cuda failure 214 "
                  "'uncorrectable ECC error encountered'\n")
    follower.act(follower.new_lines() + follower.new_stderr_lines(), io.StringIO())
    assert len(taken) == 1 and taken[0].startswith("uncorrectable ECC error")
    # And the worker starts one: NCCL_DEBUG=INFO (the user's), a take-out identity.
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("NCCL_DEBUG_FILE", "placeholder")
    monkeypatch.delenv("NCCL_DEBUG_FILE")
    started = []
    monkeypatch.setattr("training.resilience.preflight.start_follower", lambda pattern, take_out: started.append((pattern, take_out)))
    monkeypatch.setattr("training.resilience.preflight.line_buffer_c_stdout", lambda: None)
    start_nccl_logging(take_out={"ray_node": "n1"})
    assert started == [(None, {"ray_node": "n1"})]


def test_a_stale_nccl_log_with_the_same_pid_is_not_this_workers(tmp_path, monkeypatch):
    """PIDs repeat: pods' PID namespaces (their first worker is often pid 101) and a /tmp shared by
    the tests' pod-like nodes, a reboot. A file left by an earlier process under this worker's name
    is removed before the follower starts (a CI run once took a fresh node out for an earlier
    run's ECC line); what this worker's NCCL then writes is read from its start."""
    import io

    from training.resilience import nccl_log

    taken = []
    monkeypatch.setattr(nccl_log, "take_out_of_the_run", lambda where, reason: taken.append(reason))
    monkeypatch.setattr(nccl_log.subprocess, "Popen", lambda *args, **kwargs: None)  # no follower process here
    pattern = str(tmp_path / "nccl.%h.%p.log")
    stale = tmp_path / f"nccl.host.{os.getpid()}.log"
    stale.write_text("vm:101:101 [0] NCCL WARN Cuda failure 214 'uncorrectable ECC error encountered' (an earlier pod's)\n")
    other = tmp_path / f"nccl.host.{os.getpid() + 1}.log"
    other.write_text("another pid's\n")
    nccl_log.start_follower(pattern, take_out={"ray_node": "n1"})
    assert not stale.exists() and other.exists()
    follower = nccl_log.Follower(pattern, os.getpid(), every_line=False, take_out={"ray_node": "n1"})
    out = io.StringIO()
    follower.act(follower.new_lines(), out)
    assert taken == []
    nccl_log.NcclStyleLog(pattern).write("host:1:1 [0] NCCL WARN Cuda failure 220 'uncorrectable NVLink error detected "
                                         "during the execution'")
    lines = follower.new_lines()
    assert lines == ["host:1:1 [0] NCCL WARN Cuda failure 220 'uncorrectable NVLink error detected during the execution'"]
    follower.act(lines, out)
    assert len(taken) == 1 and taken[0].startswith("uncorrectable NVLink error")
