"""roles.py: which role each model call plays in its execution, by a pluggable rule.

A leaf of the trajectory tree takes the role of the call whose output (or prompt) ends
there. Roles in training priority order: main, main-summary, sub-agent, sub-agent-summary;
`side` calls (title generation and the like) are recorded and never trained. Not
admission: admission.py reads the roles this module assigns.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Protocol

PRIORITY = ("main", "main-summary", "sub-agent", "sub-agent-summary")
ROLES = (*PRIORITY, "side")

_SUMMARY = re.compile(
    r"(summar(y|ize|ise|ising|izing)|compact(ion)?)\b.{0,120}\b(conversation|session|history|context|so far)",
    re.IGNORECASE | re.DOTALL)


@dataclass(frozen=True, slots=True)
class CallInfo:
    """What a rule may look at for one call."""

    root: int  # index of the call's tree root, in creation order (0 = the first)
    model: str
    has_tools: bool
    last_user: str  # text of the request's last user message
    first_model: str  # model name of the execution's first call
    first_root_has_tools: bool
    headers: dict[str, str]
    system: str = ""  # the request's leading system text
    first_user: str = ""  # text of the request's first user message
    delegated_by: str | None = None  # call id whose delegation prompt opens this request


class RoleRule(Protocol):
    name: str
    delegation_tools: tuple[str, ...]  # tools whose `prompt` argument starts a sub-agent

    def classify(self, call: CallInfo) -> str: ...


def is_summary_request(text: str) -> bool:
    return bool(_SUMMARY.search(text[-4000:]))


class GenericRule:
    """First root = main; other roots = sub-agents; a call whose new content asks for a
    summary of the conversation = summary; a tool-less call on a new root of an execution
    whose main agent has tools = side."""

    name = "generic"
    delegation_tools: tuple[str, ...] = ()

    def classify(self, call: CallInfo) -> str:
        if is_summary_request(call.last_user):
            return "main-summary" if call.root == 0 else "sub-agent-summary"
        if call.root == 0:
            return "main"
        if not call.has_tools and call.first_root_has_tools:
            return "side"
        return "sub-agent"


# Claude Code's compaction instruction (2.1.x), appended to the last user message.
_CC_COMPACTION = ("Your task is to create a detailed summary of the conversation so far",
                  "CRITICAL: Respond with TEXT ONLY. Do NOT call any tools.")


class ClaudeCodeRule:
    """Claude Code (observed on 2.1.197, see HARNESS-NOTES.md):

    - sub-agent: the request carries `x-claude-code-agent-id`, its billing header says
      `cc_is_subagent=true`, or its first user message is the `prompt` of an Agent/Task
      tool call this execution made (delegation matching);
    - summary: the last user message is Claude Code's compaction instruction (or any
      summary request), for the main agent or a sub-agent by the same signals;
    - side: a tool-less call that is not a summary (title and other side requests);
    - main: everything else, including the new root a compaction or `--continue` starts
      ("This session is being continued...") and a changed system prompt.
    """

    name = "claude-code"
    delegation_tools: tuple[str, ...] = ("Agent", "Task")

    def classify(self, call: CallInfo) -> str:
        headers = {k.lower(): v for k, v in call.headers.items()}
        sub = ("x-claude-code-agent-id" in headers or "cc_is_subagent=true" in call.system[:500]
               or call.delegated_by is not None)
        tail = call.last_user[-20000:]
        if any(marker in tail for marker in _CC_COMPACTION) or is_summary_request(call.last_user):
            return "sub-agent-summary" if sub else "main-summary"
        if not call.has_tools:
            return "side"
        return "sub-agent" if sub else "main"


class CodexRule(GenericRule):
    """Codex CLI: as generic, and a compaction is what Codex says it is (its turn-metadata
    header carries `"request_kind": "compaction"`; the request has no tools and ends with its
    context-checkpoint instruction), for the main agent or a sub-agent's own root."""

    name = "codex"

    def classify(self, call: CallInfo) -> str:
        meta = next((v for k, v in call.headers.items() if k.lower() == "x-codex-turn-metadata"), "")
        try:
            kind = json.loads(meta).get("request_kind") if meta else None
        except (ValueError, AttributeError):
            kind = None
        if kind == "compaction" or "CONTEXT CHECKPOINT COMPACTION" in call.last_user[-4000:]:
            return "main-summary" if call.root == 0 else "sub-agent-summary"
        return super().classify(call)


RULES: dict[str, type] = {"generic": GenericRule, "claude-code": ClaudeCodeRule, "codex": CodexRule}


def delegation_prompt(rule: RoleRule, name: str, arguments: str) -> str | None:
    """The sub-agent prompt a tool call delegates, when `rule` counts it as a delegation."""
    if name not in rule.delegation_tools:
        return None
    try:
        args = json.loads(arguments)
    except ValueError:
        return None
    prompt = args.get("prompt") if isinstance(args, dict) else None
    return prompt.strip() if isinstance(prompt, str) and prompt.strip() else None


def rule(name: str) -> RoleRule:
    try:
        return RULES[name]()
    except KeyError:
        raise ValueError(f"unknown role rule {name!r} (known: {', '.join(RULES)})") from None
