#!/usr/bin/env python3
"""Write the configuration table of docs/configuration.md from the settings' declarations
(ray_train_eks/config.py), and the training options' table of docs/fine-tuning.md from
training/config.py's fields, each between its two marker comments.

    python scripts/render_config_table.py

tests/test_config.py fails when a page's table and the declarations differ.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "configuration.md"
BEGIN = "<!-- configuration table: generated from ray_train_eks/config.py by scripts/render_config_table.py -->"
END = "<!-- end of configuration table -->"


OPTIONS_PAGE = ROOT / "docs" / "fine-tuning.md"
OPTIONS_BEGIN = "<!-- training options table: generated from training/config.py by scripts/render_config_table.py -->"
OPTIONS_END = "<!-- end of training options table -->"


def page_table(text: str, begin: str = BEGIN, end: str = END) -> str:
    """The table as a page has it (between the markers)."""
    match = re.search(re.escape(begin) + r"\n(.*?)" + re.escape(end), text, re.DOTALL)
    if not match:
        raise ValueError(f"no table between {begin!r} and {end!r}")
    return match.group(1)


def write_table(page: Path, begin: str, end: str, table: str) -> None:
    text = page.read_text()
    page_table(text, begin, end)  # the markers must be there
    start, stop = text.index(begin) + len(begin) + 1, text.index(end)
    page.write_text(text[:start] + table + text[stop:])
    print(f"wrote the table into {page}")


def main(argv: list[str] | None = None) -> int:
    import argparse
    import os

    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "20")
    sys.path.insert(0, str(ROOT))
    from ray_train_eks.config import configuration_table
    from training.config import options_table

    write_table(PAGE, BEGIN, END, configuration_table())
    write_table(OPTIONS_PAGE, OPTIONS_BEGIN, OPTIONS_END, options_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
