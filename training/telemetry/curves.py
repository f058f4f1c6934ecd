"""A run's curves as one picture: training and eval loss, learning rate and tokens/s against
the step, from the run's ``metrics.jsonl``, with resumes and preemptions marked.

    python -m training.telemetry.curves demo-out/runs/tiny-cpu-sft            # writes curves.png in that folder
    python -m training.telemetry.curves s3://bucket/runs/qwen2.5-1.5b-sft --out curves.png

Drawn with matplotlib's object API on the Agg canvas (headless: no display, no pyplot state,
safe in the training's writer thread). Where matplotlib is missing the run still writes
``metrics.jsonl``; this command draws the picture anywhere else.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from typing import Sequence

from .runlog import CURVES_FILE, METRICS_FILE, RUN_FILE, parse_lines
from ..storage.files import read_text, write_bytes

#: The picture's size: 12 x 8 inches at 100 dots per inch.
FIGURE_INCHES = (12, 8)
DPI = 100
#: How each kind of restart is drawn.
RESTART_STYLE = {
    "preemption": ("tab:orange", "preempted, resumed"),
    "failure": ("tab:red", "failure, resumed"),
    "new run": ("tab:gray", "resumed (new run)"),
}


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def draw(records: list[dict], about: dict) -> bytes:
    """The curves of ``records`` (metrics.jsonl's step objects) as PNG bytes, titled from
    ``about`` (run.json: run name, model, data set)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=FIGURE_INCHES, dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    loss_axes, lr_axes, speed_axes = figure.subplot_mosaic([["loss", "loss"], ["lr", "speed"]]).values()
    figure.suptitle(f"{about.get('run_name', 'run')}: {about.get('model', '?')} on {about.get('dataset', '?')}", fontsize=13)

    steps, loss = _series(records, "loss")
    loss_axes.plot(steps, loss, color="tab:blue", linewidth=1.2, label="training loss")
    eval_steps, eval_loss = _series(records, "eval_loss")
    if eval_steps:
        loss_axes.plot(eval_steps, eval_loss, color="tab:green", marker="o", linewidth=1.5, label="eval loss (held out)")
    loss_axes.set(xlabel="step", ylabel="loss (nats per trained token)", title="Loss")
    lr_steps, lr = _series(records, "learning_rate")
    lr_axes.plot(lr_steps, lr, color="tab:purple", label="learning rate")
    lr_axes.set(xlabel="step", ylabel="learning rate", title="Learning rate")
    lr_axes.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    speed_steps, speed = _series(records, "tokens_per_s")
    speed_axes.plot(speed_steps, speed, color="tab:brown", label="tokens/s (whole run)")
    speed_axes.set(xlabel="step", ylabel="tokens per second", title="Throughput")

    marked = set()
    for record in records:
        cause = record.get("resume_cause")
        if cause is None:
            continue
        color, label = RESTART_STYLE.get(cause, ("tab:gray", f"resumed ({cause})"))
        for axes in (loss_axes, lr_axes, speed_axes):
            axes.axvline(record["resumed_from_step"], color=color, linestyle="--", linewidth=1,
                         label=None if (axes, cause) in marked else f"{label} at step {record['resumed_from_step']}")
            marked.add((axes, cause))
    for axes in (loss_axes, lr_axes, speed_axes):
        axes.grid(alpha=0.3)
        axes.legend(loc="best", fontsize=9)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def draw_if_possible(records: list[dict], about: dict) -> bytes | None:
    """:func:`draw`, or None where matplotlib is not installed (the image may lack it)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return None
    return draw(records, about)


def redraw(run_uri: str, out: str | None = None) -> str:
    """Draw the picture of the run folder ``run_uri`` (local or s3://) into ``out``
    (default: curves.png in that folder); returns where it went."""
    run_uri = run_uri.rstrip("/")
    records = parse_lines(read_text(f"{run_uri}/{METRICS_FILE}"))
    if not records:
        raise FileNotFoundError(f"{run_uri}/{METRICS_FILE} is missing or empty; is {run_uri} a run folder?")
    about = json.loads(read_text(f"{run_uri}/{RUN_FILE}") or "{}")
    target = out or f"{run_uri}/{CURVES_FILE}"
    write_bytes(target, draw(records, about))
    return target


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(prog="python -m training.telemetry.curves", description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="the run's folder: <storage-path>/<run-name>, local or s3://")
    parser.add_argument("--out", help="where the PNG goes (default: curves.png in the run's folder)")
    args = parser.parse_args(argv)
    try:
        print(redraw(args.run, args.out))
    except FileNotFoundError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
