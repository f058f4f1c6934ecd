"""Deliberate stops: a non-finite loss, or a failed preflight, ends the run with a clear
reason and without an exception (Ray Train would retry one max_failures times); the last
good checkpoint stays.

The real training loop runs in this process on one gloo rank, with Ray Train's worker
API (context, report, checkpoint) replaced by a recorder."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import ray.train
from training import loop, prepare
from training.config import PRESETS, TrainConfig




@pytest.mark.parametrize("mode", ["sync", "async"])
def test_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tiny_loop, tmp_path, monkeypatch, mode):
    reports, models = [], []
    real_load = prepare.load_sharded

    def remember(model_dir, **kwargs):
        models.append(real_load(model_dir, **kwargs))
        return models[-1]

    def report(metrics, checkpoint=None, **upload):
        saved = None
        if checkpoint is not None:
            saved = shutil.copytree(checkpoint.path, tmp_path / f"kept-{metrics['step']}")
            assert upload["checkpoint_upload_mode"] == (ray.train.CheckpointUploadMode.ASYNC if mode == "async"
                                                        else ray.train.CheckpointUploadMode.SYNC)
        reports.append((metrics, saved))
        if metrics["step"] == 2:
            with torch.no_grad():
                for parameter in models[0].parameters():
                    parameter.fill_(float("nan"))

    tiny_loop(report, load_sharded=remember, max_steps=6, checkpoint_every=2,
                  checkpoint_mode=mode)

    # Stopped at the first non-finite step; step 2 checkpointed (asynchronously: its metrics went
    # out at once, the checkpoint once written, here before the stop), step 3 not.
    expected = [(1, False), (2, True), (3, False)] if mode == "sync" else [(1, False), (2, False), (2, True), (3, False)]
    assert [(m["step"], kept is not None) for m, kept in reports] == expected
    kept = next(k for _, k in reports if k is not None)
    state = json.loads((kept / "train_state.json").read_text())
    assert state["step"] == 2 and state["loss"] == pytest.approx(reports[1][0]["loss"])
    # The weights in it are step 2's: staged before the parameters went NaN.
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(kept), str(tmp_path / "kept.pt"))
    weights = torch.load(tmp_path / "kept.pt", weights_only=False)["model"]
    assert weights and all(torch.isfinite(t).all() for t in weights.values() if torch.is_tensor(t))
    notice = json.loads((tmp_path / "runs" / "tiny-cpu-sft" / "stopped.json").read_text())
    assert notice == {"error": "non-finite loss nan at step 3", "step": 3}
    assert not (tmp_path / "runs" / "tiny-cpu-sft" / "final").exists()  # no model exported from a NaN state
    # The loop asked nothing of Ray that would start a Ray of its own (ray.get_runtime_context()
    # does, outside a Ray worker): one would outlive the test and take the next test's runs.
    assert not ray.is_initialized()


def test_failed_preflight_stops_before_any_step_without_raising(single_rank, tmp_path, monkeypatch):
    # On CPU the preflight's all-reduce runs over gloo, so expecting EFA must fail.
    reports = []
    monkeypatch.setattr(ray.train, "report", lambda metrics, checkpoint=None, **upload: reports.append(metrics))
    config = TrainConfig(**{**PRESETS["tiny-cpu"], "preset": "tiny-cpu", "storage_path": str(tmp_path / "runs"),
                            "num_workers": 1, "workers_per_node": 1, "expect_efa": True, "preflight_mb": 1})
    assert loop.train_loop_per_worker({**config.to_dict(), "_invocation_id": "test"}) is None  # returned, not raised
    assert reports == []  # no step ran
    notice = json.loads((tmp_path / "runs" / "tiny-cpu-sft" / "stopped.json").read_text())
    assert notice["step"] == 0
    assert notice["error"].startswith("preflight failed: worker(s) 0: the workers' transport is 'gloo', not EFA. Likely causes: "
                                      "the EFA device plugin is not running on this node")


def test_a_data_set_with_nothing_to_train_stops_on_the_workers_without_raising(single_rank, tmp_path, monkeypatch, tiny_dir):
    # A Hub or s3:// data set is first read on the workers (a local one fails on the driver, before Ray).
    path = tmp_path / "hub-snapshot.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "no answer"}]}\n' * 5)
    reports = []
    monkeypatch.setattr(prepare, "resolve_model", lambda uri: str(tiny_dir))
    monkeypatch.setattr(prepare, "resolve_dataset", lambda uri, seed: str(path))
    monkeypatch.setattr(ray.train, "report", lambda metrics, checkpoint=None, **upload: reports.append(metrics))
    config = TrainConfig(**{**PRESETS["tiny-cpu"], "preset": "tiny-cpu", "storage_path": str(tmp_path / "runs"),
                            "num_workers": 1, "workers_per_node": 1, "dataset": "my-org/my-data"})
    assert loop.train_loop_per_worker({**config.to_dict(), "_invocation_id": "test"}) is None
    assert reports == []
    notice = json.loads((tmp_path / "runs" / "tiny-cpu-sft" / "stopped.json").read_text())
    # The data set as the user named it; each cause with its first row and where it is in its file.
    assert notice == {"error": "data: dataset='my-org/my-data': no usable row among 5 (4 rows with no assistant turn to "
                               "train (none, weight 0, or only before the first user turn) (first: row 0 (hub-snapshot.jsonl "
                               "line 1)); 1 held out for the eval loss); each row needs an assistant turn with a non-empty "
                               "response", "step": 0}
