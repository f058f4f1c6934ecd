"""Benchmark: every GPU preset's memory plan against the bytes the project's own load and step hold
at the preset's real shapes, moment by moment.

    python -m bench.plan_vs_fake_memory                       # every GPU preset (about 5 min on 2 cores)
    python -m bench.plan_vs_fake_memory qwen2.5-1.5b-l4x8     # one or more presets

Each preset is planned as a job would be (``training.modeling.plan.job_options`` on the GPUs it is
planned for, :data:`training.presets.PRESET_GPUS`: the micro-batch and checkpointing the plan
chooses), then its load and one optimizer step (its micro-steps, HSDP's cross-node all-reduce,
gradient clipping, AdamW with its state made) run on rank 1 with fake tensors and a fake process
group (tests/training/fake_step_memory.py says what runs and where it differs from a GPU), counting
the bytes alive in each interval. Each row: the plan's moment (without the CUDA context allowance,
which holds no tensor of the step's), the largest bytes measured in the interval, planned /
measured. Below 1 the plan is under what the step holds (the side that runs out of memory).

A DPO preset (LoRA) is measured as its SFT step with, before each micro-batch's forward, a no-grad
forward of the same micro-batch with the adapters off (``fake_step_memory._reference_forwards``: the
project's step has no DPO path yet; the SFT loss there holds what DPO's log-probs would, the same
chunked logits). tests/training/test_plan.py checks four real-size cases in the suite. Prints figures and a
JSON line; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "training"))

GIB = 2**30


def preset_case(preset: str, gpu: str, objective: str):
    """The preset's job options as the plan chooses them, as a fake-step :class:`Case`, and the plan."""
    from fake_step_memory import Case

    from training.config import parse_config
    from training.modeling.plan import job_options, plan
    from training.modeling.shapes import KNOWN_MODELS

    config = parse_config(["--preset", preset, "--gpu-type", gpu], storage_path="s3://bench/runs")
    shape = KNOWN_MODELS[config.model]
    options, _ = job_options(shape, gpu, config)
    options = replace(options, objective=objective)  # not a preset key yet (training/presets.py)
    case = Case(model=config.model, layers=shape.layers, num_workers=options.num_workers, shard_size=options.shard_size,
                micro_batch_size=options.micro_batch_size, seq_len=options.seq_len,
                micro_steps=config.global_batch_size // (options.num_workers * options.micro_batch_size),
                activation_checkpointing=options.activation_checkpointing, loss_chunk_tokens=options.loss_chunk_tokens,
                lora_rank=options.lora_rank, lora_dropout=options.lora_dropout, objective=options.objective,
                dpo_loss=options.dpo_loss)
    return case, plan(shape, gpu, options)


def compare(preset: str, gpu: str, objective: str) -> dict:
    from fake_step_memory import MOMENTS, REFERENCE_MOMENTS, measure, planned

    case, found = preset_case(preset, gpu, objective)
    started = time.perf_counter()
    measured = measure(case)
    seconds = time.perf_counter() - started
    plan_of = planned(case)
    rows = {}
    for interval, moments in {**MOMENTS, **(REFERENCE_MOMENTS if case.lora_reference else {})}.items():
        value = max(plan_of[moment] for moment in moments if moment in plan_of)
        rows[interval] = (value / GIB, measured[interval] / GIB, value / measured[interval])
    return {"preset": preset, "gpu": gpu, "case": case, "seconds": seconds, "rows": rows,
            "peak_gib": found.needed / GIB, "capacity_gib": found.capacity / GIB, "reference": found.reference}


def print_result(result: dict) -> None:
    case = result["case"]
    print(f"{result['preset']} on {case.num_workers} x {result['gpu']} (shard {case.shard_size}, micro-batch "
          f"{case.micro_batch_size} x {case.seq_len}, {case.micro_steps} micro-step(s), checkpointing "
          f"{'on' if case.activation_checkpointing else 'off'}{', LoRA r%d' % case.lora_rank if case.lora_rank else ''}"
          f", {case.objective}, reference: {result['reference']}): planned peak {result['peak_gib']:.2f} GiB "
          f"(+5%, with the context) of {result['capacity_gib']:.2f}; measured in {result['seconds']:.0f} s")
    for interval, (planned_gib, measured_gib, ratio) in result["rows"].items():
        flag = "  UNDER" if ratio < 0.98 else "  over >10%" if ratio > 1.10 else ""
        print(f"  {interval:<26} plan {planned_gib:7.3f} GiB  measured {measured_gib:7.3f} GiB  {ratio:5.3f}{flag}")


def main(argv: list[str] | None = None) -> int:
    from training.presets import PRESET_GPUS

    parser = argparse.ArgumentParser(prog="python -m bench.plan_vs_fake_memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("presets", nargs="*", help=f"presets to measure (default: all of {', '.join(PRESET_GPUS)})")
    args = parser.parse_args(argv)
    results = []
    for preset in args.presets or list(PRESET_GPUS):
        gpu, _, objective = PRESET_GPUS[preset]
        result = compare(preset, gpu, objective)
        print_result(result)
        results.append(result)
    worst = min((r["rows"][i][2], r["preset"], i) for r in results for i in r["rows"])
    print(f"lowest planned / measured: {worst[0]:.3f} ({worst[1]}, {worst[2]})")
    print(json.dumps({r["preset"]: {i: round(v[2], 4) for i, v in r["rows"].items()} for r in results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
