"""diagnosis.py: what a step trained on, and why it trained little or nothing.

Group-relative advantages are zero in a group whose valid executions all scored alike, and a
group none of whose valid executions made a model call has nothing to train: such groups add
no token to the step. Behind them, the executions' model calls say what the model did: calls
cut at `max_tokens`, calls from which no tool call was parsed (or a malformed one), and the
executions' statuses (harness errors, verifier errors, timeouts). `diagnose` reads a step's
groups once (the step event, the step line and the live view show it); `why` says it in one
line, and `merge` adds steps up (the end of a run, `gyre doctor`). Pure reads: nothing here
changes what is trained.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from gyre.coordinator.packing import trainable

# Why a group added no token to its step (`zero_advantage_groups` in a `step` event).
SCORED_ALIKE = "scored_alike"  # every counted valid reward the same
NO_MODEL_CALLS = "no_model_calls"  # no counted valid execution made a model call
# Execution statuses that say a step's executions went wrong (`execution_statuses` has all).
ERROR_STATUSES = {"harness_error": "harness error", "evaluator_error": "verifier error",
                  "timed_out": "timed out", "aborted_infra": "aborted by infrastructure"}
COUNTS = ("calls", "calls_at_max_tokens", "calls_without_tool_call", "invalid_tool_calls")


def zero_advantage(group) -> str | None:
    """SCORED_ALIKE or NO_MODEL_CALLS when the group trains nothing, else None."""
    runs = trainable(group)
    if not runs:
        return NO_MODEL_CALLS
    return SCORED_ALIKE if all(adv == 0.0 for _, adv in runs) else None


def diagnose(groups) -> dict:
    """A step's groups: which trained nothing and why, the rewards the alike ones shared, and
    the model calls and statuses of the executions behind them (cancelled ones left out)."""
    reasons: Counter[str] = Counter()
    alike: set[float] = set()
    calls = Counter(dict.fromkeys(COUNTS, 0))
    statuses: Counter[str] = Counter()
    for g in groups:
        why = zero_advantage(g)
        if why is not None:
            reasons[why] += 1
        if why == SCORED_ALIKE:
            alike.update(round(r.reward, 6) for r, _ in trainable(g) if r.reward is not None)
        for run in g.runs:
            if run.status == "cancelled":
                continue
            statuses[run.status or "running"] += 1
            for c in run.recorder.calls if run.recorder is not None else ():
                if c.get("status") != "ok":
                    continue  # refused or failed: no output to judge
                calls["calls"] += 1
                calls["calls_at_max_tokens"] += c.get("finish_reason") == "length"
                calls["calls_without_tool_call"] += not c.get("tool_calls")
                calls["invalid_tool_calls"] += c.get("invalid_tool_calls") or 0
    return {"zero_advantage_groups": dict(reasons), "alike_rewards": sorted(alike), **calls,
            "execution_statuses": dict(statuses)}


def merge(diagnoses: Iterable[dict]) -> dict:
    """Steps' diagnoses added up (their `step` events, or StepReports' `diagnosis`)."""
    reasons: Counter[str] = Counter()
    statuses: Counter[str] = Counter()
    alike: set[float] = set()
    calls = Counter(dict.fromkeys(COUNTS, 0))
    for d in diagnoses:
        reasons.update(d.get("zero_advantage_groups") or {})
        statuses.update(d.get("execution_statuses") or {})
        alike.update(d.get("alike_rewards") or ())
        for k in COUNTS:
            calls[k] += d.get(k) or 0
    return {"zero_advantage_groups": dict(reasons), "alike_rewards": sorted(alike), **calls,
            "execution_statuses": dict(statuses)}


def why(d: dict, groups: int, *, calls: bool = True) -> str:
    """The diagnosis in one line: groups that trained nothing and why, then (with `calls`)
    what the model calls and executions behind them did ('' when there is nothing to say)."""
    parts = []
    reasons = d.get("zero_advantage_groups") or {}
    if n := reasons.get(SCORED_ALIKE, 0):
        rewards = d.get("alike_rewards") or []
        shared = (f", every reward {rewards[0]:.3f}" if len(rewards) == 1
                  else f", rewards {', '.join(f'{r:.3f}' for r in rewards[:4])}{'...' if len(rewards) > 4 else ''}"
                  if rewards else "")
        parts.append(f"{n} of {groups} groups scored alike (zero advantage{shared})")
    if n := reasons.get(NO_MODEL_CALLS, 0):
        parts.append(f"{n} of {groups} groups made no model call")
    if not calls:
        return "; ".join(parts)
    calls = d.get("calls") or 0
    said = []
    if calls:
        for key, words in (("calls_at_max_tokens", "ended at max_tokens"),
                           ("calls_without_tool_call", "parsed no tool call"),
                           ("invalid_tool_calls", "malformed tool calls")):
            if n := d.get(key) or 0:
                said.append(f"{n} {words}")
        if said:
            parts.append(f"of {calls} model calls {', '.join(said)}")
    statuses = d.get("execution_statuses") or {}
    errors = [f"{statuses[s]} {words}{'s' if statuses[s] > 1 and words.endswith('error') else ''}"
              for s, words in ERROR_STATUSES.items() if statuses.get(s)]
    if errors:
        parts.append(f"executions: {', '.join(errors)}")
    return "; ".join(parts)
