"""How a platform setting is declared and parsed: the context value's parsers (each names the key
in its error) and :func:`setting`, which makes a :class:`~ray_train_eks.config.PlatformConfig`
field of a context key with its parser, default, doc and check. No CDK here."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from typing import Any, Callable

# ---------------------------------------------------------------- parsers: context value -> field value

class ParseError(ValueError):
    """A context value that is not of its setting's kind; the message names the key."""


def text(raw: Any, key: str) -> str:
    """A string, stripped."""
    return str(raw).strip()


def integer(raw: Any, key: str) -> int:
    """A whole number (``-c`` gives strings; cdk.json numbers)."""
    try:
        if isinstance(raw, bool):
            raise ValueError
        return int(str(raw).strip())
    except ValueError:
        raise ParseError(f"{key}={raw!r}: expected a whole number, e.g. -c {key}=2") from None


def boolean(raw: Any, key: str) -> bool:
    """true/false (also 1/0, yes/no)."""
    if isinstance(raw, bool):
        return raw
    lowered = str(raw).strip().lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise ParseError(f"{key}={raw!r}: expected true or false")


def string_list(raw: Any, key: str) -> tuple[str, ...]:
    """A comma-separated list, a JSON list, or a cdk.json list."""
    if isinstance(raw, str):
        stripped = raw.strip()
        if stripped.startswith("["):
            try:
                raw = json.loads(stripped)
            except json.JSONDecodeError:
                raise ParseError(f"{key}={raw!r}: not a JSON list; use a comma-separated list, e.g. -c {key}=a,b") from None
        else:
            raw = stripped.split(",")
    if not isinstance(raw, (list, tuple)):
        raise ParseError(f"{key}={raw!r}: expected a list, e.g. -c {key}=a,b")
    return tuple(str(item).strip() for item in raw if str(item).strip())


def words(raw: Any, key: str) -> tuple[str, ...]:
    """Shell words (``--max-steps 60``), or a cdk.json list."""
    return tuple(raw) if isinstance(raw, list) else tuple(shlex.split(str(raw)))


# ---------------------------------------------------------------- the declaration

#: The configuration a check reads other settings of: a ray_train_eks.config.PlatformConfig, handed to
#: the check. Neither this module nor config_checks.py imports config.py (which imports both), so
#: the three import in one direction; what a check and the configuration both derive lives below
#: them (ray_train_eks/rules/, ray_train_eks/helm_charts.py).
ConfigView = Any
Check = Callable[[Any, ConfigView], "str | list[str] | None"]


@dataclass(frozen=True)
class Setting:
    """One context key: how it is parsed, what it defaults to, what it means, how it is checked."""

    key: str
    parse: Callable[[Any, str], Any]
    doc: str
    #: The README's default column, when the default's value alone would not say it.
    shown: str | None = None
    check: Check | None = None
    #: An environment variable read when the key is absent (before the default).
    env: str | None = None


def setting(key: str, parse: Callable[[Any, str], Any], default: Any, doc: str, *, shown: str | None = None,
            check: Check | None = None, env: str | None = None):
    """A :class:`PlatformConfig` field declared as the context setting ``key``."""
    return field(default=default, metadata={"setting": Setting(key, parse, doc, shown, check, env)})


def _empty_is_none(raw: Any) -> bool:
    return raw is None or raw == ""
