"""The local S3 (moto's server, bench/local_s3.py) of the storage tests: its bucket, and a free port."""

from __future__ import annotations

from bench.local_s3 import free_port

S3_BUCKET = "ray-train-eks-test"

__all__ = ["S3_BUCKET", "free_port"]
