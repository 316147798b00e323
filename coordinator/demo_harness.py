"""demo_harness.py: the built-in multi-turn agent that gyre's embedded default trains.

A harness like any other: a subprocess that reaches gyre only through the `openai` SDK at
OPENAI_BASE_URL, so the proxy sees tool calls, a compaction branch and a sub-agent root the way
it would from a black-box harness. It lives beside its preset (harnesses.py `demo`) but runs
as its own process, never inside the coordinator, and imports nothing from gyre. It never
trusts the model (the policy is tiny and emits garbage): bad output becomes an error tool
result, and every run ends within bounded turns. Exit 0: the run completed; 1: the proxy
failed after the SDK's retries; 2: usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import openai

MAX_FILE_BYTES = 64 * 1024
MAX_LISTED = 200
MAX_SUBAGENTS = 4  # per run, delegate calls and the forced one together
SUBAGENT_TURNS = 3
SUMMARY_MARKER = "Summarize the conversation so far"
SUMMARY_REQUEST = (f"{SUMMARY_MARKER}: the task, what has been done, which files were written and what "
                   "remains. Reply with the summary only.")
CONTINUATION = "This session is being continued from a previous conversation."
FORCED_SUBTASK = "List the files in the workspace and report."

MAIN_SYSTEM = (
    "You are a coding agent working in a workspace directory. Use the tools to finish the task: "
    "write_file(path, content) creates or overwrites a file, read_file(path) returns a file's text, "
    "list_files() lists the workspace, and delegate(task) hands a sub-task to a sub-agent and returns "
    "its report. Paths are relative to the workspace. When the task is done, reply with a short final "
    "answer and no tool calls.")
SUB_SYSTEM = (
    "You are a sub-agent helping a main agent. Do only the sub-task you are given, using read_file, "
    "list_files and write_file (paths relative to the workspace), then reply with a short report and "
    "no tool calls.")


def _tool(name: str, description: str, **params: str) -> dict:
    properties = {p: {"type": "string", "description": d} for p, d in params.items()}
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": list(params)}}}


SUB_TOOLS = [
    _tool("write_file", "Create or overwrite a file in the workspace.",
          path="path relative to the workspace", content="the file's full text"),
    _tool("read_file", "Read a file in the workspace.", path="path relative to the workspace"),
    _tool("list_files", "List the files in the workspace."),
]
MAIN_TOOLS = SUB_TOOLS + [_tool("delegate", "Hand a sub-task to a sub-agent; returns its report.",
                                task="the sub-task, self-contained")]


class ToolError(ValueError):
    """A tool call the harness refuses; its message becomes the tool result."""


class Workspace:
    """The directory the tools may touch: every path resolves inside it or is refused."""

    def __init__(self, root: Path):
        self.root = root.resolve()

    def resolve(self, path: Any) -> Path:
        if not isinstance(path, str) or not path.strip():
            raise ToolError("path must be a non-empty string")
        if os.path.isabs(path) or path.startswith(("/", "\\")) or "\x00" in path:
            raise ToolError(f"path must be relative to the workspace: {path!r}")
        # resolve() follows symlinks, so a link pointing out of the workspace is caught here too.
        target = (self.root / path).resolve()
        if target == self.root or not target.is_relative_to(self.root):
            raise ToolError(f"path escapes the workspace: {path!r}")
        return target

    def write_file(self, path: Any, content: Any) -> str:
        if not isinstance(content, str):
            raise ToolError("content must be a string")
        data = content.encode()
        if len(data) > MAX_FILE_BYTES:
            raise ToolError(f"content is {len(data)} bytes; the limit is {MAX_FILE_BYTES}")
        target = self.resolve(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        return f"wrote {len(data)} bytes to {target.relative_to(self.root).as_posix()}"

    def read_file(self, path: Any) -> str:
        with self.resolve(path).open("rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
        text = data[:MAX_FILE_BYTES].decode(errors="replace")
        return text + ("\n[truncated]" if len(data) > MAX_FILE_BYTES else "")

    def list_files(self) -> str:
        names = []
        for dirpath, dirnames, filenames in os.walk(self.root):  # does not follow symlinked dirs
            dirnames.sort()
            rel = Path(dirpath).relative_to(self.root)
            names += [(rel / n).as_posix() for n in sorted(filenames)]
            if len(names) > MAX_LISTED:
                return "\n".join(names[:MAX_LISTED] + ["[truncated]"])
        return "\n".join(names) or "(empty)"


def parse_arguments(arguments: str, required: list[str]) -> dict:
    """Tool-call arguments as a dict with every required field, or a ToolError."""
    try:
        # An empty string is what small models often send for a tool without parameters.
        args = json.loads(arguments) if arguments.strip() else {}
    except ValueError as e:
        raise ToolError(f"arguments are not valid JSON: {e}") from None
    if not isinstance(args, dict):
        raise ToolError(f"arguments must be a JSON object, got {type(args).__name__}")
    missing = [p for p in required if p not in args]
    if missing:
        raise ToolError(f"missing argument(s): {', '.join(missing)}")
    return args


@dataclass
class Reply:
    """One model response, reduced to what the loop needs."""

    message: dict  # the assistant message as returned (same ids, same argument strings)
    text: str
    calls: list[tuple[str, str, str]]  # (id, name, arguments)
    tokens: int  # usage.total_tokens, 0 when the proxy sent no usage


def reply_of(response: Any) -> Reply:
    """Read a completion defensively: a broken response reads as an empty answer, not a crash."""
    choices = getattr(response, "choices", None) or []
    msg = getattr(choices[0], "message", None) if choices else None
    content = getattr(msg, "content", None)
    calls = []
    for i, tc in enumerate(getattr(msg, "tool_calls", None) or []):
        fn = getattr(tc, "function", None)
        calls.append((getattr(tc, "id", None) or f"call_missing_{i}",
                      str(getattr(fn, "name", None) or ""), str(getattr(fn, "arguments", None) or "")))
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                                 for i, n, a in calls]
    usage = getattr(response, "usage", None)
    tokens = getattr(usage, "total_tokens", 0) or 0
    return Reply(message, content if isinstance(content, str) else "", calls, int(tokens))


@dataclass
class Stats:
    turns: int = 0  # main-agent model calls (summaries and sub-agent calls excluded)
    tool_calls: int = 0  # every tool call executed, the sub-agents' included
    compactions: int = 0
    subagents: int = 0
    answer_chars: int = 0


@dataclass
class Agent:
    """Runs one task: the main loop, its compactions and its sub-agents. Called by main()."""

    client: openai.OpenAI
    workspace: Workspace
    task: str
    model: str
    max_tokens: int | None  # None: the proxy's limit (the run's default_max_tokens)
    max_turns: int
    compact_at: int
    force_compaction: bool = False
    force_subagent: bool = False
    stats: Stats = field(default_factory=Stats)
    answer: str = ""  # the last main-agent text so far, possibly empty

    def call(self, messages: list[dict], tools: list[dict] | None) -> Reply:
        kwargs: dict[str, Any] = {"tools": tools} if tools else {}
        if self.max_tokens is not None:
            kwargs["max_tokens"] = self.max_tokens
        response = self.client.chat.completions.create(model=self.model, messages=messages, temperature=1.0,
                                                       **kwargs)
        return reply_of(response)

    def run(self) -> str:
        """The main loop; returns the final answer (the last main-agent text, possibly empty)."""
        history = [{"role": "system", "content": MAIN_SYSTEM}, {"role": "user", "content": self.task}]
        for turn in range(1, self.max_turns + 1):
            # 1) One model call; its message goes back verbatim, then one result per tool call.
            reply = self.call(history, MAIN_TOOLS)
            self.stats.turns += 1
            self.answer = reply.text or self.answer
            history.append(reply.message)
            for call_id, name, arguments in reply.calls:
                content = self.execute(name, arguments, MAIN_TOOLS)
                history.append({"role": "tool", "tool_call_id": call_id, "content": content})
            # 2) The forced branches happen after turn 1 even when the model already answered,
            #    so the embedded default always produces a sub-agent root and a compaction branch.
            forced = turn == 1 and (self.force_subagent or self.force_compaction)
            if not reply.calls and not forced:
                break
            if turn == 1 and self.force_subagent:
                history.append({"role": "user", "content": f"Sub-agent report: {self.delegate(FORCED_SUBTASK)}"})
            # 3) Compact when the history is too long (not before a turn that will never come).
            too_long = self.estimate(history, reply.tokens) > self.compact_at and turn < self.max_turns
            if too_long or (turn == 1 and self.force_compaction):
                history = self.compact(history)
        return self.answer

    def estimate(self, history: list[dict], reported: int) -> int:
        # ~3 characters per token; the proxy's usage, when given, counts the real tokens so far.
        return max(len(json.dumps(history)) // 3, reported)

    def compact(self, history: list[dict]) -> list[dict]:
        # Same tools as the main turns (as Claude Code does): the summary call then shares the
        # main context's prefix and shows up as a branch of the main tree, not a new root.
        summary = self.call(history + [{"role": "user", "content": SUMMARY_REQUEST}], MAIN_TOOLS).text
        self.stats.compactions += 1
        text = f"{CONTINUATION} Summary: {summary.strip() or '(empty)'}\n\nTask: {self.task}"
        return [{"role": "system", "content": MAIN_SYSTEM}, {"role": "user", "content": text}]

    def delegate(self, task: str) -> str:
        """Run a sub-agent on `task` (its own system prompt, no delegate tool); returns its report."""
        self.stats.subagents += 1
        history = [{"role": "system", "content": SUB_SYSTEM}, {"role": "user", "content": task}]
        for _ in range(SUBAGENT_TURNS):
            reply = self.call(history, SUB_TOOLS)
            history.append(reply.message)
            if not reply.calls:
                return reply.text.strip() or "(no answer)"
            for call_id, name, arguments in reply.calls:
                history.append({"role": "tool", "tool_call_id": call_id,
                                "content": self.execute(name, arguments, SUB_TOOLS)})
        return "(no answer)"

    def execute(self, name: str, arguments: str, tools: list[dict]) -> str:
        """One tool call's result text; every failure the model caused is an "error: ..." string."""
        self.stats.tool_calls += 1
        required = {t["function"]["name"]: t["function"]["parameters"]["required"] for t in tools}
        try:
            if name not in required:
                raise ToolError(f"unknown tool {name!r}; available: {', '.join(required)}")
            args = parse_arguments(arguments, required[name])
            if name == "delegate":
                if not isinstance(args["task"], str) or not args["task"].strip():
                    raise ToolError("task must be a non-empty string")
                if self.stats.subagents >= MAX_SUBAGENTS:
                    raise ToolError(f"delegate limit reached ({MAX_SUBAGENTS} sub-agents per run)")
                return self.delegate(args["task"])
            return getattr(self.workspace, name)(*(args[p] for p in required[name]))
        except openai.OpenAIError:
            raise  # the proxy failing inside a sub-agent fails the run
        except ToolError as e:
            return f"error: {e}"
        except Exception as e:  # OSError, bad encodings, ...: the model's problem, not the run's
            return f"error: {type(e).__name__}: {e}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m gyre.coordinator.demo_harness", description=__doc__.splitlines()[0])
    p.add_argument("--task", help="task prompt (default: $GYRE_TASK, else task.txt in the workspace)")
    p.add_argument("--workspace", type=Path, default=Path.cwd(), help="working directory (default: cwd)")
    p.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL"), help="default: $OPENAI_BASE_URL")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY")
    p.add_argument("--model", default="policy", help="model name sent to the proxy (any name is served)")
    p.add_argument("--max-turns", type=int, default=6, help="main-agent model calls at most")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="max_tokens per model call (default: none sent; the proxy's default applies)")
    p.add_argument("--compact-at", type=int, default=1500, help="compact when the history exceeds ~N tokens")
    p.add_argument("--force-compaction", action="store_true", help="compact once after the first turn")
    p.add_argument("--force-subagent", action="store_true", help="run one sub-agent after the first turn")
    p.add_argument("--max-retries", type=int, default=2, help="SDK retries per model call")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per model call attempt")
    args = p.parse_args(argv)
    if args.task is None:
        args.task = os.environ.get("GYRE_TASK")
    if args.task is None and (args.workspace / "task.txt").is_file():
        args.task = (args.workspace / "task.txt").read_text(errors="replace")
    if not args.task:
        p.error("no task: pass --task, set GYRE_TASK or put task.txt in the workspace")
    if not args.base_url or not args.api_key:
        p.error("no proxy: set OPENAI_BASE_URL and OPENAI_API_KEY (or --base-url/--api-key)")
    if args.max_turns < 1 or (args.max_tokens is not None and args.max_tokens < 1) or args.max_retries < 0:
        p.error("--max-turns and --max-tokens must be >= 1, --max-retries >= 0")
    return args


def write_answer(workspace: Path, answer: str) -> None:
    try:
        (workspace / "answer.txt").write_text(answer, errors="replace")
    except OSError as e:  # e.g. the model made answer.txt a directory: report it, the run still completed
        print(f"demo_harness: warning: cannot write answer.txt: {e}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.workspace.mkdir(parents=True, exist_ok=True)
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key,
                           max_retries=args.max_retries, timeout=args.timeout)
    agent = Agent(client=client, workspace=Workspace(args.workspace), task=args.task, model=args.model,
                  max_tokens=args.max_tokens, max_turns=args.max_turns, compact_at=args.compact_at,
                  force_compaction=args.force_compaction, force_subagent=args.force_subagent)
    try:
        answer = agent.run()
    except openai.OpenAIError as e:
        write_answer(args.workspace, agent.answer)  # the evaluator finds the file even now
        reason = " ".join(str(e).split())[:500]
        print(f"demo_harness: error: proxy request failed: {type(e).__name__}: {reason}", file=sys.stderr)
        return 1
    finally:
        client.close()
    write_answer(args.workspace, answer)
    agent.stats.answer_chars = len(answer)
    print(json.dumps(asdict(agent.stats)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
