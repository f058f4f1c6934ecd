"""The README and the docs/ pages: every relative link reaches a file, every #anchor a heading
(GitHub's slug) or an explicit <a id/name>, and the README stays short. No network: http(s)
and other links with a scheme are not followed. Pure text work, no project imports."""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 120


def pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]


# ---------------------------------------------------------------- reading Markdown

_FENCE = re.compile(r"^ *(`{3,}|~{3,})")
_COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
_CODE_SPAN = re.compile(r"(`+)(?!`).+?(?<!`)\1(?!`)", re.DOTALL)
# [text](target "title") and ![alt](target): the target may hold one level of parentheses, or be <...>.
_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^<>\n]*>|(?:[^()\s]|\([^()\s]*\))*)(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^()]*\)))?\s*\)")
_REFERENCE_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^<>\n]*>|\S+)", re.MULTILINE)
_HTML_LINK = re.compile(r"<(?:a|img|source)\b[^>]*?\b(?:href|src)\s*=\s*[\"']([^\"']*)[\"']", re.IGNORECASE)
_HTML_ANCHOR = re.compile(r"<a\b[^>]*?\b(?:id|name)\s*=\s*[\"']([^\"']+)[\"']", re.IGNORECASE)
_ATX_HEADING = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
_SETEXT_UNDERLINE = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def prose_lines(text: str) -> list[str]:
    """The page's lines with fenced code blocks blanked (kept as empty lines, so numbering holds)."""
    lines, fence = [], None
    for line in text.split("\n"):
        match = _FENCE.match(line)
        if fence is None and match:
            fence = match.group(1)
            lines.append("")
        elif fence is not None:
            if match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence) \
                    and not line.strip()[len(match.group(1)):].strip():
                fence = None
            lines.append("")
        else:
            lines.append(line)
    return lines


def _without_code(text: str) -> str:
    """Prose only: no fenced blocks, no HTML comments, no code spans (a span may cross lines, never
    a blank one)."""
    prose = _COMMENT.sub(lambda m: "\n" * m.group(0).count("\n"), "\n".join(prose_lines(text)))
    paragraphs = re.split(r"(\n[ \t]*\n)", prose)
    return "".join(_CODE_SPAN.sub(lambda m: "\n" * m.group(0).count("\n"), p) for p in paragraphs)


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every link and image of the page, outside code."""
    prose = _without_code(text)
    found = []
    for pattern in (_INLINE_LINK, _REFERENCE_DEFINITION, _HTML_LINK):
        for match in pattern.finditer(prose):
            target = match.group(1).strip()
            if target.startswith("<") and target.endswith(">"):
                target = target[1:-1]
            found.append((prose.count("\n", 0, match.start()) + 1, target))
    return sorted(found)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: the rendered text lowercased, every character but
    letters, digits, underscores, hyphens and spaces dropped, each space a hyphen."""
    text = re.sub(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text)  # HTML tags
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor of the page: its headings' slugs (a repeated one gets -1, -2, ...) and its
    explicit <a id="..."> / <a name="...">."""
    found, seen = set(), {}
    lines = prose_lines(text)
    headings = []
    for i, line in enumerate(lines):
        atx = _ATX_HEADING.match(line)
        if atx:
            headings.append(atx.group(2) or "")
        elif _SETEXT_UNDERLINE.match(line) and i and lines[i - 1].strip() and not _ATX_HEADING.match(lines[i - 1]) \
                and not lines[i - 1].lstrip().startswith(("|", "-", "*", ">")):
            headings.append(lines[i - 1].strip())
    for heading in headings:
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    found.update(_HTML_ANCHOR.findall(_COMMENT.sub("", "\n".join(lines))))
    return found


def link_problems(page: Path, root: Path = ROOT) -> list[str]:
    """Why each relative link or anchor of the page does not resolve, one line each."""
    text = page.read_text()
    name = page.relative_to(root).as_posix()
    problems = []
    for line, target in links(text):
        where = f"{name}:{line}: link {target!r}"
        if not target:
            problems.append(f"{where}: empty target")
            continue
        if _SCHEME.match(target) or target.startswith("//"):
            continue  # http(s), mailto: not checked here (no network)
        path_part, _, anchor = target.partition("#")
        path_part = unquote(path_part.split("?", 1)[0])
        if path_part:
            resolved = (root / path_part.lstrip("/")) if path_part.startswith("/") else (page.parent / path_part)
            if not resolved.exists():
                shown = Path(os.path.relpath(resolved, root)).as_posix()
                problems.append(f"{where}: no such file {shown} (relative to {name})")
                continue
        else:
            resolved = page
        if anchor:
            anchor = unquote(anchor)
            if resolved.is_dir() or resolved.suffix.lower() not in (".md", ".markdown"):
                problems.append(f"{where}: an anchor into {resolved.name}, which is not a Markdown page")
            elif anchor not in anchors(resolved.read_text()):
                problems.append(f"{where}: no heading or <a id> in {resolved.relative_to(root).as_posix()} "
                                f"has the anchor #{anchor}")
    return problems


# ---------------------------------------------------------------- the checks


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_and_anchor_resolves(page):
    problems = link_problems(page)
    assert not problems, f"{len(problems)} broken link(s):\n  " + "\n  ".join(problems)


def test_the_readme_is_short():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, more than {README_MAX_LINES}: move the detail to a page of docs/ and link it")


def test_the_readme_links_every_docs_page():
    linked = {target.partition("#")[0] for _, target in links((ROOT / "README.md").read_text())}
    missing = [p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "docs").glob("*.md"))
               if p.relative_to(ROOT).as_posix() not in linked]
    assert not missing, f"README.md's map of the docs does not link {', '.join(missing)}"


def test_the_changelog_is_linked_from_the_readme_with_one_entry_a_round_newest_first():
    linked = {target.partition("#")[0] for _, target in links((ROOT / "README.md").read_text())}
    assert "CHANGELOG.md" in linked
    rounds = [int(n) for n in re.findall(r"(?m)^## Round (\d+)$", (ROOT / "CHANGELOG.md").read_text())]
    assert rounds and rounds == sorted(set(rounds), reverse=True), rounds
    assert "Round" not in (ROOT / "README.md").read_text(), "the README holds no changelog: it is CHANGELOG.md"


def test_the_checker_finds_links_anchors_and_what_is_broken(tmp_path):
    """The checker itself, on pages made for it: it must not pass by finding nothing."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "pic.svg").write_text("<svg/>")
    (tmp_path / "docs" / "other.md").write_text(
        "# Other page\n\n## GPU nodes only while a job runs (`gpuCapacity=karpenter`)\n\n## Spot GPUs, and a preemption\n\n"
        "## Repeated\n\n## Repeated\n\n<a id=\"custom-anchor\"></a>\n\nSetext heading\n---\n")
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "# Page\n\n"
        "![ok](pic.svg) [ok](other.md#gpu-nodes-only-while-a-job-runs-gpucapacitykarpenter) "
        "[ok](other.md#spot-gpus-and-a-preemption) [ok](other.md#repeated-1) [ok](other.md#custom-anchor) "
        "[ok](other.md#setext-heading) [ok](#page) [ok](../docs/other.md) [ok](https://example.com/missing.md)\n\n"
        "[bad file](docs/pic.svg) [bad anchor](other.md#no-such-heading) [bad own anchor](#nowhere)\n"
        "[bad repeat](other.md#repeated-2)\n\n"
        "`[in code](missing.md)` and\n\n```\n[in a fence](missing.md)\n# not a heading\n```\n")
    problems = link_problems(page, root=tmp_path)
    assert len(problems) == 4, problems
    assert "docs/page.md:5: link 'docs/pic.svg': no such file docs/docs/pic.svg (relative to docs/page.md)" in problems
    assert "docs/page.md:5: link 'other.md#no-such-heading': no heading or <a id> in docs/other.md has the anchor #no-such-heading" in problems
    assert any("'#nowhere'" in p for p in problems) and any("'other.md#repeated-2'" in p for p in problems)
    assert "not-a-heading" not in anchors(page.read_text())


def test_slugs_are_githubs():
    assert slug("What `cdk destroy` keeps") == "what-cdk-destroy-keeps"
    assert slug("The fine-tune: `training/`") == "the-fine-tune-training"
    assert slug("Will the model fit? The memory plan") == "will-the-model-fit-the-memory-plan"
    assert slug("The cluster's API endpoint, and the template's security checks") == \
        "the-clusters-api-endpoint-and-the-templates-security-checks"
    assert slug("See [the run](x.md): logs_and_more") == "see-the-run-logs_and_more"
