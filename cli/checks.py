"""checks.py: what `gyre doctor`'s checks are made of: a Check (ok / warn / fail, the
detail, the fix), the bounded probe of a command, a check that cannot crash the doctor,
and the free-disk check both the installation and a run directory make.

A leaf: it imports no other cli/ module; doctor.py (the installation) and runchecks.py
(a run directory) both build on it. Not any check of its own beyond free disk.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

OK, WARN, FAIL = "ok", "warn", "fail"
PROBE_S = 3.0  # a `--version` style probe that takes longer is reported, not waited for
GIB = 1 << 30
# A SmolLM2-135M checkpoint (float32 weights and Adam moments) is about 1.6 GB; records grow per call.
DISK_WARN, DISK_FAIL = 5 * GIB, 1 * GIB


@dataclass(frozen=True, slots=True)
class Check:
    check: str
    status: str  # OK | WARN | FAIL
    detail: str
    fix: str = ""

    def line(self) -> str:
        return f"{self.status:<6}{self.check}: {self.detail}" + (f" — {self.fix}" if self.fix else "")


def guarded(fn, *args) -> list[Check]:
    """`fn`'s checks; a check that raises is itself one warn line (a doctor reports, it never crashes)."""
    try:
        got = fn(*args)
    except Exception as e:  # noqa: BLE001 - any bug in a probe, reported as a line
        name = fn.__name__.strip("_").replace("_", " ")
        return [Check(name, WARN, f"the check itself failed: {type(e).__name__}: {e}", "report this line")]
    return got if isinstance(got, list) else [got]


def probe(argv: list[str], timeout: float = PROBE_S) -> str | None:
    """`argv`'s stdout, None when it cannot run, fails or outlasts `timeout`."""
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return p.stdout if p.returncode == 0 else None


def split_fix(message: str) -> tuple[str, str]:
    """A one-line gyre error "what is wrong; the fix" as (what, fix)."""
    what, _, fix = message.partition("; ")
    return what, fix


def free_disk(name: str, path: Path, fix: str) -> Check:
    at = path
    while not at.exists() and at != at.parent:  # a cache not made yet: the filesystem it will be on
        at = at.parent
    free = shutil.disk_usage(at).free
    status = FAIL if free < DISK_FAIL else WARN if free < DISK_WARN else OK
    return Check(name, status, f"{free / GIB:.1f} GiB free at {path}", fix if status != OK else "")
