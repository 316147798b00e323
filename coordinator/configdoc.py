"""configdoc.py: docs/reference/config.md, generated from config.py's source.

Each `CoordinatorConfig` field's name, type and default as written there, and its meaning: the
comment on its line and the full-line comments directly above it. A field with neither has no
meaning, which tests/test_docs.py refuses, so the comment in config.py is the one place a field
is explained. `python -m gyre.cli.reference` writes the page.
Not the config's loader or checker (runconfig.py, config.py): source text only, stdlib only.
"""

from __future__ import annotations

import ast
import io
import tokenize
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).with_name("config.py")
CLASS = "CoordinatorConfig"

INTRO = """\
# Run config reference

Every field of `CoordinatorConfig` (`coordinator/config.py`), the one typed config of a run.
Set fields in a config file (TOML, YAML or JSON: `gyre up CONFIG`) or on the command line
(`--set FIELD=VALUE`, parsed by the field's type); `gyre config show` prints the resolved value
of each and where it came from. The run writes the resolved config to its run directory as
`config.json`. Derived rules (ranges, allowed values) are checked when the config is built.

Generated from the source's comments by `python -m gyre.cli.reference`; edit config.py, not
this page.
"""


@dataclass(frozen=True, slots=True)
class FieldDoc:
    name: str
    type: str
    default: str | None  # as written in source; None: required
    meaning: str


def _comments(source: str) -> dict[int, str]:
    """line number -> the text of the comment on it, without `#`."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


def _meaning(lines: list[str], comments: dict[int, str], stmt: ast.stmt) -> str:
    above, n = [], stmt.lineno - 1
    while n >= 1 and lines[n - 1].strip().startswith("#"):
        above.insert(0, comments[n])
        n -= 1
    trailing = [comments[i] for i in range(stmt.lineno, stmt.end_lineno + 1) if i in comments]
    parts = [" ".join(above), " ".join(trailing)]
    return " — ".join(p for p in parts if p)


def fields(source: str | None = None) -> list[FieldDoc]:
    """The class's fields in source order."""
    source = SOURCE.read_text() if source is None else source
    tree, lines, comments = ast.parse(source), source.splitlines(), _comments(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == CLASS)
    out = []
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            default = None if stmt.value is None else ast.get_source_segment(source, stmt.value)
            out.append(FieldDoc(name=stmt.target.id, type=ast.get_source_segment(source, stmt.annotation),
                                default=default, meaning=_meaning(lines, comments, stmt)))
    return out


def field_meanings() -> dict[str, str]:
    """field name -> its meaning ('' where config.py explains it nowhere)."""
    return {f.name: f.meaning for f in fields()}


def _cell(text: str, code: bool = False) -> str:
    text = text.replace("|", "\\|")
    return f"`{text}`" if code else text


def config_reference() -> str:
    rows = ["| field | type | default | meaning |", "|---|---|---|---|"]
    for f in fields():
        default = "required" if f.default is None else _cell(f.default, code=True)
        rows.append(f"| `{f.name}` | {_cell(f.type, code=True)} | {default} | {_cell(f.meaning)} |")
    return INTRO + "\n" + "\n".join(rows) + "\n"
