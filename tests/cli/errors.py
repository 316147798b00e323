"""What a refused command prints, checked the same way by every CLI test."""

from __future__ import annotations


def one_line_error(r) -> str:
    """The one `[error] ...` line a command refused with (exit status 1, nothing else printed)."""
    assert r.exit_code == 1, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("[error] "), r.output
    return lines[0]
