"""The real Claude Code CLI for harness tests, and a proxy with the scripted responder.

Claude Code comes from $GYRE_CLAUDE_BIN, else `claude` on PATH, else the tests install the
pinned npm package into a temporary prefix. Where npm is not installed they skip, saying
so; where npm is installed but the install fails they fail (set GYRE_SKIP_CLAUDE_CODE=1 to
skip on purpose).
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from gyre.proxy.server import ProxyConfig
from tests.scripted import ScriptedEngine
from tests.support import FaultyProxyServer, ThreadEngineBackend

CLAUDE_CODE_VERSION = "2.1.197"  # the version HARNESS-NOTES.md describes
PACKAGE = f"@anthropic-ai/claude-code@{CLAUDE_CODE_VERSION}"
CODEX_PACKAGE = "@openai/codex@0.171.0"


def _works(path: Path | str) -> bool:
    try:
        r = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=60)
    except OSError:
        return False
    return r.returncode == 0 and "Claude Code" in r.stdout


def _from_npm(prefix: Path) -> Path:
    r = subprocess.run(["npm", "install", "--prefix", str(prefix), "--no-fund", "--no-audit", "--loglevel=error",
                        PACKAGE], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        pytest.fail(f"npm install {PACKAGE} failed (set GYRE_SKIP_CLAUDE_CODE=1 to skip):\n{r.stderr[-2000:]}")
    # npm 11 does not run the package's postinstall (which copies the native binary over
    # bin/claude.exe) unless allowed: take the platform package's binary directly.
    arch = {"x86_64": "x64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine(), platform.machine())
    candidates = sorted((prefix / "node_modules" / "@anthropic-ai").glob(f"claude-code-linux-{arch}*/claude"))
    candidates.append(prefix / "node_modules" / ".bin" / "claude")
    for c in candidates:
        if _works(c):
            return c
    pytest.fail(f"installed {PACKAGE} but found no working claude binary among {[str(c) for c in candidates]}")


@pytest.fixture(scope="session")
def claude_bin(tmp_path_factory) -> Path:
    if os.environ.get("GYRE_SKIP_CLAUDE_CODE") == "1":
        pytest.skip("GYRE_SKIP_CLAUDE_CODE=1")
    given = os.environ.get("GYRE_CLAUDE_BIN") or shutil.which("claude")
    if given and _works(given):
        return Path(given)
    if shutil.which("npm") is None:
        pytest.skip(f"npm is not installed: the Claude Code tests need `npm install {PACKAGE}` "
                    "(or GYRE_CLAUDE_BIN pointing at a claude binary)")
    return _from_npm(tmp_path_factory.mktemp("claude-code"))


def _codex_works(path: Path | str) -> bool:
    try:
        r = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=60)
    except OSError:
        return False
    return r.returncode == 0 and r.stdout.strip() == "codex-cli 0.171.0"


@pytest.fixture(scope="session")
def codex_bin(tmp_path_factory) -> Path:
    """The real Codex CLI, pinned: $GYRE_CODEX_BIN, `codex` on PATH at that version, else
    `npm install @openai/codex@0.171.0` into a temporary prefix (its native binary comes in
    the platform package, an optional dependency)."""
    if os.environ.get("GYRE_SKIP_CODEX") == "1":
        pytest.skip("GYRE_SKIP_CODEX=1")
    given = os.environ.get("GYRE_CODEX_BIN") or shutil.which("codex")
    if given and _codex_works(given):
        return Path(given)
    if shutil.which("npm") is None:
        pytest.skip(f"npm is not installed: the Codex tests need `npm install {CODEX_PACKAGE}` "
                    "(or GYRE_CODEX_BIN pointing at a codex binary)")
    prefix = tmp_path_factory.mktemp("codex")
    r = subprocess.run(["npm", "install", "--prefix", str(prefix), "--no-fund", "--no-audit", "--loglevel=error",
                        CODEX_PACKAGE], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        pytest.fail(f"npm install {CODEX_PACKAGE} failed (set GYRE_SKIP_CODEX=1 to skip):\n{r.stderr[-2000:]}")
    arch = {"x86_64": "x64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine(), platform.machine())
    candidates = sorted((prefix / "node_modules" / "@openai").glob(f"codex-linux-{arch}/vendor/*/bin/codex"))
    candidates.append(prefix / "node_modules" / ".bin" / "codex")
    for c in candidates:
        if _codex_works(c):
            return c
    pytest.fail(f"installed {CODEX_PACKAGE} but found no working codex binary among {[str(c) for c in candidates]}")


@pytest.fixture
async def cc_proxy(chat_tokenizer, tmp_path):
    """A live proxy with the scripted responder (errors injectable); Claude Code's prompts are ~80k byte tokens."""
    engine = ScriptedEngine(chat_tokenizer, tokens_per_step=16)
    backend = ThreadEngineBackend(engine, sampling_cls=lambda **kw: kw)
    server = FaultyProxyServer(chat_tokenizer, backend, ProxyConfig(max_context=1 << 21, record_requests=True,
                                                                    ping_interval_s=0.5), run_dir=tmp_path / "run")
    await server.start()
    yield server, engine
    await server.stop()
    backend.close()
