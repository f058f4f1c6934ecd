"""What the driver (training/train.py) tells the run's watchers at its end (training/telemetry/notify.py):
finished, failed, stopped (on purpose, from outside, or before its capacity block ends) or out of
budget, each with the last step and loss it knows."""

from __future__ import annotations

import sys

from .notify import Notifier, first_line


def last_figures(folder: str, config) -> dict:
    """The last step and loss the run recorded (its metrics.jsonl), for a run that ended without a
    summary; {} where none can be read."""
    from ..storage.files import read_text
    from .runlog import METRICS_FILE, parse_lines

    try:
        lines = parse_lines(read_text(f"{folder}/{METRICS_FILE}"))
    except Exception as error:  # noqa: BLE001 - the message goes without them
        print(f"[notify] could not read the run's last step ({type(error).__name__}: {error})", file=sys.stderr, flush=True)
        return {"max_steps": config.max_steps}
    last = lines[-1] if lines else {}
    return {"step": last.get("step"), "loss": last.get("loss"), "max_steps": config.max_steps}


def out_of_budget(error: BaseException) -> bool:
    """Whether the run ended because a budget was spent: ``--max-failures``, ``--max-hardware-faults``, a node
    never replaced (training/resilience/preemption.py, raised by the retry counter in the controller), or
    ``--max-preemptions`` (Ray's own policy gives up on a preemption only then: its failures budget is
    unlimited, the retry counter keeps it)."""
    from ..resilience.preemption import FailureBudgetSpent, HardwareBudgetSpent, NoReplacement, classify

    seen, found = set(), error
    while found is not None and id(found) not in seen:
        seen.add(id(found))
        if isinstance(found, (FailureBudgetSpent, HardwareBudgetSpent, NoReplacement)):
            return True
        found = getattr(found, "controller_failure", None) or found.__cause__ or found.__context__
    try:
        return classify(error) == "preemption" and not isinstance(error, (KeyboardInterrupt, SystemExit))
    except Exception:  # noqa: BLE001 - not Ray's error
        return False


def notify_error(notifier: Notifier, error: BaseException, config, folder: str, *, killed: bool) -> None:
    """The run ended with ``error``: stopped from outside (``killed``: SIGTERM, in the seconds before the
    SIGKILL, so one quick try and nothing read), out of budget, or failed."""
    if killed:
        how = ("the driver was interrupted (Ctrl-C)" if isinstance(error, KeyboardInterrupt) else
               "the job was stopped from outside (ray-train-eks stop, ray job stop, or its RayJob deleted): the driver got "
               "SIGTERM")
        notifier.publish("stopped", how, quick=True, max_steps=config.max_steps)
        return
    figures = last_figures(folder, config)
    if out_of_budget(error):
        notifier.publish("out of budget", first_line(error), **figures)
    else:
        notifier.publish("failed", f"{type(error).__name__}: {first_line(error)}", **figures)


def notify_end(notifier: Notifier, summary: dict, config) -> None:
    """The run ended without an error: finished (an early stop included), or stopped before its stop time."""
    figures = {"step": summary.get("steps"), "loss": summary.get("final_loss"), "max_steps": config.max_steps,
               "checkpoint": summary.get("checkpoint")}
    if summary.get("stopped_before"):
        notifier.publish("stop time", summary["stopped_before"], **figures)
        return
    reason = (f"stopped early: {summary['stopped_early']}" if summary.get("stopped_early")
              else f"trained all {config.max_steps} steps")
    export = summary.get("export") or {}
    if export.get("reason"):
        reason += f"; the model is step {export.get('step')}'s ({export.get('which')}): {export['reason']}"
    notifier.publish("finished", reason, model=summary.get("final_model"), **figures)
