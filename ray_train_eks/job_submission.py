"""Moved to :mod:`ray_train_eks.cli.job_submission` in round 9 (the job command's own package). This old path
still imports the same module, with a DeprecationWarning, and goes in a later release (CHANGELOG.md)."""

import sys
import warnings

from ray_train_eks.cli import job_submission as _moved

warnings.warn("ray_train_eks.job_submission moved to ray_train_eks.cli.job_submission; import it from there", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
