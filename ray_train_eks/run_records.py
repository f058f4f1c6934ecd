"""Moved to :mod:`ray_train_eks.cli.run_records` in round 9 (the job command's own package). This old path
still imports the same module, with a DeprecationWarning, and goes in a later release (CHANGELOG.md)."""

import sys
import warnings

from ray_train_eks.cli import run_records as _moved

warnings.warn("ray_train_eks.run_records moved to ray_train_eks.cli.run_records; import it from there", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
