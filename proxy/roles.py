"""roles.py: which role each model call plays in its execution, by a pluggable rule.

A leaf of the trajectory tree takes the role of the call whose output (or prompt) ends
there. Roles in training priority order: main, main-summary, sub-agent, sub-agent-summary;
`side` calls (title generation and the like) are recorded and never trained. Not
admission: admission.py reads the roles this module assigns.
"""

from __future__ import annotations

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


class RoleRule(Protocol):
    name: str

    def classify(self, call: CallInfo) -> str: ...


def is_summary_request(text: str) -> bool:
    return bool(_SUMMARY.search(text[-4000:]))


class GenericRule:
    """First root = main; other roots = sub-agents; a call whose new content asks for a
    summary of the conversation = summary; a tool-less call on a new root of an execution
    whose main agent has tools = side."""

    name = "generic"

    def classify(self, call: CallInfo) -> str:
        if is_summary_request(call.last_user):
            return "main-summary" if call.root == 0 else "sub-agent-summary"
        if call.root == 0:
            return "main"
        if not call.has_tools and call.first_root_has_tools:
            return "side"
        return "sub-agent"


RULES: dict[str, type] = {"generic": GenericRule}


def rule(name: str) -> RoleRule:
    try:
        return RULES[name]()
    except KeyError:
        raise ValueError(f"unknown role rule {name!r} (known: {', '.join(RULES)})") from None
