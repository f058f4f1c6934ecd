#!/usr/bin/env python3
"""Write the configuration table of docs/configuration.md from the settings' declarations
(ray_train_eks/config.py), between its two marker comments.

    python scripts/render_config_table.py

tests/test_config.py fails when the page's table and the declarations differ.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "configuration.md"
BEGIN = "<!-- configuration table: generated from ray_train_eks/config.py by scripts/render_config_table.py -->"
END = "<!-- end of configuration table -->"


def page_table(text: str) -> str:
    """The table as docs/configuration.md has it (between the markers)."""
    match = re.search(re.escape(BEGIN) + r"\n(.*?)" + re.escape(END), text, re.DOTALL)
    if not match:
        raise ValueError(f"{PAGE.relative_to(ROOT)} has no configuration table between {BEGIN!r} and {END!r}")
    return match.group(1)


def main() -> int:
    import os

    os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "20")
    sys.path.insert(0, str(ROOT))
    from ray_train_eks.config import configuration_table

    text = PAGE.read_text()
    page_table(text)  # the markers must be there
    start, end = text.index(BEGIN) + len(BEGIN) + 1, text.index(END)
    PAGE.write_text(text[:start] + configuration_table() + text[end:])
    print(f"wrote the configuration table into {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
