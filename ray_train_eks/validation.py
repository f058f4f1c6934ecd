"""How a rule names what it checks, so that one rule gives the same message to a construct's
user (``node_count=0``) and to ``cdk synth`` (``-c gpuNodeCount=2``).

A construct states the rules of its props as functions in ``ray_train_eks.rules``
(``efa_gpu_type_problem`` and the like; importable from the construct's module too), each taking
the value and a :class:`Prop`; the construct raises them at construction, and the platform
configuration collects the same functions for its context keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable


@dataclass(frozen=True)
class Prop:
    """The name a value goes by: a construct's keyword argument, or a CDK context key (``context``)."""

    name: str
    context: bool = False

    def __call__(self, value: Any) -> str:
        """``name=value`` as a message shows what it was given (strings quoted)."""
        return f"{self.name}={value!r}" if isinstance(value, str) else f"{self.name}={value}"

    def example(self, value: Any) -> str:
        """How the user sets it: ``-c gpuNodeCount=2`` on the command line, ``node_count=2`` in code."""
        return f"-c {self.name}={value}" if self.context else f"{self.name}={value!r}"


def context_key(name: str) -> Prop:
    """The :class:`Prop` of a CDK context key."""
    return Prop(name, context=True)


def raise_problems(owner: str, problems: Iterable[str | None]) -> None:
    """Raise one ``ValueError`` naming ``owner`` with every problem found (None: no problem)."""
    found = [problem for problem in problems if problem]
    if found:
        raise ValueError(f"{owner}: " + "; ".join(found))
