"""Fixtures of the training tests: the tiny tokenizer and model are built once, locally."""

from __future__ import annotations

import os

import pytest
from local_s3 import S3_BUCKET


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A folder holding the tiny tokenizer and Qwen2 (built, not downloaded)."""
    from training.storage.tiny import materialize_model

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
    from bench.local_s3 import start_moto

    server, env = start_moto(S3_BUCKET)
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    yield env
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    server.terminate()
    server.wait(timeout=30)


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real MLflow tracking server on 127.0.0.1 (tests/training/mlflow_server.py)."""
    from mlflow_server import MlflowServer

    server = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    yield server
    server.stop()
