"""Every command a user is told to type answers ``--help``: the training module, each ``ray-train-eks``
subcommand (read from the parser, so a new one is covered by itself), and each ``python -m`` module
and ``scripts/`` file the README, the docs pages and the Makefile name. In this process, as
``python -m`` runs them (``runpy``): argparse prints the help and exits 0 before anything else runs."""

from __future__ import annotations

import argparse
import re
import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Where commands are given to the user.
PAGES = [ROOT / "README.md", ROOT / "Makefile", *sorted((ROOT / "docs").glob("*.md"))]
#: ``python -m X`` (or the Makefile's ``$(PY) -m X``) and ``python scripts/X.py``, as written there.
MODULE = re.compile(r"(?:python3?|\$\(PY\)) -m ([a-z_][\w.]*)")
SCRIPT = re.compile(r"(?:python3?|\$\(PY\)) (scripts/[\w/]+\.py)")
#: Tools of their own, not ours.
NOT_OURS = {"pip", "pytest", "venv"}


def documented_commands() -> list[str]:
    """Every ``python -m`` module and ``scripts/`` file the pages tell a user to run."""
    text = "\n".join(page.read_text() for page in PAGES)
    modules = {m for m in MODULE.findall(text) if m.split(".")[0] not in NOT_OURS}
    return sorted(modules | set(SCRIPT.findall(text)))


def help_of(command: str, argv: list[str], monkeypatch, capsys) -> str:
    """What ``python -m <command> <argv>`` (or ``python <script> <argv>``) prints, as the command runs
    it: with ``__name__ == "__main__"``; fails unless it exits 0."""
    monkeypatch.setattr(sys, "argv", [command, *argv])
    with pytest.raises(SystemExit) as exited:
        if command.endswith(".py"):
            runpy.run_path(str(ROOT / command), run_name="__main__")
        else:
            runpy.run_module(command, run_name="__main__", alter_sys=True)
    out = capsys.readouterr().out
    assert exited.value.code in (0, None), f"{command} {' '.join(argv)} exited {exited.value.code}: {out[-2000:]}"
    return out


def test_the_docs_name_the_commands_this_test_runs():
    """The discovery itself: the training module, a bench module and a script are among them."""
    found = documented_commands()
    assert {"training.train", "bench.train_throughput", "scripts/render_config_table.py", "ray_train_eks.demo"} <= set(found)


# A bench module another imported first is run again as __main__, as ``python -m`` would run it alone.
@pytest.mark.filterwarnings("ignore:.*found in sys.modules after import of package:RuntimeWarning")
@pytest.mark.parametrize("command", documented_commands())
def test_every_documented_command_prints_its_help_and_exits_0(command, monkeypatch, capsys):
    assert "usage:" in help_of(command, ["--help"], monkeypatch, capsys)


def subcommands() -> list[str]:
    """``ray-train-eks``'s subcommands, as its parser has them."""
    from ray_train_eks.cli import parser

    (choices,) = [action.choices for action in parser()._actions if isinstance(action, argparse._SubParsersAction)]
    return sorted(choices)


def test_ray_train_eks_has_the_subcommands_the_docs_teach():
    assert {"submit", "list", "status", "logs", "stop"} <= set(subcommands())


@pytest.mark.parametrize("argv", [["--help"], *([name, "--help"] for name in subcommands())], ids=" ".join)
def test_ray_train_eks_and_each_subcommand_print_their_help_and_exit_0(argv, monkeypatch, capsys):
    """Through the installed entry point (pyproject's ``ray-train-eks = ray_train_eks.cli:main``)."""
    from importlib.metadata import entry_points

    (entry,) = entry_points(group="console_scripts", name="ray-train-eks")
    monkeypatch.setattr(sys, "argv", ["ray-train-eks", *argv])
    with pytest.raises(SystemExit) as exited:
        entry.load()(argv)
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith("usage: ray-train-eks")
