"""The run's course in its folder: metrics.jsonl kept one line per step across resumes,
curves.png drawn from it (a real image, every series on it), redrawn by
``python -m training.telemetry.curves``, and the picture in docs/fine-tuning.md is what the code draws."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from matplotlib.colors import to_rgb
from PIL import Image

from training.telemetry.curves import DPI, FIGURE_INCHES, draw, main
from training.telemetry.runlog import RunLog, parse_lines

ROOT = Path(__file__).resolve().parents[2]
ABOUT = {"run_name": "qwen-sft", "model": "Qwen/Qwen2.5-1.5B", "dataset": "databricks/databricks-dolly-15k"}


def _records(steps: int = 20) -> list[dict]:
    records = [{"step": s, "loss": 3.0 - 0.05 * s, "learning_rate": 2e-5 * min(1, s / 5), "tokens_per_s": 30000.0 + 100 * s}
               for s in range(1, steps + 1)]
    for s in (10, 20):
        if s <= steps:
            records[s - 1]["eval_loss"] = 2.9 - 0.04 * s
    if steps >= 15:
        records[7].update(resumed_from_step=6, resume_cause="failure")
        records[14].update(resumed_from_step=14, resume_cause="preemption")
    return records


def _has_colour(image: Image.Image, colour: str, at_least: int = 20) -> bool:
    pixels = np.asarray(image.convert("RGB")).reshape(-1, 3).astype(int)
    target = np.array([round(255 * c) for c in to_rgb(colour)])
    return int((np.abs(pixels - target).sum(axis=1) < 30).sum()) >= at_least


def test_the_picture_is_a_png_of_the_stated_size_with_every_series_and_restart_drawn():
    image = Image.open(io.BytesIO(draw(_records(), ABOUT)))
    assert image.format == "PNG" and image.size == (FIGURE_INCHES[0] * DPI, FIGURE_INCHES[1] * DPI)
    for colour in ("tab:blue", "tab:green", "tab:purple", "tab:brown", "tab:red", "tab:orange"):
        assert _has_colour(image, colour), f"nothing drawn in {colour}"


def test_a_resumed_run_log_keeps_the_steps_up_to_its_checkpoint_and_replaces_the_rest(tmp_path):
    run = tmp_path / "runs" / "qwen-sft"
    first = RunLog(str(run), resume_step=0, about=ABOUT)
    for record in _records(10):
        first.record(record)
    first.flush()
    first.close()
    assert [r["step"] for r in parse_lines((run / "metrics.jsonl").read_text())] == list(range(1, 11))
    # A crash after step 10; the last checkpoint was step 6: steps 7-10 are trained again.
    second = RunLog(str(run), resume_step=6, about=ABOUT)
    for step in range(7, 13):
        second.record({"step": step, "loss": 1.0})
    second.record({"step": 12, "loss": 0.5})  # a step recorded again replaces its line
    second.flush(picture=False)
    second.close()
    lines = parse_lines((run / "metrics.jsonl").read_text())
    assert [r["step"] for r in lines] == list(range(1, 13))
    assert lines[6]["loss"] == 1.0 and lines[-1]["loss"] == 0.5
    assert json.loads((run / "run.json").read_text()) == ABOUT


def test_non_finite_values_are_written_as_null_so_the_file_stays_json(tmp_path):
    log = RunLog(str(tmp_path), resume_step=0, about=ABOUT)
    log.record({"step": 1, "loss": float("nan"), "grad_norm": float("inf")})
    log.flush()
    log.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text().strip()) == {"step": 1, "loss": None, "grad_norm": None}


def test_python_m_training_curves_redraws_a_run_folder(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records()))
    (tmp_path / "run.json").write_text(json.dumps(ABOUT))
    assert main([str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == f"{tmp_path}/curves.png"
    assert Image.open(tmp_path / "curves.png").size == (1200, 800)
    assert main([str(tmp_path / "nothing-here")]) == 2
    assert "metrics.jsonl is missing or empty" in capsys.readouterr().err


def test_the_fine_tuning_page_picture_is_what_the_code_draws_from_the_demo_runs_metrics(tmp_path):
    """docs/curves.png comes from docs/demo-run (a `make demo` run, then its resume to step 40).
    Regenerate: .venv/bin/python -m training.telemetry.curves docs/demo-run --out docs/curves.png"""
    from matplotlib.testing.compare import compare_images

    assert "](curves.png)" in (ROOT / "docs" / "fine-tuning.md").read_text()
    drawn = tmp_path / "curves.png"
    assert main([str(ROOT / "docs" / "demo-run"), "--out", str(drawn)]) == 0
    assert compare_images(str(ROOT / "docs" / "curves.png"), str(drawn), tol=2) is None


@pytest.mark.parametrize("missing", ["eval_loss", "tokens_per_s"])
def test_a_run_without_some_series_still_draws(missing):
    records = [{k: v for k, v in r.items() if k != missing} for r in _records()]
    assert Image.open(io.BytesIO(draw(records, {}))).size == (1200, 800)
