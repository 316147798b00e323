"""harnesses.py: harness presets as data: what to run for one execution, and how.

A preset names the command (argv with `{placeholders}`), extra environment variables, the
API flavour the harness speaks, the role rule its calls are classified with, and its
timeouts, and config files it needs written into its per-execution state folder. Built in:
`demo` (gyre's own multi-turn agent), `claude-code` (the real Claude Code CLI,
non-interactive, all non-essential traffic off), `codex` (the real Codex CLI, `codex exec`,
its own CODEX_HOME with a config.toml naming the proxy as its provider) and
`openai-compatible` (any CLI that takes an OpenAI base URL and key: give it a command).
Users add or override presets in the run config under `[harnesses.NAME]`; a preset may
`extends` another (built-in or user) and change only some fields. Every execution gets its
own state folder, and the XDG config/data/cache/state homes inside it, so CLIs never share
the user's. In a container a preset runs its `sandbox_command` when it gives one (with
`sandbox_pip` installed by gyre into a folder mounted read-only at /opt/gyre/agent:
sandbox/agentdir.py), else its host executable mounted read-only; a preset with a
`sandbox_command` and no `command` runs only in a container. Not the launcher: launcher.py
runs what `expand()` returns.

Placeholders, in the command, env values and files:

    {task}             the task prompt            {workspace}   the execution's workspace
    {execution}        the execution id           {state}       a per-execution folder for
    {model}            the model name to send                   the harness's own state
    {base_url}         the proxy (Anthropic base) {openai_base_url}  the proxy's /v1
    {api_key}          the execution's key (prefer the env variables: argv shows in ps)
    {timeout_ms}       the execution's deadline   {idle_timeout_ms}  the preset's stream idle
                       in milliseconds                               timeout in milliseconds
    {python}           the Python running gyre (a harness written in Python, on this host;
                       in a container, the image's own python3)
"""

from __future__ import annotations

import os
import re
import shutil
import string
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

APIS = ("openai", "anthropic", "responses", "any")
PLACEHOLDERS = ("task", "workspace", "execution", "state", "model", "base_url", "openai_base_url", "api_key",
                "timeout_ms", "idle_timeout_ms", "python")


class HarnessError(ValueError):
    """A preset that cannot be used; the message names the preset and the field."""


@dataclass(frozen=True, slots=True, kw_only=True)
class HarnessPreset:
    name: str
    command: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    api: str = "any"  # the API flavour it speaks (documentation and checks; every API is served)
    role_rule: str = "generic"
    timeout_s: float | None = None  # per-execution deadline; None: the run's execution_timeout_s
    grace_s: float = 5.0  # SIGTERM -> SIGKILL at the deadline
    model: str = "gyre-policy"  # the model name the harness is told to send
    install: str = ""  # how to install the command, shown when it is missing
    files: Mapping[str, str] = field(default_factory=dict)  # path under {state} -> contents, written at launch
    idle_timeout_s: float = 300.0  # how long a harness may wait on a silent stream ({idle_timeout_ms})
    # In a container sandbox: the argv there (empty: `command`, its executable mounted read-only
    # at /opt/gyre/bin/NAME) and host paths mounted read-only (host path -> path inside).
    sandbox_command: tuple[str, ...] = ()
    mounts: Mapping[str, str] = field(default_factory=dict)
    # pip requirements gyre installs for the image's Python (sandbox_python) into a folder it
    # mounts read-only at /opt/gyre/agent; their console scripts run as /opt/gyre/agent/bin/NAME.
    sandbox_pip: tuple[str, ...] = ()
    sandbox_python: str = "3.11"  # the image's python3 (gyre's base image: bookworm's 3.11)

    @property
    def container_only(self) -> bool:
        """No host command: it runs only in a container sandbox, as its sandbox_command."""
        return not self.command and bool(self.sandbox_command)

    def check(self) -> None:
        """Raise HarnessError naming what is wrong in the preset itself (whether its
        executable is installed is `executable()`, asked where the harness will run)."""
        where = f"harness preset {self.name!r}"
        if not self.command and not self.sandbox_command:
            raise HarnessError(f"{where}: `command` is empty (give the harness's argv, e.g. "
                               f"[\"my-agent\", \"--task\", \"{{task}}\"], or sandbox_command for a container)")
        self._check_sandbox_fields(where)
        if self.api not in APIS:
            raise HarnessError(f"{where}: api must be one of {', '.join(APIS)}, got {self.api!r}")
        from gyre.proxy.roles import RULES

        if self.role_rule not in RULES:
            raise HarnessError(f"{where}: role_rule must be one of {', '.join(RULES)}, got {self.role_rule!r}")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise HarnessError(f"{where}: timeout_s must be > 0, got {self.timeout_s}")
        for path in self.files:
            if path.startswith("/") or ".." in path.split("/"):
                raise HarnessError(f"{where}: file {path!r} must be a path inside the state folder")
        for text in (*self.command, *self.sandbox_command, *self.env.values(), *self.files.values()):
            for _, name, _, _ in string.Formatter().parse(text):
                if name is not None and name not in PLACEHOLDERS:
                    raise HarnessError(f"{where}: unknown placeholder {{{name}}} in {text!r} "
                                       f"(known: {', '.join(PLACEHOLDERS)})")

    def _check_sandbox_fields(self, where: str) -> None:
        for host, inside in self.mounts.items():
            if not host.startswith("/") or not inside.startswith("/") or inside.rstrip("/") == "":
                raise HarnessError(f"{where}: mounts maps an absolute host path to an absolute path inside the "
                                   f"container, got {host!r} = {inside!r}")
        if not self.sandbox_pip:
            return
        from gyre.coordinator.sandbox.agentdir import AGENT_INSIDE

        if not self.sandbox_command:
            raise HarnessError(f"{where}: sandbox_pip needs sandbox_command, the argv in the container (e.g. "
                               f"[\"{AGENT_INSIDE}/bin/my-agent\", \"{{task}}\"])")
        for req in self.sandbox_pip:
            if not isinstance(req, str) or not req.strip() or req.lstrip().startswith("-"):
                raise HarnessError(f"{where}: sandbox_pip takes requirement specifiers (e.g. "
                                   f"\"mini-swe-agent==2.4.6\"), not pip options, got {req!r}")
        if not re.fullmatch(r"3\.\d{1,2}", self.sandbox_python):
            raise HarnessError(f"{where}: sandbox_python is the image's Python as MAJOR.MINOR (e.g. \"3.11\"), "
                               f"got {self.sandbox_python!r}")
        if any(inside.rstrip("/") == AGENT_INSIDE or inside.startswith(AGENT_INSIDE + "/")
               for inside in self.mounts.values()):
            raise HarnessError(f"{where}: a mount inside {AGENT_INSIDE}, where sandbox_pip's folder goes")

    def missing(self, *, contained: bool) -> str | None:
        """Why this preset cannot run here, as one line naming it and the fix; None when it
        can. `contained`: the sandbox runs images (podman, docker), where a sandbox_command
        runs instead of `command` and is checked in the image at launch, not on this host."""
        where = f"harness preset {self.name!r}"
        if contained and self.sandbox_command:
            return None
        if self.container_only:
            return (f"{where} runs only in a container (it gives sandbox_command and no command): use --sandbox "
                    "podman or docker (sandbox = \"podman\" in the run config)")
        exe = self.executable()
        if exe is None:
            hint = f"; install: {self.install}" if self.install else ""
            return f"{where}: {self.command[0]!r} is not on PATH{hint}"
        if contained and "{" not in exe:  # mounted into the container: a node launcher needs its native binary
            try:
                npm_native(os.path.realpath(exe), self.name)
            except HarnessError as e:
                return str(e)
        return None

    def executable(self) -> str | None:
        """The command's executable, resolved on PATH (or, given as a path, existing and
        executable); None when it is not installed. A container-only preset's is its
        sandbox_command's, checked in the image at launch (`missing` says where it can run)."""
        if self.container_only:
            return self.sandbox_command[0]
        exe = self.command[0]
        if "{" in exe:  # a placeholder (e.g. {workspace}/run.sh): known only at launch
            return exe
        if "/" in exe:
            return exe if os.path.isfile(exe) and os.access(exe, os.X_OK) else None
        return shutil.which(exe)

    def in_sandbox(self, agent: str | None = None) -> tuple[HarnessPreset, dict[str, str]]:
        """This preset as it runs inside a container, and the read-only mounts it needs
        there; `agent`: the host folder sandbox_pip was installed into. HarnessError when its
        executable is not on this host to mount."""
        mounts = dict(self.mounts)
        if self.sandbox_pip:
            from gyre.coordinator.sandbox.agentdir import AGENT_INSIDE

            if agent is None:
                raise HarnessError(f"harness preset {self.name!r}: its sandbox_pip folder was not installed")
            mounts[agent] = AGENT_INSIDE
        if self.sandbox_command:
            return replace(self, command=self.sandbox_command), mounts
        exe = self.executable()
        if exe is None or "{" in exe:
            raise HarnessError(f"harness preset {self.name!r}: {self.command[0]!r} is not on this host to mount "
                               "into the sandbox; set sandbox_command (the argv in the image) and install it there "
                               "or with sandbox_pip")
        real = npm_native(os.path.realpath(exe), self.name)
        inside = f"/opt/gyre/bin/{os.path.basename(exe)}"
        mounts[real] = inside
        return replace(self, command=(inside, *self.command[1:])), mounts

    def expand(self, **values: str) -> tuple[list[str], dict[str, str], dict[str, str]]:
        """argv, extra env and the state folder's files with the placeholders filled in."""
        values = {"model": self.model, "idle_timeout_ms": str(int(self.idle_timeout_s * 1000)),
                  "python": sys.executable, **values}
        argv = [arg.format_map(values) for arg in self.command]
        env = {k: v.format_map(values) for k, v in self.env.items()}
        files = {path: text.format_map(values) for path, text in self.files.items()}
        return argv, env, files


NPM_ARCH = {"x86_64": "x64", "amd64": "x64", "aarch64": "arm64", "arm64": "arm64"}


def npm_native(path: str, preset: str) -> str:
    """The file to mount for the executable at `path` (resolved): itself, unless it is an npm
    package's node launcher (`npm install -g @openai/codex` puts `codex` -> `bin/codex.js` on
    PATH), which a container without node cannot run. Then the native binary of the same name
    that the package's platform package ships (`@openai/codex-linux-x64/vendor/*/bin/codex`,
    `@anthropic-ai/claude-code-linux-x64/claude`), found beside it in node_modules; HarnessError,
    naming the fix, when there is none."""
    try:
        with open(path, "rb") as f:
            head = f.read(128)
    except OSError:
        return path
    if head.startswith(b"\x7fELF") or not (head.startswith(b"#!") and b"node" in head.split(b"\n", 1)[0]):
        return path
    parts = Path(path).parts
    name = Path(path).name
    for suffix in (".js", ".cjs", ".mjs", ".exe"):
        name = name.removesuffix(suffix)
    if "node_modules" in parts:
        modules = Path(*parts[:len(parts) - parts[::-1].index("node_modules")])
        rest = parts[len(modules.parts):]
        package = "/".join(rest[:2]) if rest and rest[0].startswith("@") else rest[0] if rest else ""
        arch = NPM_ARCH.get(os.uname().machine.lower(), os.uname().machine.lower())
        for folder in sorted(modules.glob(f"{package}-linux-{arch}*")) if package else []:
            for candidate in sorted(folder.rglob(name)):
                if candidate.is_file() and os.access(candidate, os.X_OK) and _is_elf(candidate):
                    return str(candidate)
    raise HarnessError(f"harness preset {preset!r}: {path} is a node script, which a container without node cannot "
                       "run, and no native binary of it was found beside it in node_modules; point command at the "
                       "native binary, or set sandbox_command to an argv the image can run")


def _is_elf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"\x7fELF"


def _demo() -> HarnessPreset:
    return HarnessPreset(
        name="demo", api="openai", role_rule="generic",
        # No --max-tokens: the run's default_max_tokens applies (the tiny model's gyre.json says 16;
        # a real model may write a whole tool call).
        command=(sys.executable, "-m", "gyre.coordinator.demo_harness", *DEMO_ARGS),
        # In a container: the image's python3 with the openai package (gyre's base image has
        # both) runs the harness file, mounted read-only (it imports nothing from gyre).
        sandbox_command=("python3", "/opt/gyre/demo_harness.py", *DEMO_ARGS),
        mounts={str(Path(__file__).resolve().with_name("demo_harness.py")): "/opt/gyre/demo_harness.py"})


# Every preset's retries outlast a coordinator's restart (issue 34: its executions are adopted by
# `gyre up --resume`, their cut calls retried): about 100-130 s of a proxy that refuses connections.
# The openai SDK sleeps min(0.5 * 2^i, 8) s less up to 25% before retry i: 20 retries, 102-136 s.
DEMO_ARGS = ("--max-turns", "1", "--compact-at", "100000", "--max-retries", "20", "--timeout", "120")


# Seen to keep Claude Code off every outside host (HARNESS-NOTES.md).
CLAUDE_CODE_ENV = {
    "IS_SANDBOX": "1",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "ANTHROPIC_MODEL": "{model}",  # else a claude-* name whose context window varies between processes
    "CLAUDE_CONFIG_DIR": "{state}/claude",  # sessions and settings per execution, not in the user's ~/.claude
    # Its stream watchdog drops a stream after max(this, 300 s) without content, pings or not,
    # and re-sends the request: no sooner than the execution's own deadline.
    "CLAUDE_STREAM_IDLE_TIMEOUT_MS": "{timeout_ms}",
    # Tries 1 + this (default 10, at most 15), sleeping min(0.5 * 2^(k-1), 32) s plus up to 25%
    # between them (2.1.197's bundle): 8 retries, 96-119 s, outlast a coordinator's restart.
    "CLAUDE_CODE_MAX_RETRIES": "8",
}


def _claude_code() -> HarnessPreset:
    return HarnessPreset(
        name="claude-code", api="anthropic", role_rule="claude-code", env=CLAUDE_CODE_ENV,
        command=("claude", "-p", "{task}", "--dangerously-skip-permissions", "--output-format", "json"),
        install="npm install -g @anthropic-ai/claude-code (or set [harnesses.claude-code] command = "
                "[\"/path/to/claude\", ...] in the run config)")


CODEX_VERSION = "0.171.0"  # the version HARNESS-NOTES.md and the tests describe

# Codex reaches a custom endpoint only through a provider in $CODEX_HOME/config.toml. The model
# name is a slug Codex knows (its bundled metadata then sends the full tool set: apply_patch,
# tool_search); the proxy serves any name. Web search (run by a provider, not the client),
# analytics and plugin fetches (github.com, chatgpt.com) are off: it talks only to the proxy.
CODEX_CONFIG = """model = "{model}"
model_provider = "gyre"
approval_policy = "never"
sandbox_mode = "danger-full-access"
web_search = "disabled"
check_for_update_on_startup = false

[analytics]
enabled = false

[features]
plugins = false
# On (its default), a refused connection is retried forever, 5 s to 60 s apart: the first call
# after a coordinator's restart could wait a minute. Off, the retries below bound it: about
# 0.2 * (2^6 - 1) s per request, 7 requests, 91-111 s (measured 103 s), outlasting a restart.
unbounded_connection_retries = false

[model_providers.gyre]
name = "gyre"
base_url = "{openai_base_url}"
wire_api = "responses"
env_key = "OPENAI_API_KEY"
request_max_retries = 6
stream_max_retries = 6
stream_idle_timeout_ms = {idle_timeout_ms}
"""


def _codex() -> HarnessPreset:
    return HarnessPreset(
        name="codex", api="responses", role_rule="codex", model="gpt-5.5",
        command=("codex", "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
                 "-C", "{workspace}", "{task}"),
        env={"CODEX_HOME": "{state}/codex"}, files={"codex/config.toml": CODEX_CONFIG},
        install=f"npm install -g @openai/codex@{CODEX_VERSION} (or set [harnesses.codex] command = "
                "[\"/path/to/codex\", ...] in the run config)")


def _openai_compatible() -> HarnessPreset:
    return HarnessPreset(
        name="openai-compatible", api="openai", role_rule="generic", command=(),
        env={"OPENAI_API_BASE": "{openai_base_url}"},  # litellm's name; OPENAI_BASE_URL is always set
        install="any CLI that reads OPENAI_BASE_URL / OPENAI_API_KEY (or takes them as flags): set "
                "[harnesses.openai-compatible] command = [\"my-agent\", \"--task\", \"{task}\"]")


BUILTIN = {"demo": _demo, "claude-code": _claude_code, "codex": _codex, "openai-compatible": _openai_compatible}


def _from_table(name: str, table: Mapping[str, Any], base: HarnessPreset | None) -> HarnessPreset:
    known = {f.name for f in fields(HarnessPreset)} - {"name"}
    unknown = sorted(set(table) - known - {"extends"})
    if unknown:
        raise HarnessError(f"harness preset {name!r}: unknown field(s) {', '.join(unknown)} "
                           f"(known: extends, {', '.join(sorted(known))})")
    values: dict[str, Any] = {k: v for k, v in table.items() if k != "extends"}
    if "idle_timeout_s" in values and not isinstance(values["idle_timeout_s"], (int, float)):
        raise HarnessError(f"harness preset {name!r}: idle_timeout_s must be a number")
    for key in ("command", "sandbox_command", "sandbox_pip"):
        if key in values:
            cmd = values[key]
            if not isinstance(cmd, (list, tuple)) or not all(isinstance(a, str) for a in cmd):
                raise HarnessError(f"harness preset {name!r}: {key} must be a list of strings, got {cmd!r}")
            values[key] = tuple(cmd)
    for key in ("sandbox_python", "install"):
        if key in values and not isinstance(values[key], str):
            raise HarnessError(f"harness preset {name!r}: {key} must be a string, got {values[key]!r}")
    if base is not None and "install" not in values and base.install:  # its advice names the user's preset
        values["install"] = base.install.replace(f"[harnesses.{base.name}]", f"[harnesses.{name}]")
    for key in ("env", "files", "mounts"):  # tables merge with the parent's
        if key in values:
            table = values[key]
            if not isinstance(table, Mapping) or not all(isinstance(v, str) for v in table.values()):
                raise HarnessError(f"harness preset {name!r}: {key} must be a table of strings, got {table!r}")
            values[key] = {**(getattr(base, key) if base else {}), **table}
    if base is None:
        return HarnessPreset(name=name, command=values.pop("command", ()), **values)
    return replace(base, name=name, **values)


def resolve(harness: str | tuple[str, ...] | list[str], user: Mapping[str, Mapping[str, Any]] | None = None,
            ) -> HarnessPreset:
    """The preset `harness` names (user presets first), or an ad-hoc preset for an argv."""
    preset = _resolve(harness, user or {})
    preset.check()  # the finished preset: a parent may lack what its child gives (a command)
    return preset


def _resolve(harness: str | tuple[str, ...] | list[str], user: Mapping[str, Mapping[str, Any]]) -> HarnessPreset:
    if not isinstance(harness, str):
        preset = HarnessPreset(name="command", command=tuple(harness))
    elif harness in user:
        table = user[harness]
        parent = table.get("extends", harness if harness in BUILTIN else None)
        if parent is not None and parent not in BUILTIN and parent not in user:
            raise HarnessError(f"harness preset {harness!r}: extends unknown preset {parent!r}")
        if parent == harness:
            base = BUILTIN[harness]()
        else:
            base = _resolve(parent, {k: v for k, v in user.items() if k != harness}) if parent else None
        preset = _from_table(harness, table, base)
    elif harness in BUILTIN:
        preset = BUILTIN[harness]()
    else:
        known = sorted({*BUILTIN, *user})
        raise HarnessError(f"unknown harness {harness!r} (presets: {', '.join(known)}; or give a command list)")
    return preset


def presets(user: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, HarnessPreset | HarnessError]:
    """Every preset by name, or the error that makes it unusable (for `gyre harnesses`)."""
    out: dict[str, HarnessPreset | HarnessError] = {}
    for name in sorted({*BUILTIN, *(user or {})}):
        try:
            out[name] = resolve(name, user)
        except HarnessError as e:
            out[name] = e
    return out
