"""Fixtures of the training tests: the tiny tokenizer and model are built once, locally."""

from __future__ import annotations

import os
import sys

import pytest
from elastic_standins import FakeKV
from local_s3 import S3_BUCKET, exported


@pytest.fixture(autouse=True)
def _process_tracking_uri_restored():
    """The tracker's client sets the process's tracking URI, as MLflow keeps it for a subprocess
    (``mlflow.set_tracking_uri`` writes ``MLFLOW_TRACKING_URI``): in a pod that is the run's own, in
    this process the next test's default (training/config.py reads it). Each test gets the one before."""
    before = os.environ.get("MLFLOW_TRACKING_URI")
    yield
    if "mlflow" in sys.modules:
        from mlflow.tracking._tracking_service import utils

        utils._tracking_uri = before
    if before is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = before


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


class OneRankContext:
    """Ray Train's worker context (``ray.train.get_context``) of a run of one worker."""

    def get_world_rank(self):
        return 0

    def get_world_size(self):
        return 1


@pytest.fixture
def single_rank(tmp_path, monkeypatch):
    """One gloo rank in this process, and Ray Train's context saying so: the real training loop runs
    here (Ray Train's report and checkpoint calls are the test's to replace)."""
    import ray.train
    import torch.distributed as dist

    monkeypatch.setattr(ray.train, "get_context", lambda: OneRankContext())
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def tiny_loop(single_rank, monkeypatch, tmp_path, tiny_dir):
    """:func:`run_tiny_loop` with this test's monkeypatch, folder and tiny model, on one rank."""
    return lambda report, **options: run_tiny_loop(monkeypatch, tmp_path, tiny_dir, report, **options)


def run_tiny_loop(monkeypatch, tmp_path, tiny_dir, report, *, load_sharded=None, extra: dict | None = None, **options) -> None:
    """The real training loop on :func:`single_rank`'s one rank, on the tiny model with the tiny-cpu
    preset and ``options``; Ray Train's report is ``report`` (no checkpoint to restore, no
    preemption), the model load ``load_sharded`` where given, ``extra`` more of the loop's dict."""
    import ray.train

    from training import loop, prepare
    from training.config import PRESETS, TrainConfig

    if load_sharded is not None:
        monkeypatch.setattr(prepare, "load_sharded", load_sharded)
    monkeypatch.setattr(prepare, "resolve_model", lambda uri: str(tiny_dir))
    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: None)
    monkeypatch.setattr(ray.train, "get_preemption_info", lambda: None)
    monkeypatch.setattr(ray.train, "report", report)
    config = TrainConfig(**{**PRESETS["tiny-cpu"], "preset": "tiny-cpu", "storage_path": str(tmp_path / "runs"),
                            "num_workers": 1, "workers_per_node": 1, "max_samples": 200, "global_batch_size": 4, **options})
    loop.train_loop_per_worker({**config.to_dict(), "_invocation_id": "test", **(extra or {})})


@pytest.fixture(scope="module")
def s3_server():
    """moto's S3 server on 127.0.0.1 with one bucket; the AWS variables that point the
    storage code (pyarrow, as Ray Train's) at it, for this process and the Ray head."""
    from bench.local_s3 import start_moto

    server, env = start_moto(S3_BUCKET)
    with exported(env):
        yield env
    server.terminate()
    server.wait(timeout=30)


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real MLflow tracking server on 127.0.0.1 (tests/training/mlflow_server.py)."""
    from mlflow_server import MlflowServer

    server = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    yield server
    server.stop()


@pytest.fixture
def kv(monkeypatch) -> FakeKV:
    """Ray's key-value store of an elastic run's growth handshake (training/resilience/elastic.py), stood in."""
    from training.resilience import elastic

    store = FakeKV()
    monkeypatch.setattr(elastic, "_kv", lambda: store)
    return store
