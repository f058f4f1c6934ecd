"""Benchmark: what the training loop pays per step and per checkpoint for surviving failures.

    python -m bench.run_overheads                 # every section
    python -m bench.run_overheads --only preemption

- **Preemption check**: ``ray.train.get_preemption_info()`` at every step boundary (a barrier
  across the workers through Ray Train's sync actor, so all ranks act on the same step), timed
  under Ray Train on 2 CPU workers, against a plain gloo all-reduce of one number.
- **Checkpoint stall**: how long the training loop is blocked per checkpoint, synchronous
  against asynchronous (training/storage/checkpoint.py), the same model and workers in one run, with the
  run's storage on a local S3 (moto's server, as the storage tests use) so an upload costs what
  an upload costs; asynchronously the loop's wait includes the next steps' metric reports
  (``training.reporting.report_metrics``), which a synchronous report would hold for the upload.
- **Data preparation**: what each worker spends before the first step turning a data set of
  the default's size into packed sequences (README, "Time to first step").

Prints figures and a JSON line; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def _preemption_loop(config: dict) -> None:
    import torch
    import torch.distributed as dist

    import ray.train

    calls, timings, reduce_timings = config["calls"], [], []
    one = torch.zeros(1)
    for _ in range(calls):
        started = time.perf_counter()
        ray.train.get_preemption_info()
        timings.append(time.perf_counter() - started)
        started = time.perf_counter()
        dist.all_reduce(one)
        reduce_timings.append(time.perf_counter() - started)
    if ray.train.get_context().get_world_rank() == 0:  # Ray keeps a report's metrics only with a checkpoint
        with open(config["out"], "w") as handle:
            json.dump({"check_ms": [t * 1000 for t in timings], "all_reduce_ms": [t * 1000 for t in reduce_timings]}, handle)


def preemption_check_cost(calls: int = 200, workers: int = 2) -> dict:
    """Milliseconds per get_preemption_info() call (median, p90) on ``workers`` gloo workers."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    ray.init(num_cpus=workers + 1, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "timings.json")
        try:
            trainer = TorchTrainer(_preemption_loop, train_loop_config={"calls": calls, "out": out},
                                   torch_config=TorchConfig(backend="gloo"), scaling_config=ScalingConfig(num_workers=workers),
                                   run_config=RunConfig(name="preemption-check", storage_path=scratch))
            trainer.fit()
        finally:
            ray.shutdown()
        with open(out) as handle:
            metrics = json.load(handle)
    check, reduce = metrics["check_ms"][10:], metrics["all_reduce_ms"][10:]  # the first calls warm up
    return {"calls": len(check), "workers": workers,
            "check_ms_median": round(statistics.median(check), 3), "check_ms_p90": round(sorted(check)[int(0.9 * len(check))], 3),
            "gloo_all_reduce_ms_median": round(statistics.median(reduce), 3)}


#: A model large enough that writing a checkpoint dominates: 93 M parameters, 1.1 GB of fp32
#: parameters and AdamW moments (on 2 workers, 0.56 GB each); moto's server holds several
#: copies of what it is sent in memory (10 GB for 2.6 GB), so no larger on this machine.
CHECKPOINT_MODEL = dict(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=4,
                        num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048,
                        tie_word_embeddings=True)


def _checkpoint_loop(config: dict) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, Qwen2Config

    import ray.train
    from training.storage.checkpoint import CheckpointWriter
    from training.modeling.model import CausalLMForSFT
    from training.modeling.parallel import apply_fsdp, build_mesh

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    torch.manual_seed(0)
    model = CausalLMForSFT(AutoModelForCausalLM.from_config(Qwen2Config(**CHECKPOINT_MODEL), dtype=torch.float32))
    apply_fsdp(model, mesh=build_mesh(device_type="cpu", world_size=world, shard_size=world), mixed_precision="fp32")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    for parameter in model.parameters():  # AdamW's moments exist after a first step
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    timings: dict = {"sync": [], "async": [], "async_write_s": [], "async_upload_s": []}
    from types import SimpleNamespace

    from training.reporting import report_metrics

    loop_worker = SimpleNamespace(checkpoints=SimpleNamespace(asynchronous=True))
    step = 0
    writers = {mode: CheckpointWriter(asynchronous=mode == "async", rank=rank, run_name=f"bench-{mode}", invocation_id=mode)
               for mode in ("sync", "async")}
    for _round in range(config["rounds"]):
        for mode in ("sync", "async"):
            step += 1
            writer = writers[mode]
            metrics = {"step": step, "mode": mode}
            state = {"step": step, "invocation_id": mode}
            dist.barrier()
            started = time.perf_counter()
            writer.start(model=model, optimizer=optimizer, scheduler=scheduler, train_state=state, metrics=metrics)
            if mode == "sync":
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(str(writer.take().directory)),
                                 delete_local_checkpoint_after_upload=True)
                timings["sync"].append(time.perf_counter() - started)
                continue
            ray.train.report(metrics)  # the step's report; training goes on while the files are written
            blocked = time.perf_counter() - started
            while not writer.written_everywhere():  # "training": the loop checks once per step
                time.sleep(0.05)
            written = time.perf_counter() - started
            started = time.perf_counter()
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(str(writer.take().directory)),
                             checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC,
                             delete_local_checkpoint_after_upload=True)
            for _ in range(REPORTS_AFTER):  # the next steps' metrics, while the upload runs
                report_metrics(loop_worker, {"step": step, "mode": mode})
            timings["async"].append(blocked + time.perf_counter() - started)
            timings["async_write_s"].append(written)
            uploaded = time.perf_counter()
            ray.train.report({"step": step, "mode": mode})  # synchronous: waits for the upload (not timed as a stall)
            timings["async_upload_s"].append(time.perf_counter() - uploaded)
    parameters = sum(p.numel() for p in model.parameters())  # DTensor numel is the full tensor's
    if rank == 0:
        with open(config["out"], "w") as handle:
            json.dump({**timings, "parameters": parameters, "bytes_per_worker": parameters * 4 * 3 // world}, handle)


#: Metric reports timed after each asynchronous checkpoint's report (the steps that follow it).
REPORTS_AFTER = 3


def checkpoint_stall(rounds: int = 1, workers: int = 2) -> dict:
    """Seconds the loop is blocked per checkpoint, synchronous against asynchronous, in one run
    whose storage is a local S3 server."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    from bench.local_s3 import start_moto

    server, env = start_moto("bench-checkpoints")
    os.environ.update(env)  # this process's storage calls, and Ray's workers, which inherit it
    storage = "s3://bench-checkpoints/runs"
    ray.init(address="local", num_cpus=workers + 1, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "timings.json")
        os.environ["RAY_TRAIN_EKS_SCRATCH"] = os.path.join(scratch, "node-disk")
        try:
            TorchTrainer(_checkpoint_loop, train_loop_config={"rounds": rounds, "out": out},
                         torch_config=TorchConfig(backend="gloo"), scaling_config=ScalingConfig(num_workers=workers),
                         run_config=RunConfig(name="checkpoint-stall", storage_path=storage)).fit()
        finally:
            ray.shutdown()
            os.environ.pop("RAY_TRAIN_EKS_SCRATCH", None)
            server.terminate()
        with open(out) as handle:
            timings = json.load(handle)
    sync, asynchronous = statistics.median(timings["sync"]), statistics.median(timings["async"])
    return {"workers": workers, "rounds": rounds, "parameters_m": round(timings["parameters"] / 1e6),
            "checkpoint_gb_per_worker": round(timings["bytes_per_worker"] / 1e9, 2),
            "sync_blocked_s": round(sync, 3), "async_blocked_s": round(asynchronous, 3),
            "async_write_s": round(statistics.median(timings["async_write_s"]), 3),
            "async_upload_s": round(statistics.median(timings["async_upload_s"]), 3), "reports_after": REPORTS_AFTER,
            "sync_over_async": round(sync / asynchronous, 1)}


#: databricks-dolly-15k, the default data set: 15,011 rows in a 13.1 MB JSONL file (its Hub
#: page). The rows here have its size and shape (instruction, a context in about a third of
#: them, a response), in words the tiny tokenizer knows.
DOLLY_ROWS, DOLLY_BYTES = 15_011, 13_100_000


def dolly_sized_rows(seed: int = 0) -> list[dict]:
    """Rows in Dolly's format whose JSON adds up to about Dolly's file size."""
    import random

    from training.storage.tiny import WORDS

    rng = random.Random(seed)
    mean_chars = DOLLY_BYTES / DOLLY_ROWS - 70  # less the JSON keys and quotes

    def text(chars: float) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(max(1, int(rng.expovariate(1 / chars) / 6))))

    rows = []
    for _ in range(DOLLY_ROWS):
        has_context = rng.random() < 1 / 3
        rows.append({"instruction": text(0.1 * mean_chars), "context": text(1.35 * mean_chars) if has_context else "",
                     "response": text(0.45 * mean_chars), "category": "open_qa"})
    return rows


def data_preparation(seq_len: int = 2048) -> dict:
    """Seconds a worker spends preparing a Dolly-sized data set (load, hold out, tokenize with
    response-only labels, pack), with the tiny Qwen2 tokenizer (Qwen2's class and pre-tokenizer,
    a 384-token vocabulary)."""
    from transformers import AutoTokenizer

    from training.data import build_training_data
    from training.storage.tiny import materialize_model

    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "dolly-sized.jsonl")
        with open(path, "w") as handle:
            for row in dolly_sized_rows():
                handle.write(json.dumps(row) + "\n")
        size = os.path.getsize(path)
        tokenizer = AutoTokenizer.from_pretrained(str(materialize_model(Path(scratch) / "tiny")))
        started = time.perf_counter()
        data = build_training_data(tokenizer, path, seq_len=seq_len, seed=0, eval_fraction=0.02)
        seconds = time.perf_counter() - started
    return {"rows": DOLLY_ROWS, "file_mb": round(size / 1e6, 1), "seq_len": seq_len, "seconds": round(seconds, 1),
            "packed_sequences": len(data.train), "tokens_m": round(len(data.train) * seq_len / 1e6, 1)}


#: A step of the L4 preset, seconds (an estimate: 131k tokens a step over 8 L4s at about 6k
#: trained tokens/s each; the first deploy's log prints the real figure).
L4_PRESET_STEP_S = 2.7


def describe_preemption(cost: dict) -> str:
    share = cost["check_ms_median"] / 1000 / L4_PRESET_STEP_S
    return (f"Preemption check (ray.train.get_preemption_info, every step), {cost['workers']} CPU workers, "
            f"{cost['calls']} calls: median {cost['check_ms_median']:.2f} ms, p90 {cost['check_ms_p90']:.2f} ms "
            f"(a gloo all-reduce of one number: {cost['gloo_all_reduce_ms_median']:.2f} ms); "
            f"{share:.3%} of an L4 preset step of about {L4_PRESET_STEP_S} s")


def describe_checkpoint_stall(stall: dict) -> str:
    return (f"Checkpoint stall, {stall['checkpoint_gb_per_worker']} GB per worker (fp32 parameters and AdamW moments "
            f"of a {stall['parameters_m']} M-parameter Qwen2), {stall['workers']} CPU workers, storage on a local S3 "
            f"(moto): the loop is blocked {stall['sync_blocked_s']:.2f} s synchronously (write with fsync, then the "
            f"upload) against {stall['async_blocked_s']:.2f} s asynchronously (staging, reporting, and the next "
            f"{stall['reports_after']} steps' metric reports): {stall['sync_over_async']}x shorter; in the background the "
            f"write took {stall['async_write_s']:.2f} s and the upload {stall['async_upload_s']:.2f} s more")


def describe_data_preparation(prep: dict) -> str:
    return (f"Data preparation of a Dolly-15k-sized set ({prep['rows']:,} rows, {prep['file_mb']} MB), one process, "
            f"tiny Qwen2 tokenizer: {prep['seconds']:.1f} s to {prep['packed_sequences']:,} packed sequences of "
            f"{prep['seq_len']} tokens (every worker prepares the same data, in parallel)")


#: --only name: (JSON key, measurement, its sentence).
SECTIONS = {
    "preemption": ("preemption_check", preemption_check_cost, describe_preemption),
    "checkpoint": ("checkpoint_stall", checkpoint_stall, describe_checkpoint_stall),
    "data": ("data_preparation", data_preparation, describe_data_preparation),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=list(SECTIONS))
    args = parser.parse_args()
    payload: dict = {}
    for name, (key, measure, describe) in SECTIONS.items():
        if args.only in (None, name):
            payload[key] = measure()
            print("\n" + describe(payload[key]))
    print(json.dumps(payload))


if __name__ == "__main__":
    main()
