"""The rules and defaults the stack and the ray-train-eks command share: each prop's check (a
``*_problem`` function taking the value and a :class:`ray_train_eks.validation.Prop`) and the
constants it rests on, one module a concern. The constructs raise them and import them back
(``ray_train_eks.constructs.cluster.kubernetes_version_problem`` still works); the platform
configuration (ray_train_eks/config.py) collects them for its context keys. Importing them
imports no CDK or cdk8s module, so ``ray-train-eks`` never starts Node.js.
"""
