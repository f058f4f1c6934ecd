"""The training step on two gloo workers, through the production functions (one spawn for
all, process start-up being most of the cost): the same global batch gives the same loss
whatever the micro-batch / accumulation split and whether FSDP or HSDP shards it; a
sharded checkpoint resumes exactly from S3 (moto's server), each rank reading its own shards
there, and the best step's weights load reading only the model's share (the bytes counted by a
proxy in front of the server, tests/training/fault_proxy.py); the exported model has the real
dtype and no second copy of a tied head."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from processes import run_workers

pytestmark = pytest.mark.distributed

#: Where the checkpoint is stored, as Ray Train stores a run's (moto's S3 server).
S3_CHECKPOINT = "s3://ray-train-eks-test/step/ckpt"
#: (micro_batch, shard_size): mb 2 x 1 accumulation, mb 1 x 2 accumulation, and mb 1 on HSDP
#: (two "nodes" of one worker: every micro-step but the last skips the all-reduce).
LAYOUTS = [(2, 2), (1, 2), (1, 1)]


def _worker(rank: int, world: int, tiny_dir: str, workdir: str, s3: dict, proxies: dict) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoTokenizer

    from training.evaluation.best import load_model_weights
    from training.storage.checkpoint import load_checkpoint, save_checkpoint
    from training.storage.files import upload_directory
    from training.config import PRESETS, TrainConfig
    from training.data import DataOrder, build_training_data
    from training.modeling.export import export_final_model
    from training.loop import Worker, train_one_step
    from training.modeling.model import load_model
    from training.telemetry.metrics import flops_shape
    from training.modeling.parallel import apply_fsdp, build_mesh, is_hsdp
    from training.storage.tiny import write_dataset

    torch.set_num_threads(1)
    os.environ.update(s3)  # moto's S3, as the pods' storage (the fork server may predate the fixture's environment)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=world)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    data = write_dataset(Path(workdir) / f"data-{rank}.jsonl", n=300, seed=1)
    training_data = build_training_data(tokenizer, str(data), seq_len=64, seed=0)
    cpu = torch.device("cpu")
    config = TrainConfig(**{**PRESETS["tiny-cpu"], "storage_path": workdir, "num_workers": world})

    def build(micro_batch: int, shard_size: int):
        torch.manual_seed(0)
        model = load_model(tiny_dir, attn_implementation="sdpa", activation_checkpointing=True)
        mesh = build_mesh(device_type="cpu", world_size=world, shard_size=shard_size)
        apply_fsdp(model, mesh=mesh, mixed_precision="fp32")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
        order = DataOrder(num_sequences=len(training_data.train), global_batch=4, micro_batch=micro_batch,
                          num_workers=world, seed=0)
        # The loop's own step (micro-batches, loss normaliser from the data order, clipping, update).
        worker = Worker(config=config, invocation_id="test", rank=rank, world=world, device=cpu, data=training_data,
                        order=order, model=model, optimizer=optimizer, scheduler=scheduler, hsdp=is_hsdp(mesh),
                        flops_shape=flops_shape(model))

        def step(index: int) -> float:
            return train_one_step(worker, index)["loss"]

        return model, optimizer, scheduler, step

    def full_state(model) -> dict:
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))  # collective

    results: dict = {"losses": {}}
    for micro_batch, shard_size in LAYOUTS:
        model, optimizer, scheduler, step = build(micro_batch, shard_size)
        results["losses"][f"mb{micro_batch}-shard{shard_size}"] = [step(0), step(1)]
        if (micro_batch, shard_size) == LAYOUTS[0]:
            # Sharded checkpoint after step 2, then step 3 twice: straight on, and after a restore.
            # stored in S3 as Ray Train uploads it, then read from there (each rank through its own proxy).
            save_checkpoint(f"{workdir}/ckpt", model=model, optimizer=optimizer, scheduler=scheduler,
                            train_state={"step": 2}, rank=rank)
            saved = full_state(model)
            if rank == 0:
                upload_directory(f"{workdir}/ckpt", S3_CHECKPOINT)
            dist.barrier()
            expected_next, weights_before = step(2), full_state(model)
            model, optimizer, scheduler, step = build(micro_batch, shard_size)
            os.environ["AWS_ENDPOINT_URL"] = proxies[f"resume-{rank}"]
            state = load_checkpoint(S3_CHECKPOINT, model=model, optimizer=optimizer, scheduler=scheduler, rank=rank)
            actual_next, weights_after = step(2), full_state(model)
            # The export's load of the best step: the model's weights alone, into a model just built.
            best, *_ = build(micro_batch, shard_size)
            os.environ["AWS_ENDPOINT_URL"] = proxies[f"best-{rank}"]
            load_model_weights(S3_CHECKPOINT, best)
            best_state = full_state(best)
            os.environ["AWS_ENDPOINT_URL"] = s3["AWS_ENDPOINT_URL"]
            results["checkpoint"] = {
                "state": state, "expected_next": expected_next, "actual_next": actual_next,
                "same_weights": all(torch.equal(weights_before[k], weights_after[k]) for k in weights_before),
                "best_is_the_saved": all(torch.equal(saved[k], best_state[k]) for k in saved),
                "model_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
                "lr": scheduler.get_last_lr()[0], "files": sorted(os.listdir(f"{workdir}/ckpt")),
            }
    export_final_model(model=model, tokenizer=tokenizer, rank=rank, uri=f"{workdir}/final", dtype=torch.bfloat16)
    full = full_state(model)
    if rank == 0:
        torch.save({k.removeprefix("lm."): v for k, v in full.items()}, f"{workdir}/trained.pt")
        Path(workdir, "results.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory, tiny_dir, s3_server):
    """The workers' results, and the bytes each rank read from S3 for the resume and for the best step."""
    from fault_proxy import FaultProxy

    workdir = tmp_path_factory.mktemp("step")
    proxies = {f"{load}-{rank}": FaultProxy(s3_server["AWS_ENDPOINT_URL"]) for load in ("resume", "best") for rank in (0, 1)}
    try:
        run_workers(_worker, args=(2, str(tiny_dir), str(workdir), s3_server, {k: p.url for k, p in proxies.items()}),
                    nprocs=2)
    finally:
        for proxy in proxies.values():
            proxy.close()
    (workdir / "reads.json").write_text(json.dumps({key: proxy.bytes_out for key, proxy in proxies.items()}))
    return workdir


def _results(workdir: Path) -> dict:
    return json.loads((workdir / "results.json").read_text())


def test_a_step_loses_the_same_whatever_the_micro_batch_split(two_workers):
    losses = _results(two_workers)["losses"]
    mb2, mb1 = losses["mb2-shard2"], losses["mb1-shard2"]
    assert mb2[0] == pytest.approx(mb1[0], abs=1e-4)  # the same global batch, one vs two micro-steps
    assert mb2[1] == pytest.approx(mb1[1], abs=1e-4)  # and the same update from it
    assert mb2[1] < mb2[0] - 0.01


def test_hsdp_with_the_all_reduce_on_the_last_micro_step_only_matches_fsdp(two_workers):
    losses = _results(two_workers)["losses"]
    assert losses["mb1-shard1"] == pytest.approx(losses["mb1-shard2"], abs=1e-4)


def test_fsdp2_checkpoint_round_trip_resumes_exactly(two_workers):
    result = _results(two_workers)["checkpoint"]
    assert result["state"]["step"] == 2
    assert result["actual_next"] == result["expected_next"]  # same loss on the step after restore
    assert result["same_weights"]  # and the same weights after it: optimizer state came back too
    assert result["lr"] == pytest.approx(1e-2 / 4)  # the scheduler resumed at its step (3 steps: 1/(3+1))
    assert {"train_state.json", "rng_rank0.pt", "rng_rank1.pt", ".metadata"} <= set(result["files"])
    assert any(name.endswith(".distcp") for name in result["files"])


def test_a_resume_and_the_best_steps_load_read_from_s3_only_the_bytes_each_rank_loads(two_workers, s3_server):
    """Ray Train's ``Checkpoint.as_directory()`` copies the whole checkpoint to every node (every rank's
    shards and the optimizer's moments); read in place, a resuming rank reads its own model and optimizer
    shards, and the best step's load its model shard alone: a sixth of a full fine-tune's checkpoint over
    two ranks (fp32 weights and two AdamW moments), a fifth here, where the index (.metadata, read by
    each rank) and each tiny tensor's own header weigh as much as the weights."""
    import boto3
    from fault_proxy import FaultProxy
    from local_s3 import exported
    from ray.train import Checkpoint

    result, reads = _results(two_workers)["checkpoint"], json.loads((two_workers / "reads.json").read_text())
    assert result["best_is_the_saved"]
    listed = boto3.client("s3").list_objects_v2(Bucket=S3_CHECKPOINT.split("/")[2], Prefix="step/ckpt/")["Contents"]
    size = sum(entry["Size"] for entry in listed)
    proxy = FaultProxy(s3_server["AWS_ENDPOINT_URL"])
    try:
        with exported({"AWS_ENDPOINT_URL": proxy.url}), Checkpoint(S3_CHECKPOINT).as_directory():
            pass
    finally:
        proxy.close()
    print(f"checkpoint {size:,} bytes; Checkpoint.as_directory() read {proxy.bytes_out:,} on each node; read in place, "
          f"a resuming rank read {reads['resume-0']:,} and {reads['resume-1']:,}, the best step's load "
          f"{reads['best-0']:,} and {reads['best-1']:,} (the model's {result['model_bytes']:,} bytes of fp32 weights)")
    assert proxy.bytes_out >= size
    for rank in (0, 1):
        assert reads[f"best-{rank}"] < 0.25 * size  # its half of the weights, and the index
        assert reads[f"resume-{rank}"] < 0.6 * size  # its half of the weights and moments, and the index


def test_exported_model_has_its_real_dtype_and_one_tied_embedding(two_workers):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    final = two_workers / "final"
    config = json.loads((final / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["tie_word_embeddings"] is True
    with safe_open(str(final / "model.safetensors"), "pt") as stored:
        keys = set(stored.keys())
        assert {stored.get_tensor(k).dtype for k in keys} == {torch.bfloat16}
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys
    trained = torch.load(two_workers / "trained.pt")
    model = AutoModelForCausalLM.from_pretrained(str(final))
    assert model.dtype == torch.bfloat16
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    for name, value in model.state_dict().items():
        assert torch.equal(value, trained[name].to(torch.bfloat16)), name
