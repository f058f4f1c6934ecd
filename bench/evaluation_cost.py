"""Benchmark: what the samples at each evaluation cost (training/evaluation/samples.py), against the
evaluation interval they come in, at a preset's default settings.

    python -m bench.evaluation_cost                    # tiny-cpu: 2 CPU workers under a local Ray
    python -m bench.evaluation_cost --steps 40 -- --sample-prompts 5

Runs the training entrypoint (``python -m training.train``) and reads its ``metrics.jsonl``: the
seconds each evaluation's greedy samples took (``sample_seconds``, every rank generating on the
sharded model), the median training step (``step_seconds``), and the interval between evaluations
(``--eval-every`` steps of it). The issue's bar: samples under a tenth of the interval.

Prints figures and a JSON line; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def measure(preset: str, steps: int, extra: list[str]) -> dict:
    """One run of ``preset`` for ``steps`` steps; the figures from its metrics.jsonl."""
    from training.config import parse_config

    config = parse_config(["--preset", preset, "--storage-path", "unused", *extra])
    with tempfile.TemporaryDirectory() as storage:
        subprocess.run([sys.executable, "-m", "training.train", "--preset", preset, "--max-steps", str(steps),
                        "--storage-path", storage, "--tracking-uri", "none", *extra],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        lines = [json.loads(line) for line in (Path(storage) / config.run_name / "metrics.jsonl").read_text().splitlines()]
    samples = [line["sample_seconds"] for line in lines if line.get("sample_seconds") is not None]
    step = statistics.median(line["step_seconds"] for line in lines[1:])  # the first step includes warm-up
    interval = config.eval_every * step
    return {"preset": preset, "sample_prompts": config.sample_prompts, "sample_max_tokens": config.sample_max_tokens,
            "evaluations": len(samples), "sample_seconds_median": statistics.median(samples) if samples else None,
            "step_seconds_median": step, "eval_every": config.eval_every, "interval_seconds": interval,
            "share_of_interval": statistics.median(samples) / interval if samples else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny-cpu")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("extra", nargs="*", help="training options after --")
    args = parser.parse_args()
    found = measure(args.preset, args.steps, args.extra)
    print(f"{found['preset']}: {found['evaluations']} evaluations, {found['sample_prompts']} samples of up to "
          f"{found['sample_max_tokens']} tokens each in {found['sample_seconds_median']:.2f} s (median); "
          f"a step {found['step_seconds_median']:.3f} s, an evaluation every {found['eval_every']} steps = "
          f"{found['interval_seconds']:.2f} s: the samples are {found['share_of_interval']:.1%} of the interval")
    print(json.dumps(found))


if __name__ == "__main__":
    main()
