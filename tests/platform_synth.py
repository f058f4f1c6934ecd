"""Synthesis helpers shared by the infrastructure tests (a module of its own: a
`conftest` import would be ambiguous beside tests/training/conftest.py)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

ASSET_HASH = re.compile(r"\b[0-9a-f]{64}\b")


@dataclass
class Synthesized:
    """One synthesized app: its stack object, template dict and cloud assembly folder."""

    stack: object
    template: dict
    outdir: Path
    #: The resources of the stack's nested stacks (the training code's: constructs/ray_workload.py), by logical id.
    nested: dict = field(default_factory=dict)

    def resources(self, type_: str) -> dict[str, dict]:
        """The resources of one CloudFormation type, by logical id: the template's and its nested stacks'."""
        return {k: v for k, v in {**self.template["Resources"], **self.nested}.items() if v["Type"] == type_}

    def one(self, type_: str) -> dict:
        """The single resource of ``type_`` (fails if there are several)."""
        found = self.resources(type_)
        assert len(found) == 1, f"expected one {type_}, found {sorted(found)}"
        return next(iter(found.values()))

    def ray_job(self) -> tuple[str, dict]:
        """The RayJob manifest resource's logical id and its RayJob (a plain JSON manifest, which
        holds the job's NetworkPolicies before it)."""
        ((key, obj),) = [(k, o) for k, objects in self.manifests().items() for o in objects if o["kind"] == "RayJob"]
        return key, obj

    def manifests(self) -> dict[str, list[dict]]:
        """Every plain JSON Kubernetes manifest resource: logical id -> its objects."""
        return {k: json.loads(r["Properties"]["Manifest"])
                for k, r in self.resources("Custom::AWSCDK-EKS-KubernetesResource").items()
                if isinstance(r["Properties"]["Manifest"], str)}

    def warnings(self) -> list[str]:
        """The warnings synth gave (CDK's annotations, as ``cdk synth`` prints them)."""
        metadata = json.loads((self.outdir / f"{self.stack.stack_name}.metadata.json").read_text())
        return [entry["data"] for entries in metadata.values() for entry in entries if entry["type"] == "aws:cdk:warning"]

    def logical_id(self, construct) -> str:
        """The logical id of ``construct``'s CloudFormation resource in this stack (through wrappers
        such as a CustomResource: the default child's, down to the CloudFormation element)."""
        construct = construct.node.default_child
        while not hasattr(construct, "logical_id"):
            construct = construct.node.default_child
        return self.stack.get_logical_id(construct)


def synth_platform(tmp_dir: Path, context: dict | None = None) -> Synthesized:
    """Synthesize the app exactly as ``app.py`` does (cdk-nag included) with ``context``. Every
    chart from its repository unless ``context`` says otherwise (``chartPackages``): what a
    developer's ``make upstream`` cache holds must not change the templates the tests see."""
    from aws_cdk import App

    from ray_train_eks.app import build_app

    app = App(outdir=str(tmp_dir / "cdk.out"), context={"region": "us-west-2", "chartPackages": "none", **(context or {})})
    stack = build_app(app, dist_dir=tmp_dir / "dist")
    app.synth()
    template = json.loads((tmp_dir / "cdk.out" / f"{stack.stack_name}.template.json").read_text())
    return Synthesized(stack=stack, template=template, outdir=tmp_dir / "cdk.out",
                       nested=nested_resources(tmp_dir / "cdk.out", stack.stack_name))


def nested_resources(outdir: Path, stack_name: str) -> dict[str, dict]:
    """The resources of ``stack_name``'s nested stacks, from their templates in the cloud assembly
    (``<stack name><nested stack id><hash>.nested.template.json``)."""
    found: dict[str, dict] = {}
    for path in sorted(outdir.glob(f"{stack_name}*.nested.template.json")):
        found.update(json.loads(path.read_text())["Resources"])
    return found


RAYJOB_HASH = re.compile(r"(finetune-?)[0-9a-f]{8}([0-9A-F]{8})?")


def normalise(template: dict) -> dict:
    """Template with asset hashes replaced, so snapshots survive library bumps, and with
    the training code (and the RayJob name hash that follows it) replaced, so they survive
    edits of training/ (tests/test_ray_workload.py covers those)."""
    template = json.loads(json.dumps(template))
    for resource in template["Resources"].values():
        manifest = resource.get("Properties", {}).get("Manifest")
        if isinstance(manifest, str):
            obj = json.loads(manifest)[0]
            if obj["kind"] == "ConfigMap" and obj["metadata"]["name"] == "ray-train-eks-code":
                resource["Properties"]["Manifest"] = "<training code ConfigMap>"
    text = ASSET_HASH.sub("<asset-hash>", json.dumps(template, sort_keys=True))
    return json.loads(RAYJOB_HASH.sub(r"\1<spec-hash>", text))
