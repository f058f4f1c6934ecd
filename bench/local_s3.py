"""A local S3 for the benchmarks and the storage tests: moto's server on 127.0.0.1 with a bucket."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_moto(bucket: str | None) -> tuple[subprocess.Popen, dict[str, str]]:
    """moto's server (every service it has: S3, SNS, SQS, ...), up, with ``bucket`` (None: none);
    returns the process and the AWS variables that point boto3 and pyarrow (Ray Train's storage) at
    it, for the caller to set."""
    port = free_port()
    server = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_REGION": "us-east-1", "AWS_DEFAULT_REGION": "us-east-1"}
    for _ in range(100):
        try:
            urllib.request.urlopen(env["AWS_ENDPOINT_URL"], timeout=1)
            break
        except OSError:
            time.sleep(0.1)
    if bucket is None:
        return server, env
    import boto3

    boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name=env["AWS_REGION"],
                 aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"]
                 ).create_bucket(Bucket=bucket)
    return server, env
