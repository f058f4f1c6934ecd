"""The evaluation options' checks, before Ray starts (``TrainConfig.problems``); whether the
benchmark tasks exist is asked of lm-evaluation-harness on the driver (:mod:`.harness`)."""

from __future__ import annotations

import os
import re

#: lm-evaluation-harness with its ``ifeval`` extra (langdetect, immutabledict, nltk), pinned as requirements-dev.txt
#: pins it, for the benchmark's own Ray tasks only, with the accelerate its ``hf`` model imports and PEFT for an
#: adapter (``LORA_PACKAGES``; training/evaluation/harness.py ``harness_runtime_env``). Never the job's: the harness
#: brings ``datasets``, whose presence changes how training reads a Hub data set (training/data/records.py).
HARNESS_PACKAGES = ("lm-eval[ifeval]==0.4.13",)
EXPORTS = ("best", "last")
_TASK_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


def task_names(text: str | None) -> list[str]:
    """``--eval-tasks`` as a list of names, in order, without repeats."""
    return list(dict.fromkeys(name.strip() for name in (text or "").split(",") if name.strip()))


def has_eval_data(config) -> bool:
    """Whether the run computes an eval loss (held-out rows or an eval split)."""
    return config.eval_fraction > 0 or config.eval_split is not None


def evaluation_problems(config) -> list[str]:
    """What is wrong with --export, --early-stopping-patience, the samples and the benchmark options."""
    p: list[str] = []
    if config.export not in EXPORTS:
        p.append(f"export={config.export!r}; use best (the step with the lowest eval loss, the default) or last")
    if config.early_stopping_patience < 0:
        p.append(f"early_stopping_patience={config.early_stopping_patience} must be 0 (off) or more")
    elif config.early_stopping_patience and not has_eval_data(config):
        p.append(f"early_stopping_patience={config.early_stopping_patience} needs an eval loss, but eval_fraction is 0 "
                 "and no eval_split is set; hold rows out with --eval-fraction 0.02, or drop --early-stopping-patience")
    if config.sample_prompts < 0:
        p.append(f"sample_prompts={config.sample_prompts} must be 0 (none) or more")
    names = task_names(config.eval_tasks)
    if config.eval_tasks is not None and not names:
        p.append(f"eval_tasks={config.eval_tasks!r} names no task; give comma-separated lm-evaluation-harness task names "
                 "such as gsm8k,ifeval, or none")
    bad = [name for name in names if not _TASK_NAME.match(name)]
    if bad:
        p.append(f"eval_tasks={config.eval_tasks!r}: {', '.join(map(repr, bad))} is not a task name (letters, digits, "
                 "'_', '.', '-'); give comma-separated names such as gsm8k,ifeval")
    if config.eval_tasks_path is not None:
        if not names:
            p.append(f"eval_tasks_path={config.eval_tasks_path!r} is set but eval_tasks is not; name the tasks to run "
                     "with --eval-tasks")
        if not os.path.isdir(os.path.expanduser(config.eval_tasks_path)):
            p.append(f"eval_tasks_path={config.eval_tasks_path!r}: no such folder on this machine (the job's driver); "
                     "give a folder of lm-evaluation-harness task YAML files")
    if config.eval_limit is not None and not names:
        p.append(f"eval_limit={config.eval_limit} is set but eval_tasks is not; name the tasks with --eval-tasks")
    return p
