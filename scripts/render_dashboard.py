#!/usr/bin/env python3
"""Draw the CloudWatch dashboard that `cdk deploy` creates, from its synthesized body
(docs/dashboard.svg, shown in the README): every widget at its x, y, width and height on
CloudWatch's 24-column grid, with its title and the metrics it reads.

    python scripts/render_dashboard.py            # synthesize the default stack, write docs/dashboard.svg

tests/test_observability.py renders the same picture from its own synth and compares it
with the committed file, so the README cannot show a dashboard the stack no longer builds.
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from html import escape
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "docs" / "dashboard.svg"
#: Pixels per grid column and per grid row (CloudWatch: 24 columns; a row unit is short).
COLUMN_PX, ROW_PX, PAD = 44, 26, 4
_METRIC_NAME = re.compile(r'MetricName="([^"]+)"')


def dashboard_body(template: dict) -> dict:
    """The dashboard's JSON body from a synthesized template, with its CloudFormation
    references written as ``<LogicalId>`` (and the region as the template's region name)."""
    (dashboard,) = [r for r in template["Resources"].values() if r["Type"] == "AWS::CloudWatch::Dashboard"]
    body = dashboard["Properties"]["DashboardBody"]
    if isinstance(body, str):
        return json.loads(body)
    parts = body["Fn::Join"][1]

    def resolve(part) -> str:
        if isinstance(part, str):
            return part
        if "Ref" in part:
            return "<region>" if part["Ref"] == "AWS::Region" else f"<{part['Ref']}>"
        return f"<{part['Fn::GetAtt'][0]}>"

    return json.loads("".join(resolve(p) for p in parts))


def widget_metrics(widget: dict) -> list[str]:
    """Names of the metrics a widget reads (from SEARCH expressions and metric arrays)."""
    names: list[str] = []
    for row in widget.get("properties", {}).get("metrics", []):
        options = row[-1] if row and isinstance(row[-1], dict) else {}
        if "expression" in options:
            names += _METRIC_NAME.findall(options["expression"])
        elif len(row) >= 2 and isinstance(row[1], str):
            names.append(row[1])
    return list(dict.fromkeys(names))


def render_svg(body: dict) -> str:
    """An SVG of the dashboard's layout."""
    widgets = body["widgets"]
    width = 24 * COLUMN_PX
    height = max(w["y"] + w["height"] for w in widgets) * ROW_PX
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        'font-family="Helvetica, Arial, sans-serif">',
        f'<rect width="{width}" height="{height}" fill="#f2f3f3"/>',
    ]
    for widget in widgets:
        x, y = widget["x"] * COLUMN_PX + PAD, widget["y"] * ROW_PX + PAD
        w, h = widget["width"] * COLUMN_PX - 2 * PAD, widget["height"] * ROW_PX - 2 * PAD
        props = widget.get("properties", {})
        out.append(f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="4" fill="#ffffff" stroke="#aab7b8"/>')
        if widget["type"] == "text":
            lines = [line.lstrip("# ") for line in props.get("markdown", "").splitlines() if line.strip()]
            title, detail = lines[0], " ".join(lines[1:])
        elif widget["type"] == "alarm":
            title, detail = props.get("title", "Alarm"), "alarm state: OK / ALARM / INSUFFICIENT_DATA"
        else:
            title, detail = props.get("title", ""), ", ".join(widget_metrics(widget))
        titles = _wrap(title, max(20, w // 9))[:2]
        details = _wrap(detail, max(20, w // 7))[:3]
        for i, line in enumerate(titles):
            out.append(f'<text x="{x + 10}" y="{y + 20 + 17 * i}" font-size="14" font-weight="bold" fill="#16191f">'
                       f'{escape(line)}</text>')
        first = y + 24 + 17 * len(titles)
        for i, line in enumerate(details):
            out.append(f'<text x="{x + 10}" y="{first + 16 * i}" font-size="11" fill="#545b64">{escape(line)}</text>')
        if widget["type"] == "metric":
            # Where the curves go: one line per node, pod or run.
            base, top = y + h - 14, first + 16 * len(details)
            out.append(f'<line x1="{x + 10}" y1="{base}" x2="{x + w - 10}" y2="{base}" stroke="#d5dbdb"/>')
            out.append(f'<line x1="{x + 10}" y1="{top}" x2="{x + 10}" y2="{base}" stroke="#d5dbdb"/>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _wrap(text: str, width: int) -> list[str]:
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    return lines + ([line] if line else [])


def synth_default_template() -> dict:
    """The default stack's template, synthesized offline as `cdk synth` would."""
    from aws_cdk import App

    from ray_train_eks.app import build_app

    with tempfile.TemporaryDirectory() as tmp:
        app = App(outdir=tmp, context={"region": "us-west-2"})
        stack = build_app(app, dist_dir=None)
        return app.synth().get_stack_by_name(stack.stack_name).template


def main(argv: list[str] | None = None) -> int:
    import argparse

    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    OUTPUT.parent.mkdir(exist_ok=True)
    OUTPUT.write_text(render_svg(dashboard_body(synth_default_template())))
    print(f"wrote {OUTPUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
