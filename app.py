#!/usr/bin/env python3
"""CDK entry point (`cdk synth`, `cdk deploy`): wiring only."""

import sys

from aws_cdk import App

from ray_train_eks.app import build_app
from ray_train_eks.config import ConfigError

app = App()
try:
    build_app(app)
except ConfigError as error:
    sys.exit(f"error: {error}")
app.synth()
