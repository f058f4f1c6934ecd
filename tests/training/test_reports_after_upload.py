"""Checkpoints off the critical path, end to end: after an asynchronous checkpoint's report, the
next steps' metric reports do not wait for its upload (storage on a local S3: moto's server), and
checkpoint folders a failed upload left on the node's scratch disk are swept when a writer starts."""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.distributed
#: Big enough that moto takes seconds to store it.
CHECKPOINT_MB = 64


def _loop(config: dict) -> None:
    import ray.train

    from training.reporting import report_metrics

    folder = os.path.join(config["scratch"], "checkpoint")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "weights.bin"), "wb") as handle:
        handle.write(os.urandom(CHECKPOINT_MB * 2**20))
    worker = SimpleNamespace(checkpoints=SimpleNamespace(asynchronous=True))
    started = time.perf_counter()
    ray.train.report({"step": 1}, checkpoint=ray.train.Checkpoint.from_directory(folder),
                     checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC, delete_local_checkpoint_after_upload=True)
    reports = []
    for step in (2, 3, 4):  # the next steps' metrics, while the upload runs
        before = time.perf_counter()
        report_metrics(worker, {"step": step})
        reports.append(time.perf_counter() - before)
    ray.train.report({"step": 5})  # synchronous: waits for the upload and every report before it
    with open(config["out"], "w") as handle:
        json.dump({"reports_s": reports, "upload_s": time.perf_counter() - started}, handle)


def test_metric_reports_after_an_asynchronous_checkpoint_do_not_wait_for_its_upload(s3_server, tmp_path):
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from local_s3 import S3_BUCKET, free_port
    from training.train import state_api_of_new_ray

    import sys

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import a test module
    # No dashboard, so no state API: Ray Train's PlacementGroupCleaner must find none at once rather than
    # ask the cluster `ray start` last recorded on this machine (training/train.py start_ray says why).
    with state_api_of_new_ray(f"http://127.0.0.1:{free_port()}"):
        ray.init(address="local", num_cpus=2, include_dashboard=False)
    try:
        TorchTrainer(_loop, train_loop_config={"scratch": str(tmp_path / "scratch"), "out": str(tmp_path / "t.json")},
                     torch_config=TorchConfig(backend="gloo"), scaling_config=ScalingConfig(num_workers=1),
                     run_config=RunConfig(name="reports", storage_path=f"s3://{S3_BUCKET}/reports")).fit()
    finally:
        ray.shutdown()
    timings = json.loads((tmp_path / "t.json").read_text())
    print(f"upload and reports: {timings['upload_s']:.2f} s; the loop waited {max(timings['reports_s']) * 1000:.0f} ms "
          "at most per metric report")
    assert timings["upload_s"] > 1.0  # an upload that takes a while, as a real one does
    assert max(timings["reports_s"]) < 0.2 * timings["upload_s"]


def test_a_new_writer_sweeps_what_failed_uploads_left_on_the_scratch_disk(tmp_path, monkeypatch):
    from training.storage.checkpoint import STALE_SCRATCH_S, scratch_directory, sweep_scratch

    monkeypatch.setenv("RAY_TRAIN_EKS_SCRATCH", str(tmp_path))
    root = scratch_directory()
    names = ["run-1-step8-rank0", "run-1-step8-rank1", "other-2-step4-rank0", "old-3-step2-rank0"]
    for name in names:
        (root / name).mkdir(parents=True)
    os.utime(root / "old-3-step2-rank0", (time.time() - STALE_SCRATCH_S - 60,) * 2)
    swept = sweep_scratch(run_name="run", rank=0)
    # This run's rank-0 leftovers and a day-old folder go; another rank's and another live run's stay.
    assert sorted(p.name for p in swept) == ["old-3-step2-rank0", "run-1-step8-rank0"]
    assert sorted(p.name for p in root.iterdir()) == ["other-2-step4-rank0", "run-1-step8-rank1"]
