"""reference.py: docs/reference/cli.md, generated from the typer app, and the command that
writes both generated references.

Every command and subcommand of `gyre` (cli/main.py's app, through click's command tree): its
usage, its help text, and each argument and option with the help `--help` prints.
`python -m gyre.cli.reference` writes docs/reference/cli.md and docs/reference/config.md
(coordinator/configdoc.py); tests/test_docs.py fails while either is stale.
Not the help itself: that stays in the commands' docstrings and cli/options.py.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import typer
import typer.main

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "reference"

INTRO = """\
# Command-line reference

Every `gyre` command, its arguments and options, as `gyre COMMAND --help` prints them.
Generated from the typer app (`cli/main.py`) by `python -m gyre.cli.reference`; edit the
commands' docstrings and help texts, not this page.
"""


def commands() -> list[tuple[str, object, typer.Context]]:
    """(path, command, context) for the root and every command under it, depth first."""
    root = typer.main.get_command(_app())
    out = []

    def walk(cmd, ctx: typer.Context, path: str) -> None:
        if cmd.hidden:
            return
        out.append((path, cmd, ctx))
        if hasattr(cmd, "list_commands"):
            for name in cmd.list_commands(ctx):
                sub = cmd.get_command(ctx, name)
                walk(sub, typer.Context(sub, info_name=name, parent=ctx), f"{path} {name}")

    walk(root, typer.Context(root, info_name="gyre"), "gyre")
    return out


def command_paths() -> list[str]:
    return [path for path, _, _ in commands()]


def _app() -> typer.Typer:
    from gyre.cli.main import app

    return app


def _slug(path: str) -> str:
    return path.replace(" ", "-")


def _section(path: str, cmd, ctx: typer.Context) -> str:
    usage = " ".join([path, *cmd.collect_usage_pieces(ctx)])
    lines = [f"## {path}", "", "```", usage, "```", ""]
    if cmd.help:
        lines += [inspect.cleandoc(cmd.help), ""]
    records = [r for p in cmd.params if not p.hidden and (r := p.get_help_record(ctx))]
    if records:
        lines += ["| argument or option | help |", "|---|---|"]
        lines += [f"| `{name}` | {text.replace('|', chr(92) + '|')} |" for name, text in records]
        lines.append("")
    return "\n".join(lines)


def cli_reference() -> str:
    found = commands()
    index = [f"- [{path}](#{_slug(path)})" for path, _, _ in found]
    sections = [_section(path, cmd, ctx) for path, cmd, ctx in found]
    return INTRO + "\n" + "\n".join(index) + "\n\n" + "\n".join(sections)


def references() -> dict[Path, str]:
    """Each generated page's path -> its text as the code makes it now."""
    from gyre.coordinator.configdoc import config_reference

    return {REFERENCE / "cli.md": cli_reference(), REFERENCE / "config.md": config_reference()}


if __name__ == "__main__":
    REFERENCE.mkdir(parents=True, exist_ok=True)
    for path, text in references().items():
        path.write_text(text)
        print(f"wrote {path.relative_to(ROOT)}")
