"""`app.py` as the CDK CLI runs it: bad input stops synth with every problem listed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bad_context_fails_synth_with_one_message_listing_every_problem(tmp_path):
    env = {
        **os.environ,
        "CDK_OUTDIR": str(tmp_path),
        "CDK_CONTEXT_JSON": json.dumps({"gpuInstanceType": "g6.xlarge", "gpuNodeCount": "0", "region": "us-west-2"}),
    }
    result = subprocess.run([sys.executable, "app.py"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 1
    assert "error: 2 problem(s) in the ray-train-eks configuration" in result.stderr
    assert "gpuInstanceType='g6.xlarge': does not support EFA" in result.stderr
    assert "gpuNodeCount=0: at least 1 GPU node is needed" in result.stderr
    assert not list(tmp_path.glob("*.template.json"))
