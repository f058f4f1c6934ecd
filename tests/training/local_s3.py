"""A local S3 (moto's server) for the storage tests: a free port and the bucket they use."""

from __future__ import annotations

import socket

S3_BUCKET = "ray-train-eks-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
