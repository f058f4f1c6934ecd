"""Moved to :mod:`ray_train_eks.cli.submitter_logs` in round 9 (the job command's own package). This old path
still imports the same module, with a DeprecationWarning, and goes in a later release (CHANGELOG.md)."""

import sys
import warnings

from ray_train_eks.cli import submitter_logs as _moved

warnings.warn("ray_train_eks.submitter_logs moved to ray_train_eks.cli.submitter_logs; import it from there", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
