"""The docs a newcomer navigates: the generated references (docs/reference/config.md from
CoordinatorConfig's comments, cli.md from the typer app) are what the code makes now, every
config field has a meaning and every command a section, and every relative link in README.md
and docs/ reaches a file (and, with an #anchor, a heading in it, by GitHub's slug rule)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from gyre.cli.reference import command_paths, references
from gyre.coordinator.config import CoordinatorConfig
from gyre.coordinator.configdoc import field_meanings

ROOT = Path(__file__).resolve().parents[1]
STALE = "stale: run python -m gyre.cli.reference"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def _prose(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code, inline code spans blanked."""
    out, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            out.append((n, re.sub(r"`[^`]*`", "``", line)))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation but - and _ dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """A page's heading anchors; a repeated heading's are base, base-1, base-2, ..."""
    names: set[str] = set()
    counts: dict[str, int] = {}
    fenced = False
    for line in page.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and (m := HEADING.match(line)):
            base = slug(m.group(1))
            n = counts.get(base, 0)
            names.add(f"{base}-{n}" if n else base)
            counts[base] = n + 1
    return names


def _links(page: Path):
    for n, line in _prose(page.read_text()):
        for m in LINK.finditer(line):
            target = m.group(1)
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, mailto: ... are not ours
                yield n, target


def test_slug_follows_github():
    assert slug("Run directory (the durable state)") == "run-directory-the-durable-state"
    assert slug("Loss (execution-level GSPO)") == "loss-execution-level-gspo"
    assert slug("gyre tasks run") == "gyre-tasks-run"
    assert slug("`max_tokens_cap` and E[d]") == "max_tokens_cap-and-ed"


@pytest.mark.parametrize("path", ["cli.md", "config.md"])
def test_generated_reference_is_current(path):
    page = ROOT / "docs" / "reference" / path
    want = {p.name: text for p, text in references().items()}[path]
    assert page.exists(), STALE
    assert page.read_text() == want, STALE


def test_every_config_field_has_a_meaning():
    meanings = field_meanings()
    assert list(meanings) == [f.name for f in dataclasses.fields(CoordinatorConfig)]
    assert [name for name, text in meanings.items() if not text.strip()] == []


def test_config_reference_lists_every_field_with_its_meaning():
    rows = {}  # field -> meaning, from the table's rows: | `name` | type | default | meaning |
    for line in (ROOT / "docs" / "reference" / "config.md").read_text().splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)]
        if len(cells) == 6 and re.fullmatch(r"`\w+`", cells[1]):
            rows[cells[1].strip("`")] = cells[4]
    missing = [f.name for f in dataclasses.fields(CoordinatorConfig) if not rows.get(f.name)]
    assert missing == [], STALE


def test_cli_reference_has_every_command():
    headings = set(re.findall(r"^## (.+)$", (ROOT / "docs" / "reference" / "cli.md").read_text(), re.M))
    paths = command_paths()
    assert {"gyre up", "gyre tasks run", "gyre keys init"} <= set(paths)
    assert [p for p in paths if p not in headings] == [], STALE


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for n, target in _links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{page.relative_to(ROOT)}:{n}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{page.relative_to(ROOT)}:{n}: {target} (no heading #{anchor})")
    assert broken == []


EMITTED = re.compile(r"""\.emit\(\s*["'](\w+)["']""")


def emitted_kinds() -> set[str]:
    """Every event kind the code journals: `.emit("kind", ...)` in coordinator/, proxy/, workerd/, cli/."""
    kinds: set[str] = set()
    for part in ("coordinator", "proxy", "workerd", "cli"):
        for path in (ROOT / part).rglob("*.py"):
            kinds.update(EMITTED.findall(path.read_text()))
    return kinds


def _sections(text: str) -> dict[str, str]:
    """`## name` -> its text up to the next `## `."""
    parts = re.split(r"^## (.+?)\s*$", text, flags=re.M)
    return {name: body for name, body in zip(parts[1::2], parts[2::2])}


def test_metrics_events_reference_has_every_kind_and_step_field():
    from gyre.coordinator.diagnosis import diagnose
    from gyre.coordinator.report import StepReport

    sections = _sections((ROOT / "docs" / "reference" / "metrics-events.md").read_text())
    kinds = emitted_kinds()
    assert {"step", "publish", "execution", "dispatch", "summary"} <= kinds
    assert sorted(kinds - set(sections)) == [], "event kinds emitted but not documented"
    assert sorted(set(sections) - kinds) == [], "sections for event kinds nothing emits"
    step = set(re.findall(r"^\|\s*`(\w+)`", sections["step"], re.M))
    fields = [f.name for f in dataclasses.fields(StepReport) if f.name != "diagnosis"]
    assert [f for f in [*fields, *diagnose([])] if f not in step] == [], "step fields not in its table"
    publish = set(re.findall(r"^\|\s*`(\w+)`", sections["publish"], re.M))
    assert "unchanged" in publish
