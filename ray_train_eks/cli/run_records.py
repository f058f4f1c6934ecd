"""A run's records in the platform's bucket, as ``ray-train-eks`` reads and writes them: the options
it was submitted with (what ``submit --resume`` submits again) and the run log the training writes
(``run.json``, ``metrics.jsonl``: training/telemetry/runlog.py), under ``s3://<bucket>/runs/<name>/``."""

from __future__ import annotations

import json
import math
import sys
import time
from datetime import datetime, timezone

#: The options a run was submitted with, in its folder.
SUBMITTED_FILE = "submitted.json"


class RecordsError(RuntimeError):
    """A run's records say the command cannot go on (said to the user)."""


def run_folder(settings: dict, name: str) -> tuple[str, str]:
    """The run's folder in the bucket (the pods' storage path, ``s3://<bucket>/runs``: workload/pods.py)."""
    return settings["bucket"], f"runs/{name}"


def _read(s3, bucket: str, key: str) -> str | None:
    try:
        return s3.get_object(Bucket=bucket, Key=key)["Body"].read().decode()
    except s3.exceptions.NoSuchKey:
        return None


def record_options(s3, settings: dict, name: str, options: list[str]) -> None:
    """Keep the run's options beside its checkpoints (its RayJob goes when it is stopped)."""
    bucket, folder = run_folder(settings, name)
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        s3.put_object(Bucket=bucket, Key=f"{folder}/{SUBMITTED_FILE}",
                      Body=json.dumps({"options": options, "submitted": datetime.now(timezone.utc).isoformat()}).encode())
    except (BotoCoreError, ClientError) as error:
        print(f"ray-train-eks: could not keep the run's options in s3://{bucket}/{folder}/{SUBMITTED_FILE} ({error}); "
              f"submit --resume {name} will need them again", file=sys.stderr)


def submitted_options(s3, settings: dict, name: str, given: list[str] | None = None) -> list[str]:
    """The options run ``name`` was last submitted with (:func:`record_options`). A run that
    ray-train-eks did not submit (no record: the deployed job's, one sent with ``ray job submit``)
    continues with the options ``given`` alone; with none given that is an error."""
    bucket, folder = run_folder(settings, name)
    text = _read(s3, bucket, f"{folder}/{SUBMITTED_FILE}")
    if text is not None:
        return json.loads(text)["options"]
    if given:
        print(f"ray-train-eks: run {name} was not submitted by ray-train-eks (no s3://{bucket}/{folder}/{SUBMITTED_FILE}): it "
              "continues with the options given after --", file=sys.stderr)
        return []
    raise RecordsError(f"--resume {name}: no s3://{bucket}/{folder}/{SUBMITTED_FILE}, so the run was not submitted by "
                       f"ray-train-eks and its options are not known; give them: submit --resume {name} -- OPTIONS (it "
                       "continues from its last checkpoint)")


def recorded(s3, settings: dict, name: str) -> str | None:
    """Which record of run ``name`` the bucket holds (a submit's options or the training's run log), or None."""
    bucket, folder = run_folder(settings, name)
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        listed = s3.list_objects_v2(Bucket=bucket, Prefix=f"{folder}/", MaxKeys=1)
    except (BotoCoreError, ClientError) as error:
        print(f"ray-train-eks: cannot look for run {name}'s records in s3://{bucket}/{folder}/ ({error})", file=sys.stderr)
        return None
    found = listed.get("Contents") or []
    return f"s3://{bucket}/{found[0]['Key']}" if found else None


def number(value, digits: int = 4) -> str:
    """A metric as the user reads it: ``nan`` where the run's value was not a number (the run log
    writes NaN and infinity as null), ``-`` where there is none."""
    if value is None:
        return "nan"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return f"{value:.{digits}f}"


def progress(s3, settings: dict, name: str) -> dict:
    """What the run's own records say (its ``run.json`` and ``metrics.jsonl``, which rank 0 writes
    as it trains): the step of max steps, the last loss and eval loss, tokens/s, and an ETA from the
    median step time; {} before its first step."""
    bucket, folder = run_folder(settings, name)
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        about, lines = json.loads(_read(s3, bucket, f"{folder}/run.json") or "{}"), []
        text = _read(s3, bucket, f"{folder}/metrics.jsonl") or ""
    except (BotoCoreError, ClientError) as error:  # the cluster answered; the bucket is the user's AWS access
        print(f"ray-train-eks: cannot read run {name}'s records in s3://{bucket}/{folder}/ ({error})", file=sys.stderr)
        return {}
    for line in text.splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:  # a line being written
            continue
    if not lines:
        return {}
    last = lines[-1]
    evals = [line["eval_loss"] for line in lines if line.get("eval_loss") is not None]
    seconds = sorted(line["step_seconds"] for line in lines[-20:] if line.get("step_seconds"))
    best = [line for line in lines if line.get("best_step") is not None]
    found = {"step": last["step"], "max_steps": about.get("max_steps"), "loss": last.get("loss"),
             "eval_loss": evals[-1] if evals else None,
             "tokens_per_s": last.get("tokens_per_s")}
    if best:
        found["best"] = (best[-1]["best_step"], best[-1].get("best_eval_loss"))
    for key in ("stop_before", "capacity_block"):  # its stop time (training/resilience/deadline.py ``record``)
        if about.get(key):
            found[key] = about[key]
    if about.get("min_nodes"):  # an elastic run (training/resilience/elastic.py): its size now and its resizes
        found["elastic"] = elastic_progress(about, lines)
    if seconds and found["max_steps"]:
        found["eta_min"] = (found["max_steps"] - last["step"]) * seconds[len(seconds) // 2] / 60
    if isinstance(last.get("cost_usd"), (int, float)):  # priced as its nodes are billed (training/telemetry/cost.py)
        rate = about.get("cost") or {}
        found["cost"] = {"so_far": last["cost_usd"], "projected": last.get("cost_usd_projected"), "at": last.get("time"),
                         "usd_per_hour": rate.get("usd_per_hour"), "basis": rate.get("basis")}
    return found


def cost_so_far(found: dict, running: bool, now: float | None = None) -> float | None:
    """USD the run has cost: its last step's figure, and while it runs its nodes' rate since that step."""
    cost = found.get("cost")
    if not cost:
        return None
    since = (now or time.time()) - cost["at"] if running and cost.get("at") and cost.get("usd_per_hour") else 0.0
    return cost["so_far"] + cost.get("usd_per_hour", 0) * max(0.0, since) / 3600 if since else cost["so_far"]


def cost_line(found: dict, running: bool, now: float | None = None) -> str | None:
    """The run's cost as ``status`` says it: so far, at what rate and how billed, and at its end at the pace
    measured; None before a priced step (a local run, or no step yet)."""
    cost = found.get("cost")
    if not cost:
        return None
    rate = f" at {cost['usd_per_hour']:.2f} USD/h ({cost['basis']})" if cost.get("usd_per_hour") else ""
    projected = f"; about {cost['projected']:.2f} USD at step {found['max_steps']} at this pace" if (
        cost.get("projected") is not None and found.get("max_steps")) else ""
    return f"cost so far {cost_so_far(found, running, now):.2f} USD{rate}{projected}"


def elastic_progress(about: dict, lines: list[dict]) -> dict:
    """An elastic run's nodes now, of how many and at least how many, and each resize (the step it
    resumed at, from and to how many nodes, why), from its run.json and metrics.jsonl."""
    per_node = about.get("workers_per_node") or 1
    resizes = [(line["step"], line["resized_from_workers"] // per_node, line["workers"] // per_node, line.get("resume_cause"))
               for line in lines if line.get("resized_from_workers") and line.get("workers")]
    return {"nodes": (lines[-1].get("workers") or 0) // per_node, "of": about.get("nodes"), "min": about["min_nodes"],
            "resizes": resizes}


def elastic_line(found: dict) -> str | None:
    """The run's size as ``status`` says it: on how many of its nodes, and its last resizes; None for a fixed-size run."""
    elastic = found.get("elastic")
    if not elastic:
        return None
    said = "; ".join(f"step {step}: {before} -> {after} ({why})" for step, before, after, why in elastic["resizes"][-3:])
    return (f"on {elastic['nodes']} of {elastic['of']} GPU nodes (elastic, --min-nodes {elastic['min']})"
            + (f"; resized {len(elastic['resizes'])} time(s), the last: {said}" if said else ""))


def _epoch(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp()


def _in(seconds: float) -> str:
    minutes = int(seconds // 60)
    return f"{minutes // 60} h {minutes % 60} min" if minutes >= 60 else f"{minutes} min"


def stop_time_line(found: dict, now: float | None = None) -> str | None:
    """The run's stop time, as ``status`` says it: its capacity block's end (in how long, or ended), and when
    the run checkpoints and stops; None for a run without one."""
    import time

    now = time.time() if now is None else now
    block, stop = found.get("capacity_block"), found.get("stop_before")
    if not stop:
        return None
    stops = f"the run checkpoints and stops, resumable, by {stop[11:16]} UTC"
    if block:
        ends = _epoch(block["ends"])
        if ends <= now:
            return f"capacity block {block['id']} ended at {block['ends']} (EC2 reclaimed its instances)"
        return (f"capacity block {block['id']} ends in {_in(ends - now)} (at {block['ends'][11:16]} UTC; its nodes go from "
                f"40 min before): {stops}")
    left = _epoch(stop) - now
    return f"--stop-before {stop}: " + (f"in {_in(left)}, {stops}" if left > 0 else "passed")


#: The training's record of the run's MLflow run (training/telemetry/tracking.py ``RUN_RECORD``).
TRACKING_RECORD = "mlflow_run.json"


def tracking_url(s3, settings: dict, name: str) -> str | None:
    """Where the run's MLflow run is seen (its UI page, or the command that opens a SageMaker
    MLflow App's), from the record beside its checkpoints; None for a run that is not tracked."""
    bucket, folder = run_folder(settings, name)
    from botocore.exceptions import BotoCoreError, ClientError

    from ray_train_eks.training_code.telemetry.tracking import run_url

    try:
        record = json.loads(_read(s3, bucket, f"{folder}/{TRACKING_RECORD}") or "{}")
    except (BotoCoreError, ClientError, ValueError):
        return None
    if not record.get("run_id"):
        return None
    return run_url(record["tracking_uri"], record["experiment_id"], record["run_id"])


#: What the training leaves beside the metrics (training/train.py, training/telemetry/runlog.py).
SUMMARY_RECORD, SAMPLES_RECORD = "summary.json", "samples.jsonl"


def outcome(s3, settings: dict, name: str) -> list[str]:
    """Lines on what the run decided: the latest evaluation's samples (prompt and completion), and once it
    ended, which step's weights it exported and why, why it stopped early, and its benchmark scores
    against the base's; from its ``samples.jsonl`` and ``summary.json``."""
    bucket, folder = run_folder(settings, name)
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        samples = [json.loads(line) for line in (_read(s3, bucket, f"{folder}/{SAMPLES_RECORD}") or "").splitlines() if line.strip()]
        summary = json.loads(_read(s3, bucket, f"{folder}/{SUMMARY_RECORD}") or "{}")
    except (BotoCoreError, ClientError, ValueError):
        return []
    lines = []
    latest = [sample for sample in samples if sample["step"] == samples[-1]["step"]] if samples else []
    for sample in latest[:2]:
        lines.append(f"sample at step {sample['step']}: {sample['prompt'][:60]!r} -> {sample['completion'][:100]!r}"
                     + ("" if sample.get("ended") else " (cut at --sample-max-tokens)"))
    export = summary.get("export") or {}
    if export:
        lines.append(f"exported step {export['step']} ({export['which']}): {export['reason']}")
    if summary.get("stopped_early"):
        lines.append(f"stopped early: {summary['stopped_early']}")
    cost = summary.get("cost") or {}
    if cost.get("usd") is not None:  # the driver's at the end (training/telemetry/cost.py ``RunCost.final``)
        earlier = f", {cost['earlier_usd']:.2f} USD of it before the last restart" if cost.get("earlier_usd") else ""
        lines.append(f"cost {cost['usd']:.2f} USD ({cost.get('basis', '?')}: {cost.get('usd_per_hour', 0):.2f} USD/h{earlier})")
    if summary.get("stopped_before"):
        lines.append(f"stopped before its stop time: {summary['stopped_before']}")
    bench = summary.get("benchmarks") or {}
    if bench.get("error"):
        lines.append(f"benchmark failed: {bench['error']}")
    for task, scores in (bench.get("scores") or {}).items():
        base = (bench.get("base") or {}).get(task, {})
        lines.append(f"benchmark {task}: " + ", ".join(
            f"{metric} {number(value)}" + (f" (base {number(base[metric])}, {value - base[metric]:+.4f})" if metric in base else "")
            for metric, value in scores.items()))
    return lines
