"""harnesses.py: harness presets as data: what to run for one execution, and how.

A preset names the command (argv with `{placeholders}`), extra environment variables, the
API flavour the harness speaks, the role rule its calls are classified with, and its
timeouts. Built in: `demo` (gyre's own multi-turn agent), `claude-code` (the real Claude
Code CLI, non-interactive, all non-essential traffic off) and `openai-compatible` (any CLI
that takes an OpenAI base URL and key: give it a command). Users add or override presets
in the run config under `[harnesses.NAME]`; a preset may `extends` another and change only
some fields. Not the launcher: launcher.py runs what `expand()` returns.

Placeholders, in the command and in env values:

    {task}             the task prompt            {workspace}   the execution's workspace
    {execution}        the execution id           {state}       a per-execution folder for
    {model}            the model name to send                   the harness's own state
    {base_url}         the proxy (Anthropic base) {openai_base_url}  the proxy's /v1
    {api_key}          the execution's key (prefer the env variables: argv shows in ps)
"""

from __future__ import annotations

import os
import shutil
import string
import sys
from dataclasses import dataclass, field, fields, replace
from typing import Any, Mapping

APIS = ("openai", "anthropic", "responses", "any")
PLACEHOLDERS = ("task", "workspace", "execution", "state", "model", "base_url", "openai_base_url", "api_key")


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

    def check(self) -> None:
        """Raise HarnessError naming what is wrong in the preset itself (whether its
        executable is installed is `executable()`, asked where the harness will run)."""
        where = f"harness preset {self.name!r}"
        if not self.command:
            raise HarnessError(f"{where}: `command` is empty (give the harness's argv, e.g. "
                               f"[\"my-agent\", \"--task\", \"{{task}}\"])")
        if self.api not in APIS:
            raise HarnessError(f"{where}: api must be one of {', '.join(APIS)}, got {self.api!r}")
        from gyre.proxy.roles import RULES

        if self.role_rule not in RULES:
            raise HarnessError(f"{where}: role_rule must be one of {', '.join(RULES)}, got {self.role_rule!r}")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise HarnessError(f"{where}: timeout_s must be > 0, got {self.timeout_s}")
        for text in (*self.command, *self.env.values()):
            for _, name, _, _ in string.Formatter().parse(text):
                if name is not None and name not in PLACEHOLDERS:
                    raise HarnessError(f"{where}: unknown placeholder {{{name}}} in {text!r} "
                                       f"(known: {', '.join(PLACEHOLDERS)})")

    def executable(self) -> str | None:
        """The command's executable, resolved on PATH (or, given as a path, existing and
        executable); None when it is not installed."""
        exe = self.command[0]
        if "{" in exe:  # a placeholder (e.g. {workspace}/run.sh): known only at launch
            return exe
        if "/" in exe:
            return exe if os.path.isfile(exe) and os.access(exe, os.X_OK) else None
        return shutil.which(exe)

    def expand(self, **values: str) -> tuple[list[str], dict[str, str]]:
        """argv and extra env with the placeholders filled in."""
        values = {"model": self.model, **values}
        argv = [arg.format_map(values) for arg in self.command]
        env = {k: v.format_map(values) for k, v in self.env.items()}
        return argv, env


def _demo() -> HarnessPreset:
    return HarnessPreset(
        name="demo", api="openai", role_rule="generic",
        # No --max-tokens: the run's default_max_tokens applies (the tiny model's gyre.json says 16;
        # a real model may write a whole tool call).
        command=(sys.executable, "-m", "gyre.proxy.demo_harness", "--max-turns", "1",
                 "--compact-at", "100000", "--max-retries", "2", "--timeout", "120"))


# Seen to keep Claude Code off every outside host (HARNESS-NOTES.md).
CLAUDE_CODE_ENV = {
    "IS_SANDBOX": "1",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "ANTHROPIC_MODEL": "{model}",  # else a claude-* name whose context window varies between processes
    "CLAUDE_CONFIG_DIR": "{state}/claude",  # sessions and settings per execution, not in the user's ~/.claude
}


def _claude_code() -> HarnessPreset:
    return HarnessPreset(
        name="claude-code", api="anthropic", role_rule="claude-code", env=CLAUDE_CODE_ENV,
        command=("claude", "-p", "{task}", "--dangerously-skip-permissions", "--output-format", "json"),
        install="npm install -g @anthropic-ai/claude-code (or set [harnesses.claude-code] command = "
                "[\"/path/to/claude\", ...] in the run config)")


def _openai_compatible() -> HarnessPreset:
    return HarnessPreset(
        name="openai-compatible", api="openai", role_rule="generic", command=(),
        env={"OPENAI_API_BASE": "{openai_base_url}"},  # litellm's name; OPENAI_BASE_URL is always set
        install="any CLI that reads OPENAI_BASE_URL / OPENAI_API_KEY (or takes them as flags): set "
                "[harnesses.openai-compatible] command = [\"my-agent\", \"--task\", \"{task}\"]")


BUILTIN = {"demo": _demo, "claude-code": _claude_code, "openai-compatible": _openai_compatible}


def _from_table(name: str, table: Mapping[str, Any], base: HarnessPreset | None) -> HarnessPreset:
    known = {f.name for f in fields(HarnessPreset)} - {"name"}
    unknown = sorted(set(table) - known - {"extends"})
    if unknown:
        raise HarnessError(f"harness preset {name!r}: unknown field(s) {', '.join(unknown)} "
                           f"(known: extends, {', '.join(sorted(known))})")
    values: dict[str, Any] = {k: v for k, v in table.items() if k != "extends"}
    if "command" in values:
        cmd = values["command"]
        if isinstance(cmd, str) or not all(isinstance(a, str) for a in cmd):
            raise HarnessError(f"harness preset {name!r}: command must be a list of strings, got {cmd!r}")
        values["command"] = tuple(cmd)
    if "env" in values:
        env = values["env"]
        if not isinstance(env, Mapping) or not all(isinstance(v, str) for v in env.values()):
            raise HarnessError(f"harness preset {name!r}: env must be a table of strings, got {env!r}")
        values["env"] = {**(base.env if base else {}), **env}
    if base is None:
        return HarnessPreset(name=name, command=values.pop("command", ()), **values)
    return replace(base, name=name, **values)


def resolve(harness: str | tuple[str, ...] | list[str], user: Mapping[str, Mapping[str, Any]] | None = None,
            ) -> HarnessPreset:
    """The preset `harness` names (user presets first), or an ad-hoc preset for an argv."""
    user = user or {}
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
            base = resolve(parent, {k: v for k, v in user.items() if k != harness}) if parent else None
        preset = _from_table(harness, table, base)
    elif harness in BUILTIN:
        preset = BUILTIN[harness]()
    else:
        known = sorted({*BUILTIN, *user})
        raise HarnessError(f"unknown harness {harness!r} (presets: {', '.join(known)}; or give a command list)")
    preset.check()
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
