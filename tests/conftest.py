"""Shared fixtures: each stack configuration is synthesized once per test session."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "20")
# Synth must never depend on the machine's AWS set-up.
for _var in ("CDK_DEFAULT_ACCOUNT", "CDK_DEFAULT_REGION", "AWS_REGION", "AWS_DEFAULT_REGION"):
    os.environ.pop(_var, None)

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
ASSET_HASH = re.compile(r"\b[0-9a-f]{64}\b")


@dataclass
class Synthesized:
    """One synthesized app: its stack object, template dict and cloud assembly folder."""

    stack: object
    template: dict
    outdir: Path

    def resources(self, type_: str) -> dict[str, dict]:
        """The template's resources of one CloudFormation type, by logical id."""
        return {k: v for k, v in self.template["Resources"].items() if v["Type"] == type_}

    def one(self, type_: str) -> dict:
        """The single resource of ``type_`` (fails if there are several)."""
        found = self.resources(type_)
        assert len(found) == 1, f"expected one {type_}, found {sorted(found)}"
        return next(iter(found.values()))


def synth_platform(tmp_dir: Path, context: dict | None = None) -> Synthesized:
    """Synthesize the app exactly as ``app.py`` does (cdk-nag included) with ``context``."""
    from aws_cdk import App

    from ray_train_eks.app import build_app

    app = App(outdir=str(tmp_dir), context={"region": "us-west-2", **(context or {})})
    stack = build_app(app)
    app.synth()
    template = json.loads((tmp_dir / f"{stack.stack_name}.template.json").read_text())
    return Synthesized(stack=stack, template=template, outdir=tmp_dir)


def normalise(template: dict) -> dict:
    """Template with asset hashes replaced, so snapshots survive library bumps."""
    return json.loads(ASSET_HASH.sub("<asset-hash>", json.dumps(template, sort_keys=True)))


@pytest.fixture(scope="session")
def default_platform(tmp_path_factory) -> Synthesized:
    """The default configuration (g6.12xlarge x 2), with an admin role and a narrow CIDR."""
    return synth_platform(
        tmp_path_factory.mktemp("default"),
        {"adminRoleArn": "arn:aws:iam::123456789012:role/Admin", "endpointAccessCidrs": "203.0.113.0/24"},
    )


@pytest.fixture(scope="session")
def p4d_platform(tmp_path_factory) -> Synthesized:
    """A type with four network cards (p4d.24xlarge), pinned AZs, an account, a capacity
    reservation and destroyData."""
    return synth_platform(
        tmp_path_factory.mktemp("p4d"),
        {
            "gpuInstanceType": "p4d.24xlarge",
            "gpuNodeCount": "3",
            "account": "123456789012",
            "region": "us-east-1",
            "availabilityZones": "us-east-1b,us-east-1c",
            "capacityReservationId": "cr-0123456789abcdef0",
            "destroyData": "true",
        },
    )
