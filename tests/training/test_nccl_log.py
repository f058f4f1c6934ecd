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
