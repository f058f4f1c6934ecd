"""The ``ray-train-eks`` command never starts Node.js: what it imports at run time (its package, and the
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


def test_the_job_commands_old_module_paths_import_the_moved_modules_with_a_deprecation_warning():
    """Round 9 moved the command's modules into ray_train_eks/cli/ (CHANGELOG.md): the old paths are
    the same module objects (a monkeypatch or an isinstance through either works), said deprecated."""
    import importlib
    import warnings

    for name in ("admission", "job_submission", "run_records", "submitter_logs", "kube"):
        sys.modules.pop(f"ray_train_eks.{name}", None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            old = importlib.import_module(f"ray_train_eks.{name}")
        assert old is importlib.import_module(f"ray_train_eks.cli.{name}")
        assert [str(w.message) for w in caught if w.category is DeprecationWarning] == [
            f"ray_train_eks.{name} moved to ray_train_eks.cli.{name}; import it from there"]


def test_the_names_the_single_module_command_had_are_importable_from_its_package():
    from ray_train_eks import cli

    names = ("main", "CliError", "ENDED", "ENDED_DEPLOYMENTS", "SUBMITTED_FILE", "installed_training_code", "state_of",
             "connect", "platform", "submit", "list_runs", "status", "logs", "stop", "stopped_note", "job_spec",
             "submit_objects", "cost_per_hour", "RUN_NAME")
    assert [name for name in names if not hasattr(cli, name)] == []
