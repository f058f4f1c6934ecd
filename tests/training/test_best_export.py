"""Evaluation that picks what ships, end to end under Ray Train on 2 CPU workers: the tiny model
over-fits, so its eval loss turns up; the run keeps and exports the best step's weights, stops early
after ``--early-stopping-patience`` evaluations without a new best, writes greedy samples at each
evaluation, runs lm-evaluation-harness on the exported model and on the base with a task defined
here over a local JSONL file. (What the tracker is told of it: tests/training/test_tracking.py.)

Worker 1 dies right after step 8's checkpoint started (staged, its files being written, not reported:
a checkpoint is reported only once every rank has written its part): the run resumes from step 6, the
last complete checkpoint, one evaluation without a new best already counted, and keeps counting.

Over-fitting is delivered deterministically, not hoped for: the held-out rows (the production
split, ``training.data.split_rows``) answer ``zebra zebra zebra`` and the training rows ``apple
apple apple``, so once the model has learnt the answers' shape (eval loss falls) it learns the
training rows' word, which the held-out rows never use (eval loss rises)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

ROWS, HELD_OUT, PATIENCE = 80, 0.25, 3
#: The run: evaluations every 2 steps, each a checkpoint too, a constant rate after warm-up that over-fits within a few steps.
RUN = ["--preset", "tiny-cpu", "--max-samples", "none", "--eval-fraction", str(HELD_OUT), "--max-steps", "30",
       "--eval-every", "2", "--checkpoint-every", "2", "--learning-rate", "1e-2", "--warmup-steps", "2", "--min-lr-ratio", "1",
       "--early-stopping-patience", str(PATIENCE), "--sample-prompts", "1", "--sample-max-tokens", "12",
       "--eval-tasks", "reverse_tiny", "--eval-limit", "2"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict:
    """The over-fitting data set, and a benchmark task of our own over a local JSONL file."""
    from training.data import split_rows
    from training.storage.tiny import WORDS

    folder = tmp_path_factory.mktemp("inputs")
    rng = random.Random(7)
    held_out = set(split_rows(ROWS, eval_fraction=HELD_OUT, seed=42)[1].tolist())  # the preset's seed
    with open(folder / "overfit.jsonl", "w") as out:
        for row in range(ROWS):
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 6)))
            answer = "zebra zebra zebra" if row in held_out else "apple apple apple"
            out.write(json.dumps({"messages": [{"role": "user", "content": f"Reverse the words: {words}"},
                                               {"role": "assistant", "content": answer}]}) + "\n")
    tasks = folder / "tasks"
    tasks.mkdir()
    with open(tasks / "reverse.jsonl", "w") as out:
        for _ in range(8):
            words = [rng.choice(WORDS) for _ in range(3)]
            out.write(json.dumps({"question": "Reverse the words: " + " ".join(words), "answer": " ".join(reversed(words))}) + "\n")
    (tasks / "reverse_tiny.yaml").write_text(f"""task: reverse_tiny
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tasks / 'reverse.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["<|im_end|>"]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
""")
    return {"data": str(folder / "overfit.jsonl"), "tasks": str(tasks)}


def evaluations(lines: list[dict]) -> list[tuple[int, float]]:
    return [(line["step"], line["eval_loss"]) for line in lines if line.get("eval_loss") is not None]


def expected_stop(evals: list[tuple[int, float]], patience: int) -> tuple[int, int]:
    """(best step, the evaluation's step where ``patience`` evaluations in a row found no lower loss)."""
    best, since = None, 0
    for step, loss in evals:
        if best is None or loss < best[1]:
            best, since = (step, loss), 0
        else:
            since += 1
            if since == patience:
                return best[0], step
    raise AssertionError(f"no early stop in {evals}")


def model_weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def checkpoint_weights(folder: Path) -> dict:
    """A checkpoint's model tensors, read with torch.distributed.checkpoint's own reader (no process group)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(folder), str(folder.parent / "whole.pt"))
    whole = torch.load(folder.parent / "whole.pt", weights_only=False)
    return {key.removeprefix("lm."): value for key, value in whole["model"].items()}


@pytest.fixture(scope="module")
def stopped_run(inputs, tmp_path_factory) -> dict:
    """The run, worker 1 killed after step 8's checkpoint started (Ray Train restarts it from step 6's); its summary and folder."""
    import contextlib
    import io

    from training.train import main

    storage = tmp_path_factory.mktemp("runs")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*RUN, "--dataset", inputs["data"], "--eval-tasks-path", inputs["tasks"], "--storage-path", str(storage),
                     "--tracking-uri", "none", "--inject-failure-at-step", "8"]) == 0
    summary = json.loads(out.getvalue().strip().splitlines()[-1])
    return {"summary": summary, "folder": storage / "tiny-cpu-sft"}


def test_the_run_exports_its_best_step_and_stops_early_counting_across_a_restart(stopped_run):
    from training.telemetry.runlog import parse_lines

    folder, summary = stopped_run["folder"], stopped_run["summary"]
    lines = parse_lines((folder / "metrics.jsonl").read_text())
    evals = evaluations(lines)
    best, stop = expected_stop(evals, PATIENCE)
    assert evals[0][1] > dict(evals)[best] < evals[-1][1]  # the eval loss fell, then turned up
    # Worker 1 died as step 8's checkpoint was being written; the run restarted from step 6's, the last complete
    # one, one evaluation without a new best in, and step 8's partial checkpoint never became one.
    assert (folder / ".injected-failure").exists()
    assert [(line["step"], line["resume_cause"], line["resumed_from_step"]) for line in lines if "resume_cause" in line] == [
        (7, "failure", 6)]
    assert [line["step"] for line in lines] == list(range(1, stop + 1))
    assert best < 6 < stop  # the count had to survive the restart
    assert summary["steps"] == stop and lines[-1]["step"] == stop
    assert f"{PATIENCE} evaluation(s) without a lower eval loss than" in summary["stopped_early"]
    assert f"at step {best}" in summary["stopped_early"]
    export = summary["export"]
    assert (export["which"], export["step"], export["last_step"]) == ("best", best, stop)
    assert export["eval_loss"] == pytest.approx(dict(evals)[best]) and export["last_eval_loss"] == pytest.approx(evals[-1][1])
    assert f"step {best} has the lowest eval loss" in export["reason"]
    # final/ holds the best step's weights: those of its checkpoint (kept by Ray for its eval loss), not the last's.
    import torch

    kept = {json.loads((path / "train_state.json").read_text())["step"]: path for path in folder.glob("checkpoint_*") if path.is_dir()}
    assert best in kept and stop in kept and 8 not in kept  # the best (ranked), the latest (for a resume)
    exported, at_best, at_stop = model_weights(folder / "final"), checkpoint_weights(kept[best]), checkpoint_weights(kept[stop])
    assert set(exported) <= set(at_best)
    assert all(torch.equal(exported[key], at_best[key]) for key in exported)
    assert not all(torch.equal(exported[key], at_stop[key]) for key in exported)


def test_samples_at_each_evaluation_are_in_samples_jsonl(stopped_run):
    from training.telemetry.runlog import parse_lines

    folder = stopped_run["folder"]
    samples = parse_lines((folder / "samples.jsonl").read_text())
    steps = [step for step, _ in evaluations(parse_lines((folder / "metrics.jsonl").read_text()))]
    assert sorted({sample["step"] for sample in samples}) == steps  # every evaluation, once (step 8's trained twice)
    assert all(len([s for s in samples if s["step"] == step]) == 1 for step in steps)
    for sample in samples:
        assert sample["reference"] == "zebra zebra zebra" and sample["prompt"].startswith("Reverse the words:")
        assert sample["ended"] or sample["tokens"] == 12  # ended at the end of turn, or cut at --sample-max-tokens
        assert "<|im_end|>" not in sample["completion"]


def test_the_benchmark_scores_the_exported_model_and_the_base_on_a_local_task(stopped_run):
    summary = stopped_run["summary"]
    bench = summary["benchmarks"]
    assert "error" not in bench, bench
    assert set(bench["scores"]) == {"reverse_tiny"} and 0.0 <= bench["scores"]["reverse_tiny"]["exact_match"] <= 1.0
    assert bench["difference"]["reverse_tiny"]["exact_match"] == pytest.approx(
        bench["scores"]["reverse_tiny"]["exact_match"] - bench["base"]["reverse_tiny"]["exact_match"])
    results = json.loads((Path(summary["final_model"]) / "eval_results.json").read_text())
    assert results["model"]["results"]["reverse_tiny"]["exact_match,none"] == bench["scores"]["reverse_tiny"]["exact_match"]
    assert results["settings"]["limit"] == 2 and results["model"]["n-samples"]["reverse_tiny"]["effective"] == 2
