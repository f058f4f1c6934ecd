"""Wiring of the CDK app, shared by ``app.py`` and the tests."""

from __future__ import annotations

import sys
from pathlib import Path

from aws_cdk import App, Validations
from cdk_nag import AwsSolutionsChecks

from ray_train_eks.charts import write_dist
from ray_train_eks.config import PlatformConfig
from ray_train_eks.stacks import TrainingPlatformStack


def build_app(app: App, *, dist_dir: Path | None = Path("dist")) -> TrainingPlatformStack:
    """Read the configuration from ``app``'s context, add the platform stack and the
    cdk-nag AwsSolutions checks (an unacknowledged finding fails synth).

    Writes the Ray workload's manifests to ``dist_dir`` too (None: don't).
    Raises :class:`ray_train_eks.config.ConfigError` listing every configuration problem.
    """
    config = PlatformConfig.from_context(app.node.get_all_context())
    stack = TrainingPlatformStack(app, config.stack_name, config=config)
    Validations.of(app).add_plugins(AwsSolutionsChecks(app))
    if dist_dir is not None:
        # The same objects as YAML, for kubectl and GitOps users (both workloads).
        write_dist(stack.ray_workload.spec, stack.ray_workload.code_directory, dist_dir)
    print(f"[ray-train-eks] {config.stack_name} in {config.region}: {stack.cost.describe()}", file=sys.stderr)
    return stack
