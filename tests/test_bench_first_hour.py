"""The script for the first GPU hour has run before it meets its GPU: its ``--cpu`` dry run goes
through every part (tiny shapes, gloo, the CUDA calls skipped) and writes its table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_dry_run_goes_through_every_part_and_writes_its_table(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2"}
    done = subprocess.run([sys.executable, "-m", "bench.gpu_first_hour", "--cpu", "--out", str(tmp_path)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())["parts"]
    assert list(results) == ["step", "attention", "memory", "syncs", "families", "checkpointing"]
    assert all(entry["status"] == "ok" for entry in results.values()), results
    step = results["step"]["figures"]
    assert step["ours"]["tokens_per_s"] > 0 and step["seed_loop"]["tokens_per_s"] > 0
    # Every family's packed step gives the per-sample loss (fp32 on the CPU).
    assert all(diff < 1e-5 for diff in results["families"]["figures"]["relative_loss_difference"].values())
    assert results["memory"]["figures"]["plan_peak_gib"] > 0
    table = (tmp_path / "table.txt").read_text()
    assert all(part in table for part in results) and "attention: reference varlen kernel" in table
