"""Stacks: composition of the constructs, nothing more."""

from ray_train_eks.stacks.training_platform import TrainingPlatformStack

__all__ = ["TrainingPlatformStack"]
