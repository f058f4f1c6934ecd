"""Where the tests find upstream data: $RAY_TRAIN_EKS_UPSTREAM, then .cache/upstream/, then
../shared/k8s/; a skip that says `make upstream` where none has a file, a failure under CI for
what shared/k8s/ holds."""

from __future__ import annotations

import pytest

import upstream


@pytest.fixture
def folders(tmp_path, monkeypatch):
    named, cache, shared = (tmp_path / name for name in ("named", "cache", "shared"))
    monkeypatch.setattr(upstream, "CACHE", cache)
    monkeypatch.setattr(upstream, "SHARED", shared)
    monkeypatch.setenv(upstream.ENV_VAR, str(named))
    return named, cache, shared


def _write(folder, relative, text="x"):
    path = folder / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_the_named_folder_comes_first_then_the_cache_then_shared(folders):
    named, cache, shared = folders
    relative = "charts/kuberay-operator-v1.7.0/values.yaml"
    _write(shared, relative)
    assert upstream.upstream_file(relative) == shared / relative
    _write(cache, relative)
    assert upstream.upstream_file(relative) == cache / relative
    _write(named, relative)
    assert upstream.upstream_file(relative) == named / relative


def test_a_missing_file_skips_and_says_make_upstream(folders, monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="make upstream"):
        upstream.upstream_file("crds/kuberay-v1.7.0/ray.io_rayjobs.yaml")


def test_under_ci_a_missing_shared_file_fails_and_a_missing_package_skips(folders, monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI must have every file shared/k8s/ holds"):
        upstream.upstream_file("crds/kuberay-v1.7.0/ray.io_rayjobs.yaml")
    with pytest.raises(pytest.skip.Exception, match="make upstream"):
        upstream.upstream_file("packages/kuberay-operator-1.7.0.tgz")


def test_the_repository_holds_no_upstream_file():
    """No CRD, chart file or upstream reference is committed (they are looked up at test time)."""
    import subprocess

    tracked = subprocess.run(["git", "ls-files"], cwd=upstream.ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert "README.md" in tracked  # a checkout of this repository, as the tests always run in
    suspicious = [path for path in tracked
                  if path.endswith((".tgz", "Chart.yaml", "values.yaml", "cloudformation.yaml"))
                  or "fixtures/upstream" in path or path.split("/")[-1].startswith(("ray.io_", "karpenter.sh_", "karpenter.k8s.aws_"))]
    assert suspicious == []
