"""agentdir.py: a pip-installed agent CLI as a folder on the host, mounted read-only into containers.

A preset's `sandbox_pip` (requirement specifiers, e.g. ["mini-swe-agent==2.4.6"]) is installed
once with this host's pip for the image's Python (`--target`, wheels only, for `sandbox_python`
and manylinux up to glibc 2.36, gyre's bookworm base image's) into a folder under the cache
($GYRE_IMAGE_CACHE, else $GYRE_CACHE, else ~/.cache/gyre)/agents/, named by a hash of that
recipe: the same spec is installed once and reused, a changed one installs anew. The launcher
mounts it read-only at /opt/gyre/agent (the agent cannot change it); its console scripts are
rewritten into /opt/gyre/agent/bin/NAME, each run by the image's `python3` with the packages
put first on its own sys.path (nothing is added to the environment the agent's tools inherit)
and exiting 127 (cannot start: an infrastructure failure, never a zero) when the image's
Python is not the one installed for. Not the image: the task's image is used as it is.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from gyre.coordinator.sandbox.base import IN_SANDBOX_ROOT, ImageBuildError
from gyre.coordinator.sandbox.images import cache_dir

log = logging.getLogger("gyre.coordinator")

AGENT_INSIDE = f"{IN_SANDBOX_ROOT}/agent"  # where the folder is mounted in the container
GLIBC = (2, 36)  # the newest glibc whose wheels are taken: Debian bookworm's, gyre's base image
RECIPE = "v1"  # bump when the folder's layout or the wrappers change: every spec installs anew
INSTALL_TIMEOUT_S = 1800.0  # a pip that has not finished by then is killed
HEARTBEAT_S = 10.0  # at most one progress line this often while pip collects
_threads = threading.Lock()  # one install at a time in this process (flock orders the processes)


class AgentInstallError(ImageBuildError):
    """The agent folder cannot be made; the message names the preset and what pip said."""


def platforms(arch: str | None = None) -> list[str]:
    """The wheel platforms pip may take: every manylinux up to GLIBC, each named (given
    --platform, pip 25 takes exactly those: with only manylinux_2_36 and manylinux2014 named it
    refused tiktoken 0.12.0's one Linux wheel, tagged manylinux_2_28, and so aider-chat)."""
    arch = arch or platform.machine()
    return [*(f"manylinux_{GLIBC[0]}_{minor}_{arch}" for minor in range(GLIBC[1], 4, -1)),
            f"manylinux2014_{arch}", f"manylinux2010_{arch}", f"manylinux1_{arch}"]


def agent_key(packages: Sequence[str], python: str, arch: str | None = None) -> str:
    """The folder's name: a slug of the first package and a hash of everything that shapes it."""
    recipe = json.dumps({"pip": list(packages), "python": python, "platforms": platforms(arch), "recipe": RECIPE})
    slug = re.sub(r"[^a-z0-9_.-]+", "-", re.split(r"[<>=!~;\[ ]", packages[0], maxsplit=1)[0].lower()).strip("-.")
    return f"{slug[:40] or 'agent'}-{hashlib.sha256(recipe.encode()).hexdigest()[:16]}"


def agent_dir(preset: str, packages: Sequence[str], python: str) -> Path:
    """The installed folder for `packages` (made when missing, about a minute for a CLI with
    litellm's dependencies); AgentInstallError naming `preset` when pip fails. Blocks: call
    it on a thread from the event loop."""
    out = cache_dir() / "agents" / agent_key(packages, python)
    if (out / "gyre-agent.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with _threads, open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another gyre process may be installing the same spec
        if not (out / "gyre-agent.json").exists():
            shutil.rmtree(out, ignore_errors=True)  # what an install that died half-way left
            _install(preset, list(packages), python, out)
    return out


def _has_pip() -> bool:
    """Whether gyre's Python has pip, asked of its installed distributions: importlib's
    find_spec("pip") runs setuptools' distutils hook, which warns once distutils is imported."""
    try:
        importlib.metadata.distribution("pip")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _install(preset: str, packages: list[str], python: str, out: Path) -> None:
    where = f"harness preset {preset!r}"
    if not _has_pip():
        raise AgentInstallError(f"{where}: sandbox_pip needs pip in gyre's Python ({sys.executable} -m ensurepip)")
    log.info("%s: installing %s for Python %s into %s (once per spec; later runs reuse it)", where,
             " ".join(packages), python, out)
    start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        abi = "cp" + python.replace(".", "")
        argv = [sys.executable, "-m", "pip", "install", "--target", str(tmp / "lib"), "--only-binary=:all:",
                "--python-version", python, "--implementation", "cp", "--abi", abi,
                *(x for p in platforms() for x in ("--platform", p)), "--no-input", "--progress-bar", "off",
                "--disable-pip-version-check", "--", *packages]
        _pip(argv, where, packages, python, start)
        scripts = _wrap_scripts(tmp / "lib" / "bin", tmp / "bin", python)
        installed = dict(d.name.removesuffix(".dist-info").rsplit("-", 1)
                         for d in sorted((tmp / "lib").glob("*-*.dist-info")))
        size = sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file() and not p.is_symlink())
        (tmp / "gyre-agent.json").write_text(json.dumps(  # last: its presence marks a finished folder
            {"pip": packages, "python": python, "platforms": platforms(), "scripts": scripts,
             "installed": installed, "bytes": size}, indent=2))
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide it from a non-root user in the container
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    shown = ", ".join(scripts[:8]) + (f" and {len(scripts) - 8} more" if len(scripts) > 8 else "")
    log.info("%s: installed %d packages (%d MB) in %.0f s; scripts in %s/bin: %s", where, len(installed),
             size >> 20, time.monotonic() - start, AGENT_INSIDE, shown or "none")


def _pip(argv: list[str], where: str, packages: list[str], python: str, start: float) -> None:
    """pip to its end, one progress line per HEARTBEAT_S while it collects; AgentInstallError
    with pip's own error line when it fails or runs past INSTALL_TIMEOUT_S."""
    lines: list[str] = []
    said, collected = start, 0
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace")
    except OSError as e:
        raise AgentInstallError(f"{where}: pip could not start: {e}") from None
    expired = threading.Event()
    timer = threading.Timer(INSTALL_TIMEOUT_S, lambda: (expired.set(), proc.kill()))
    timer.start()
    try:
        with proc:
            for line in proc.stdout:
                line = line.rstrip()
                lines.append(line)
                del lines[:-50]
                if line.startswith("Collecting "):
                    collected += 1
                    now = time.monotonic()
                    if now - said >= HEARTBEAT_S:
                        said = now
                        log.info("%s: pip: %s (%.0f s, %d packages so far)", where, line[:120], now - start,
                                 collected)
                elif line.startswith("Installing collected packages"):
                    log.info("%s: pip: installing %d packages (%.0f s)", where, collected, time.monotonic() - start)
    finally:
        timer.cancel()
    if proc.returncode != 0:
        errors = [x for x in lines if x.startswith("ERROR:")]
        why = errors[-1][len("ERROR:"):].strip() if errors else " | ".join(x for x in lines[-5:] if x.strip())
        if expired.is_set():
            why = f"not done after {INSTALL_TIMEOUT_S:g} s"
        raise AgentInstallError(f"{where}: pip could not install {' '.join(packages)} for Python {python} "
                                f"(sandbox_pip): {why}")


def _wrap_scripts(src: Path, dest: Path, python: str) -> list[str]:
    """Each Python console script pip wrote (its shebang names this host's interpreter, which
    the container lacks) as a script for the image's python3 that finds the folder's packages
    itself and refuses another Python version with exit 127. Returns their names."""
    dest.mkdir(parents=True)
    names = []
    major, minor = python.split(".")
    for path in sorted(src.glob("*")) if src.is_dir() else []:
        if not path.is_file():  # pip compiles a package's .py scripts there: bin/__pycache__
            continue
        lines = path.read_text(errors="replace").splitlines(keepends=True)
        if not lines or not lines[0].startswith("#!"):
            continue
        if "python" in lines[0]:
            body = lines[1:]
        elif len(lines) > 2 and lines[1].startswith("'''exec'"):  # pip's form for a shebang too long for the kernel
            body = lines[3:]
        else:
            continue  # a shell script: nothing of ours
        why = (f"gyre: {AGENT_INSIDE} was installed for Python {python}; this image's python3 is %d.%d "
               "(set sandbox_python in the harness preset)\n")
        head = (
            "#!/usr/bin/env python3\n"
            "import sys\n"
            f"if sys.version_info[:2] != ({major}, {minor}):\n"
            f"    sys.stderr.write({why!r} % sys.version_info[:2])\n"
            "    sys.exit(127)\n"
            f"sys.path.insert(0, {AGENT_INSIDE + '/lib'!r})\n")
        (dest / path.name).write_text(head + "".join(body))
        (dest / path.name).chmod(0o755)
        names.append(path.name)
    return names
