"""transcript.py: `gyre inspect RUN_DIR --execution ID --transcript`: one execution's
conversation as its harness saw it, call by call (the messages new since an earlier call, the
model's answer and its finish reason, tokens), then what the harness and the verifier printed
and the outcome. Read from calls.jsonl's transcript keys (records.TRANSCRIPT_KEYS), nodes.jsonl,
harness.log, verifier.log and the run's outcome (inspect.outcome). A record from before those
keys shows its messages and output as unknown, never as empty. Not the tree (inspect.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from gyre.cli.inspect import json_file, no_execution, outcome, read_run_log
from gyre.proxy.records import load_execution, read_lines

TEXT_LIMIT = 1500  # characters of one message or output shown without --full (head and tail kept)
LOG_TAIL_BYTES = 16 << 10  # of harness.log and verifier.log, in the transcript
LOG_TAIL_LINES = 25  # of that tail, shown without --full
API_NAMES = {"openai": "openai chat", "anthropic": "anthropic messages", "responses": "openai responses"}
MARKERS = str.maketrans("", "", "\ue002\ue003")  # records.display_key's content markers
# Control characters a model or a harness wrote are shown as escapes, never sent to the
# terminal (an ESC would start a terminal sequence); newlines and tabs stay.
CONTROLS = {c: f"\\x{c:02x}" for c in (*range(32), *range(127, 160)) if c not in (9, 10)}


def transcript(run_dir: Path, execution: str) -> dict:
    """The transcript of `execution` (the keys `gyre inspect --help` lists). FileNotFoundError
    for a folder that is no run directory or an unknown execution, ValueError for one that
    recorded no call."""
    folder = _folder(run_dir, execution)
    rec = load_execution(folder, transcript=True)
    if not rec.calls:
        raise ValueError(f"execution {execution!r} recorded no model calls (its harness never reached the "
                         f"model): see {folder / 'harness.log'}")
    log = read_run_log(run_dir)
    verdict = outcome(run_dir, log, execution)
    event = log.outcomes.get(execution) or log.scored.get(execution) or json_file(folder / "summary.json") or {}
    new_text = _new_prompt_text(folder / "nodes.jsonl")
    index = {c["call_id"]: i + 1 for i, c in enumerate(rec.calls)}
    return {"execution": execution, "run_dir": str(run_dir),
            "calls": [_call(i + 1, c, index, new_text.get(c["call_id"], "")) for i, c in enumerate(rec.calls)],
            "harness_log": _log_tail(folder / "harness.log"), "verifier_log": _log_tail(folder / "verifier.log"),
            "outcome": {"status": verdict["execution_status"], "reward": verdict["reward"], "valid": verdict["valid"],
                        "ref": event.get("ref"), "eval_attempts": event.get("eval_attempts")}}


def _folder(run_dir: Path, execution: str) -> Path:
    root = run_dir / "executions"
    if not root.is_dir():
        raise FileNotFoundError(f"{run_dir} has no executions/ folder (is it a gyre run directory?)")
    folder = root / execution
    if execution not in ("", ".", "..") and Path(execution).name == execution and folder.is_dir():
        return folder
    raise no_execution(run_dir, execution, sorted(d.name for d in root.iterdir() if d.is_dir()))


def _call(n: int, c: dict, index: dict[str, int], new_text: str) -> dict:
    """One call's entry; a transcript key its record lacks (an older gyre) stays None."""
    sampling = c.get("sampling") or {}
    msgs = c.get("messages")
    seen = c.get("messages_seen_in")
    return {"index": n, "call_id": c["call_id"], "api": c.get("api"), "role": c.get("role"),
            "status": c.get("status"), "finish_reason": c.get("finish_reason"),
            "max_tokens": sampling.get("max_tokens"), "prompt_tokens": c.get("prompt_tokens"),
            "new_prompt_tokens": c.get("new_prompt_tokens"), "cached_tokens": c.get("cached_tokens"),
            "output_tokens": c.get("output_tokens"), "invalid_tool_calls": c.get("invalid_tool_calls"),
            "delegated_by": index.get(c.get("delegated_by")),
            "messages_total": None if msgs is None else c.get("messages_from", 0) + len(msgs),
            "messages_from": c.get("messages_from"), "messages_seen_in": index.get(seen) if seen else None,
            "messages": msgs, "new_prompt_text": new_text,
            "output_text": c.get("output_text"), "output_tool_calls": c.get("output_tool_calls")}


def _new_prompt_text(nodes: Path) -> dict[str, str]:
    """Call id -> the prompt text it added to the tree, rendered by the chat template (what the
    model read that was new; text an earlier call added is not repeated)."""
    out: dict[str, list[str]] = {}
    for _, n in read_lines(nodes):
        if n.get("kind") == "text" and isinstance(n.get("key"), str):
            out.setdefault(n.get("call_id"), []).append(n["key"].translate(MARKERS))
    return {k: "".join(v) for k, v in out.items()}


def _log_tail(path: Path) -> dict | None:
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(max(0, size - LOG_TAIL_BYTES))
            tail = f.read()
    except OSError:
        return None
    return {"path": str(path), "bytes": size, "tail": tail.decode("utf-8", errors="replace")}


# --- rendering ----------------------------------------------------------------------------


@dataclass
class _Shown:
    """The calls rendered so far, to recognise their answers in later requests: tool-call id
    -> (call index, tool name), answer text -> call index."""

    calls: dict[int, dict] = field(default_factory=dict)
    tool_calls: dict[str, tuple[int, str]] = field(default_factory=dict)
    texts: dict[str, int] = field(default_factory=dict)


def render_transcript(t: dict, console: Console, *, full: bool = False) -> None:
    """Print `t`: a header, each call, the logs' tails, the outcome. Texts longer than
    TEXT_LIMIT are cut in the middle unless `full`, saying how much."""
    out = t["outcome"]
    n = len(t["calls"])
    console.print(f"[bold]{escape(t['execution'])}[/]: {n} call{'' if n == 1 else 's'}, {_outcome_line(out)}",
                  soft_wrap=True)
    shown = _Shown()
    for c in t["calls"]:
        _render_call(c, n, shown, console, full)
    for name in ("harness_log", "verifier_log"):
        _render_log(name.replace("_", "."), t[name], console, full)
    console.print(f"\n[bold]outcome[/]: {_outcome_line(out)}", soft_wrap=True)
    if out["ref"]:
        console.print("  ref: " + out["ref"].translate(CONTROLS), soft_wrap=True, markup=False, highlight=False)


def _outcome_line(out: dict) -> str:
    reward = "n/a" if out["reward"] is None else f"{out['reward']:.3f}"
    valid = {True: "valid", False: "invalid"}.get(out["valid"], "validity unknown")
    attempts = f", {out['eval_attempts']} evaluation attempt(s)" if out.get("eval_attempts") else ""
    return f"{escape(str(out['status']))}, reward {reward}, {valid}{attempts}"


def _render_call(c: dict, n: int, shown: _Shown, console: Console, full: bool) -> None:
    api = API_NAMES.get(c["api"], c["api"] or "unknown API")
    by = f", delegated by call {c['delegated_by']}" if c["delegated_by"] else ""
    console.print(f"\n[bold]call {c['index']}/{n}[/] {escape(c['call_id'])}: {api}, role {escape(str(c['role']))}"
                  f"{by}, status {escape(str(c['status']))}", soft_wrap=True)
    if c["messages"] is None:
        console.print("  messages: unknown (recorded before gyre kept them); the prompt text new in this call, "
                      "as the model read it:", soft_wrap=True)
        _print_text(c["new_prompt_text"] or "(none: all of it was in the tree already)", console, full)
    else:
        _render_messages(c, shown, console, full)
    shown.calls[c["index"]] = c
    console.print(f"  [bold]output[/]: finish {_finish(c)}; {_tokens(c)}", soft_wrap=True)
    if c["output_text"] is None:
        console.print(f"    unknown (recorded before gyre kept it): {_num(c['output_tokens'])} tokens",
                      soft_wrap=True)
        return
    if c["status"] != "ok":
        console.print(f"    (no answer: the call ended {escape(str(c['status']))}; what was generated before)")
    if c["output_text"]:
        _print_text(c["output_text"], console, full)
    for call in c["output_tool_calls"] or []:
        _print_text(f"-> {call['name']} {call['arguments']}  [{call['id']}]", console, full)
        shown.tool_calls[call["id"]] = (c["index"], call["name"])
    if c["status"] == "ok" and not c["output_tool_calls"]:
        shown.texts[c["output_text"].strip()] = c["index"]


def _render_messages(c: dict, shown: _Shown, console: Console, full: bool) -> None:
    """The request's messages from `messages_from` on, an earlier call's answer sent back as
    one line; a note where the request extends the one before it without that call's answer
    (the harness dropped or rewrote it)."""
    first, total, seen = c["messages_from"] + 1, c["messages_total"], c["messages_seen_in"]
    which = f"message {total}" if first == total else f"messages {first}-{total}"
    before = f" ({first - 1} before as sent in call {seen}, not repeated)" if seen else ""
    console.print(f"  {which} of {total}{before}:", soft_wrap=True)
    if not c["messages"]:
        console.print("    (none new: the same messages again)")
    sent_back = set()
    for m in c["messages"]:
        owners = {shown.tool_calls.get(tc["id"], (None,))[0] for tc in m.get("tool_calls") or []}
        owners = owners or {shown.texts.get(m["content"].strip())}
        if m["role"] == "assistant" and len(owners) == 1 and None not in owners:
            sent_back |= owners
            console.print(f"    [dim]assistant: call {owners.pop()}'s output, sent back[/]")
            continue
        head = m["role"]
        if m.get("tool_call_id"):
            made = shown.tool_calls.get(m["tool_call_id"])
            head += f" (result of {m['tool_call_id']}" + (f", {made[1]} in call {made[0]})" if made else ")")
        elif m.get("name"):
            head += f" ({m['name']})"
        _print_text(f"{head}: {m['content']}", console, full)
        for tc in m.get("tool_calls") or []:
            _print_text(f"-> {tc['name']} {tc['arguments']}  [{tc['id']}]", console, full)
    prev = shown.calls.get(seen)
    if prev and prev["status"] == "ok" and first - 1 == prev["messages_total"] and seen not in sent_back:
        console.print(f"    [yellow]call {seen}'s output is not among them as the model wrote it (the harness "
                      "dropped or rewrote it)[/]", soft_wrap=True)


def _finish(c: dict) -> str:
    reason = c["finish_reason"] or "unknown"
    if reason == "length":
        cap = "max_tokens" if c["max_tokens"] is None else f"max_tokens {c['max_tokens']}"
        return f"length (cut at {cap})"
    return reason


def _tokens(c: dict) -> str:
    prompt = f"prompt {_num(c['prompt_tokens'])} tokens ({_num(c['new_prompt_tokens'])} new to the tree"
    if c["cached_tokens"] is not None:
        prompt += f", {c['cached_tokens']} from the engine's cache"
    invalid = f", {c['invalid_tool_calls']} malformed tool call(s)" if c["invalid_tool_calls"] else ""
    return f"{prompt}), output {_num(c['output_tokens'])} tokens{invalid}"


def _render_log(name: str, log: dict | None, console: Console, full: bool) -> None:
    if log is None or not log["bytes"]:
        console.print(f"\n[bold]{name}[/]: " + ("none" if log is None else f"{escape(log['path'])} (empty)"),
                      soft_wrap=True)
        return
    lines = log["tail"].split("\n")
    if lines and not lines[-1]:
        lines.pop()  # the newline that ends the last line
    shown = lines if full else lines[-LOG_TAIL_LINES:]
    cut = log["bytes"] > len(log["tail"].encode()) or len(shown) < len(lines)
    what = f"the last {len(shown)} lines" if cut else "all of it"
    console.print(f"\n[bold]{name}[/]: {escape(log['path'])} ({log['bytes']} bytes; {what})", soft_wrap=True)
    for line in shown:
        console.print("    " + line.translate(CONTROLS), soft_wrap=True, markup=False, highlight=False)


def _print_text(text: str, console: Console, full: bool) -> None:
    """`text` indented; past TEXT_LIMIT characters (without `full`) its middle is cut, saying how much."""
    if not full and len(text) > TEXT_LIMIT:
        head, tail = TEXT_LIMIT * 2 // 3, TEXT_LIMIT // 3
        cut = len(text) - head - tail
        text = f"{text[:head]}\n[... {cut} of {len(text)} characters cut; --full shows all ...]\n{text[-tail:]}"
    for line in text.translate(CONTROLS).split("\n"):
        console.print("    " + line, soft_wrap=True, markup=False, highlight=False)


def _num(v: int | None) -> str:
    return "unknown" if v is None else str(v)
