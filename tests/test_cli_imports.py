"""The ``ray-train-eks`` command never starts Node.js: what it imports (its own module, and the
platform's configuration for the defaults ``cdk deploy`` builds) imports no CDK, cdk8s or jsii
module. The rules both share live in ``ray_train_eks.rules``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Modules that load jsii, whose first import starts a Node.js process.
NODE_MODULES = ("aws_cdk", "constructs", "jsii", "cdk8s", "cdk8s_plus_36", "cdk_nag")

PROBE = f"""
import json, sys
from ray_train_eks.config import PlatformConfig
config = PlatformConfig.from_context({{}}, environ={{}})
spec = config.workload_spec()
assert spec.gpu_node_count == config.gpu_node_count and config.problems() == []
import ray_train_eks.cli
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in {NODE_MODULES!r})))
"""


def test_the_job_command_and_the_platform_defaults_import_no_cdk_so_never_start_node():
    # A clean interpreter: this test session has imported the CDK already.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
