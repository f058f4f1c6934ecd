"""Whole-template snapshots (asset hashes normalised). Update with `pytest --snapshot-update`."""

from __future__ import annotations

import pytest

from platform_synth import normalise

pytestmark = pytest.mark.synth


def test_default_template_snapshot(default_platform, snapshot):
    assert normalise(default_platform.template) == snapshot


def test_p4d_template_snapshot(p4d_platform, snapshot):
    assert normalise(p4d_platform.template) == snapshot


def test_karpenter_template_snapshot(karpenter_platform, snapshot):
    assert normalise(karpenter_platform.template) == snapshot
