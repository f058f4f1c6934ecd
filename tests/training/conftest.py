"""Fixtures of the training tests: the tiny tokenizer and model are built once, locally."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from local_s3 import S3_BUCKET, free_port


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A folder holding the tiny tokenizer and Qwen2 (built, not downloaded)."""
    from training.tiny import materialize_model

    return materialize_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tokenizer(tiny_dir):
    """The tiny tokenizer, loaded through ``AutoTokenizer`` as a real one is."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_dir))


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    """The tiny Qwen2, loaded through ``AutoModelForCausalLM`` with sdpa attention."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    return model


@pytest.fixture(scope="module")
def s3_server():
    """moto's S3 server on 127.0.0.1 with one bucket; the AWS variables that point the
    storage code (pyarrow, as Ray Train's) at it, for this process and the Ray head."""
    import urllib.request

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
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    import boto3

    boto3.client("s3").create_bucket(Bucket=S3_BUCKET)
    yield env
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    server.terminate()
    server.wait(timeout=30)
