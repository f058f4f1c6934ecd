"""``python -m ray_train_eks.cli``: the same command as ``ray-train-eks``."""

import sys

from ray_train_eks.cli.command import main

sys.exit(main())
