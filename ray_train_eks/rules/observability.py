"""The rules of the CloudWatch observability add-on, its log groups and the idle-GPU alarm
(ray_train_eks/constructs/observability.py)."""

from __future__ import annotations

import re

from ray_train_eks.observability import ADDON_VERSION, LOG_RETENTION_DAYS, MIN_POD_IDENTITY_ADDON_VERSION
from ray_train_eks.validation import Prop

ADDON_NAME = "amazon-cloudwatch-observability"
_ADDON_VERSION = re.compile(r"^v(\d+)\.(\d+)\.(\d+)-eksbuild\.\d+$")
# Deliberately loose (SNS confirms the address): one @, a dot in the domain, no spaces.
_EMAIL = re.compile(r"^[^@\s]+@[^@\s]+\.[^@\s]+$")
#: Minutes of Container Insights' newest data that may not have arrived when the idle-GPU alarm
#: evaluates (the agent sends each minute's metrics as embedded-metric-format logs once a minute,
#: and CloudWatch extracts them from the logs: a minute or two late). The alarm's metric math
#: FILLs a missing minute with "busy" (FILL(gpus, 0): no GPU node), so the alarm takes
#: ``minutes`` breaching datapoints out of ``minutes`` + this many (an M-out-of-N alarm, the
#: CloudWatch User Guide's remedy for late and intermittent data): with N out of N, the newest,
#: not yet arrived minute kept every evaluation below its N and the alarm never fired.
IDLE_LATE_MINUTES = 3
#: The idle-GPU alarm's window, minutes: under 5 it fires between two steps of a job; a day
#: (with the minutes for late data) is CloudWatch's longest alarm window.
IDLE_MINUTES = (5, 1440 - IDLE_LATE_MINUTES)


def addon_version_problem(version: str, prop: Prop = Prop("addon_version")) -> str | None:
    """Why the add-on release ``version`` cannot be used, or None."""
    match = _ADDON_VERSION.match(version)
    if not match:
        return (f"{prop(version)}: an EKS add-on version looks like {ADDON_VERSION} (list them: aws eks "
                f"describe-addon-versions --addon-name {ADDON_NAME})")
    if tuple(int(part) for part in match.groups()) < MIN_POD_IDENTITY_ADDON_VERSION:
        minimum = ".".join(map(str, MIN_POD_IDENTITY_ADDON_VERSION))
        return (f"{prop(version)}: before v{minimum} the add-on cannot take its credentials from EKS Pod Identity; "
                f"use {ADDON_VERSION}")
    return None


def log_retention_problem(days: int, prop: Prop = Prop("log_retention_days")) -> str | None:
    """Why ``days`` is not a retention CloudWatch Logs accepts, or None."""
    if days not in LOG_RETENTION_DAYS:
        return f"{prop(days)}: not a CloudWatch Logs retention; use one of {', '.join(map(str, LOG_RETENTION_DAYS))}"
    return None


def idle_threshold_problem(percent: float, prop: Prop = Prop("threshold_percent")) -> str | None:
    """Why ``percent`` cannot be the idle-GPU threshold, or None."""
    if not 1 <= percent <= 100:
        return f"{prop(percent)}: a percentage from 1 to 100; e.g. 5"
    return None


def idle_minutes_problem(minutes: int, prop: Prop = Prop("minutes")) -> str | None:
    """Why ``minutes`` cannot be the idle-GPU alarm's window, or None."""
    low, high = IDLE_MINUTES
    if not low <= minutes <= high:
        return (f"{prop(minutes)}: use {low} to {high} minutes (a day, CloudWatch's longest alarm window, less the minutes "
                f"for late data; under {low} the alarm fires between two steps of a job); e.g. 30")
    return None


def alarm_email_problem(email: str | None, prop: Prop = Prop("email")) -> str | None:
    """Why ``email`` is not an e-mail address, or None."""
    if email is not None and not _EMAIL.match(email):
        return f"{prop(email)}: not an e-mail address; e.g. {prop.example('you@example.com')}"
    return None
