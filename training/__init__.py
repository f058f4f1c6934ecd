"""FSDP supervised fine-tuning under Ray Train; what the RayJob runs (`python -m training.train`).

Self-contained: it runs inside the Ray Train DLC image (Ray 2.58, PyTorch 2.13,
transformers 5.x) and imports nothing from the CDK side of the repository.
"""
