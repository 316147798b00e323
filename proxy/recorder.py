"""recorder.py: one execution's recorder: its tree, its calls, its files in the run dir.

`prepare()` turns a parsed request into the exact prompt token ids (recorded tokens for
the matched prefix, fresh tokens only for new segments) and `complete()` records the
model's output as a policy node with its behaviour log-probs and versions. Recorded
outputs are found again by tool-call id (the harness may re-serialise the arguments) or
by their text. `record_reply()` does both halves for a whole output without the server
(benches, tests), parsing and answering it with the pieces call.py uses, `output_parser()`
and `parsed_result()`. A call's lines go to the files together or not at all
(records.Journal): a write that fails (a full disk) takes back what the call added to the
tree and raises JournalError, so memory and files always agree. Not HTTP and not the
engine: server.py drives both.
"""

from __future__ import annotations

import logging
import random
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from gyre.proxy import api_anthropic, api_openai, api_responses
from gyre.proxy.admission import J_MAX, Rows, Trajectory, admit, materialise
from gyre.proxy.chat import ChatTokenizer, Ref, display_key, live_key, token_chars
from gyre.proxy.parser import OutputParser
from gyre.proxy.records import SENT_KEEP, TRANSCRIPT_KEYS, Journal, JournalError, sync_dir, transcript_fields
from gyre.proxy.roles import CallInfo, RoleRule, delegation_prompt
from gyre.proxy.segmenter import Segmenter
from gyre.proxy.tree import Node, Tree
from gyre.proxy.types import ChatRequest, ChatResult, ContextOverflow, ParseMemo, Usage

log = logging.getLogger("gyre.proxy")
APIS = {api.NAME: api for api in (api_openai, api_anthropic, api_responses)}  # ChatRequest.api -> its module


@dataclass(slots=True)
class Prepared:
    call_id: str
    path: list[int]
    prompt_ids: np.ndarray  # the path's ids, a new array (Tree.ids dtype): no list of a long prompt's ints
    new_tokens: int  # prompt tokens that had to be encoded for this call
    role: str
    t_start: float
    delegated_by: str | None = None  # the call whose Agent/Task tool call opened this sub-agent


@dataclass(frozen=True, slots=True)
class Plan:
    """A call's prompt as `Recorder.plan` found it: the matched path and the steps to add."""

    req: ChatRequest
    parent: int
    path: list[int]
    steps: list[tuple]


@dataclass
class Recorder:
    id: str
    key: str
    tokenizer: ChatTokenizer
    rule: RoleRule
    dir: Path | None = None
    tree: Tree = field(default_factory=Tree)
    calls: list[dict] = field(default_factory=list)
    closed: bool = False
    # Model calls of this execution that gyre itself refused, whatever the agent did: a 503
    # (the disk guard or a record the disk refused, no engine available, the proxy
    # overloaded), a 429 (the execution over its calls-in-flight or tokens-per-minute budget,
    # proxy/budget.py; count_tokens calls too), a 500 (a proxy fault), as a plain answer or
    # as an error event mid-stream. Not a refusal: a context overflow the agent caused, a
    # 4xx for its own bad input, the engine refusing its request (400), a client that went
    # away. Not counted, for no execution can be named: a 401, a 503 to a connection past
    # max_connections. The launcher reads it: a harness that saw such a refusal and then
    # failed is `aborted_infra`, never a valid zero (the agent never had its chance).
    refusals: int = 0
    # Whether the most recent answer this execution's model calls got was such a refusal
    # (a later served call or agent-caused error sets it back to False).
    refused_last: bool = False
    last_refusal: str = ""  # the latest such refusal, its status and message (what the launcher names)

    def __post_init__(self) -> None:
        if not self.tree.nodes:  # ids as narrow as the vocabulary allows
            self.tree = Tree(getattr(self.tokenizer, "vocab_size", None))
        self._outputs: dict[str, int] = {}  # call id -> its (policy) output node
        self._by_tool_id: dict[str, str] = {}
        self._text_last: dict[str, str] = {}  # reply text -> the latest call that produced it
        self._text_at: dict[tuple[int, str], str] = {}  # (parent node, reply text) -> call id
        self._args: dict[str, str] = {}  # tool-call id -> arguments exactly as we emitted them
        self._first_model: str | None = None
        self._first_root_tools = False
        self._n_calls = 0
        self._journals: dict[str, Journal] = {}
        self._roles: dict[int, str] = {}  # node -> role of the call that ended there
        self._delegations: dict[str, tuple[str, int]] = {}  # sub-agent prompt -> (delegating call, its root)
        self._segmenter = Segmenter(self.tokenizer)  # re-renders only what changed since a recent call
        self.parse_memo = ParseMemo()  # re-parses only what changed (the server passes it to the API parser)
        self._synced_dir = False
        self._sent: list[tuple[str, list]] = []  # (call id, messages) of the latest recorded calls, newest first
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)

    @classmethod
    def resumed(cls, id: str, key: str, tokenizer: ChatTokenizer, rule: RoleRule, dir: Path) -> Recorder:
        """The Recorder of an execution that outlived the coordinator that recorded it (issue
        34): its tree, calls and every lookup a later call follows (outputs, tool-call ids and
        arguments, replies by text, delegations, roles, the first call's model and tools)
        rebuilt from its folder, so a harness's next call (or its retry of the call the crash
        cut) extends the same tree: no duplicate root, nothing recorded twice. Its journals
        append where the files end (a torn last line is cut, as on any open). RecordsError when
        the files do not make a tree."""
        from gyre.proxy.records import load_execution

        recorded = load_execution(dir, transcript=True, text=live_key)
        ex = cls(id, key, tokenizer, rule, dir=dir, tree=recorded.tree)
        for c in recorded.calls:
            ex.calls.append({k: v for k, v in c.items() if k not in TRANSCRIPT_KEYS and k != "prompt_path"})
            if ex._first_model is None:
                ex._first_model, ex._first_root_tools = c.get("model"), bool(c.get("has_tools"))
            out, parent = c.get("output_node"), c["prompt_node"]
            ex._roles[out if out is not None else parent] = c["role"]
            if out is None or c.get("status") != "ok":
                continue
            ex._outputs[c["call_id"]] = out
            made = c.get("output_tool_calls") or []
            for call in made:
                ex._by_tool_id[call["id"]] = c["call_id"]
                ex._args[call["id"]] = call["arguments"]
                prompt = delegation_prompt(rule, call["name"], call["arguments"])
                if prompt is not None:
                    ex._delegations[prompt] = (c["call_id"], ex.tree.nodes[c["prompt_path"][0]].root)
            if not made:
                text = (c.get("output_text") or "").strip()
                ex._text_last[text] = c["call_id"]
                ex._text_at[(parent, text)] = c["call_id"]
        ex._n_calls = len(recorded.calls)
        return ex

    # --- a call's prompt ----------------------------------------------------------------

    def prepare(self, req: ChatRequest, headers: dict[str, str], max_context: int | None = None) -> Prepared:
        """The call's exact prompt. Nothing is added to the tree until the prompt is known to
        fit `max_context` (a refused request touches no record)."""
        return self.apply(self.plan(req, max_context), headers)

    def plan(self, req: ChatRequest, max_context: int | None = None) -> Plan:
        """The first half of `prepare`, the slow one (rendering, tokenizing new text): what the
        prompt is, nothing added. It only reads the tree and the lookups, so the server runs it
        on its prompt thread while the event loop records other calls' outputs (which add
        output nodes and lookups, never a text node a plan could race); two plans of one
        execution must not overlap its `apply` (the server holds a per-execution lock)."""
        refs = self._resolve_outputs(req)
        # 1) Follow existing nodes as far as they match; plan the rest without adding it.
        parent, path, plan = self._match(req, refs, max_context)
        # A reply found only by its text, and recorded in another context, may be a message
        # this context already holds as text: the harness sent it (an injected "No response
        # requested.") before the model wrote the same text. Spliced in as a copy, it would
        # change the tokens of a history that did not change; rendered as text, it follows
        # the tree further, and then text wins (a genuinely new context keeps the copy).
        while (i := next((s[4] for s in plan if s[0] == "copy" and s[2] == "text"), None)) is not None:
            as_text = {j: r for j, r in refs.items() if j != i}
            alt = self._match(req, as_text, max_context)
            if self._matched_tokens(alt[0]) <= self._matched_tokens(parent):
                break
            refs, (parent, path, plan) = as_text, alt
        if not path and not plan:
            raise ValueError("the request renders to an empty prompt")
        length = self._matched_tokens(parent) + sum(len(p[2]) if p[0] == "text" else len(p[1].tokens) for p in plan)
        if max_context is not None and length >= max_context:
            raise ContextOverflow(length, max_context)
        return Plan(req, parent, path, plan)

    def apply(self, planned: Plan, headers: dict[str, str]) -> Prepared:
        """The second half of `prepare`, quick: the planned nodes added and written, the call
        classified. On the event loop (it writes the files and the lookups)."""
        req, parent, path, plan = planned.req, planned.parent, list(planned.path), planned.steps
        # 2) Add the planned nodes.
        call_id = f"{self.id}-c{self._n_calls + 1:05d}"
        new_tokens, n_before, lines, text_at = 0, len(self.tree.nodes), [], {}
        for step in plan:
            if step[0] == "text":
                node = self.tree.add_text(parent, step[1], step[2], call_id)
                new_tokens += len(step[2])
                lines.append(("nodes", self._node_line(node, step[1])))  # the tree keeps only the text's key
            else:
                _, source, kind, key, _ = step
                node = self.tree.add_output_copy(parent, source, call_id)
                if kind == "text":
                    text_at[(parent, key)] = source.key
                lines.append(("nodes", self._node_line(node)))
            path.append(node.id)
            parent = node.id
        try:
            self._commit(lines)
        except JournalError:
            self._take_back(n_before)  # the request is answered 503: as if it never came
            raise
        self._n_calls += 1
        self._text_at.update(text_at)
        root = self.tree.nodes[path[0]].root
        delegated_by = self._delegated_by(req, root)
        role = self._classify(req, headers, root, delegated_by)
        return Prepared(call_id, path, self.tree.token_array(path), new_tokens, role, time.time(), delegated_by)

    def note_answer(self, refused: bool, why: str = "") -> None:
        """One model call of this execution was answered: `refused` when the answer was gyre's
        own refusal (see `refusals`), `why` its status and message."""
        if refused:
            self.refusals += 1
            self.last_refusal = why[:300]
        self.refused_last = refused

    def _match(self, req: ChatRequest, refs: dict[int, tuple[str, str]],
               max_context: int | None = None) -> tuple[int, list[int], list[tuple]]:
        """The request's segments (`refs`: messages spliced in as recorded outputs) followed
        from the root: the last matched node, the matched path, and the plan for the rest
        (text steps with their tokens, copy steps with the message index), nothing added.
        ContextOverflow, before tokenizing it, at a new text that cannot fit `max_context`
        whatever its tokens (a text of n characters is n / max_chars_per_token at least)."""
        segments = self._segmenter.segments(req.messages, req.tools, {i: str(i) for i in refs}, self._args)
        per = getattr(self.tokenizer, "max_chars_per_token", None) if max_context is not None else None
        parent, path, plan, strip, at_least = -1, [], [], None, 0
        for seg in segments:
            if isinstance(seg, Ref):
                kind, key = refs[int(seg.key)]
                source = self._recorded_output(kind, key, parent if not plan else None)
                nid = None if plan else self.tree.child(parent, "output", source.key)
                last = int(source.tokens[-1]) if len(source.tokens) else None
                strip = self.tokenizer.token_text(last) if last in self.tokenizer.stop_token_ids else None
                if nid is None:
                    plan.append(("copy", source, kind, key, int(seg.key)))
                    continue
            else:
                text = seg.text
                if strip and text.startswith(strip):  # the template re-closes a turn the output closed
                    text = text[len(strip):]
                strip = None
                if not text:
                    continue
                nid = None if plan else self.tree.child_text(parent, text)
                if nid is None:
                    at_least += token_chars(text) // per if per else 0
                    if per and self._matched_tokens(parent) + at_least >= max_context:
                        raise ContextOverflow(self._matched_tokens(parent) + at_least, max_context)
                    start = parent < 0 and not plan  # the prompt's first text
                    plan.append(("text", text, self.tokenizer.encode_segment(text, at_start=start)))
                    continue
            path.append(nid)
            parent = nid
        return parent, path, plan

    def _matched_tokens(self, parent: int) -> int:
        return self.tree.nodes[parent].end if parent >= 0 else 0

    def _resolve_outputs(self, req: ChatRequest) -> dict[int, tuple[str, str]]:
        """Assistant messages that are our recorded outputs: message index -> ("call", call
        id) when found by tool-call id, or ("text", text) when found by its text."""
        found: dict[int, tuple[str, str]] = {}
        for i, m in enumerate(req.messages):
            if m.role != "assistant":
                continue
            if m.tool_calls:
                owners = {self._by_tool_id.get(c.id) for c in m.tool_calls}
                if len(owners) == 1 and None not in owners:
                    found[i] = ("call", owners.pop())
            elif m.content.strip() in self._text_last:
                found[i] = ("text", m.content.strip())
        return found

    def _recorded_output(self, kind: str, key: str, parent: int | None) -> Node:
        """The recorded output a message refers to: the one recorded under `parent` when
        there is one (one lookup, however many identical replies exist), else the latest."""
        if kind == "call":
            return self.tree.nodes[self._outputs[key]]
        cid = self._text_at.get((parent, key)) if parent is not None else None
        return self.tree.nodes[self._outputs[cid or self._text_last[key]]]

    def _delegated_by(self, req: ChatRequest, root: int) -> str | None:
        """The call that delegated this request's conversation: its first user message ends
        with (harnesses prepend reminders) the prompt of one of our Agent/Task tool calls
        made in another conversation (a main agent delegating its own task verbatim stays
        the main agent)."""
        if not self._delegations:
            return None
        first = next((m.content for m in req.messages if m.role == "user"), "").strip()
        for prompt, (call_id, from_root) in self._delegations.items():
            if from_root != root and first.endswith(prompt):
                return call_id
        return None

    def _classify(self, req: ChatRequest, headers: dict[str, str], root: int, delegated_by: str | None) -> str:
        if self._first_model is None:
            self._first_model, self._first_root_tools = req.model, bool(req.tools)
        last_user = next((m.content for m in reversed(req.messages) if m.role == "user"), "")
        first_user = next((m.content for m in req.messages if m.role == "user"), "")
        system = req.messages[0].content if req.messages and req.messages[0].role == "system" else ""
        return self.rule.classify(CallInfo(root=root, model=req.model, has_tools=bool(req.tools),
                                           last_user=last_user, first_model=self._first_model,
                                           first_root_has_tools=self._first_root_tools, headers=headers,
                                           system=system, first_user=first_user, delegated_by=delegated_by))

    # --- a call's output ----------------------------------------------------------------

    def complete(self, prep: Prepared, *, output_ids: list[int], logprobs: list[float], versions: list[int],
                 finish_reason: str, status: str, engine: str, result: ChatResult | None,
                 request: ChatRequest, invalid_tool_calls: int = 0, sampling: dict | None = None,
                 cached_tokens: int | None = None, prefill_tokens: int | None = None) -> dict:
        """Record the call. Only a call that ended normally leaves a trainable output."""
        parent = prep.path[-1]
        leaf = parent
        out_node = node = None
        n_before, lines = len(self.tree.nodes), []
        if output_ids:
            node = self.tree.add_output(parent, prep.call_id, list(output_ids), list(logprobs), list(versions))
            node.policy = status == "ok"
            lines.append(("nodes", self._node_line(node)))
            out_node, leaf = node.id, node.id
        record = self._call_record(prep, request, status=status, finish_reason=finish_reason, engine=engine,
                                   result=result, out_node=out_node, output_ids=output_ids, versions=versions,
                                   invalid_tool_calls=invalid_tool_calls, cached_tokens=cached_tokens,
                                   prefill_tokens=prefill_tokens, sampling=sampling)
        # The file keeps the whole path (tree.path(prompt_node)); in memory it would cost a
        # pointer per node per call, quadratic in an execution's calls.
        line = {**record, "prompt_path": prep.path}
        if self.dir is not None:  # and its transcript, in the file only (records.TRANSCRIPT_KEYS)
            line.update(self._transcript(request, result, output_ids))
        lines.append(("calls", _dumps(line)))
        try:
            self._commit(lines)  # the output node and its call: both on file, or neither
        except JournalError:
            self._take_back(n_before)
            raise
        if self.dir is not None:  # a later call's messages are written from where this one's end
            self._sent.insert(0, (prep.call_id, request.messages))
            del self._sent[SENT_KEEP:]
        # Only now the lookups that later calls follow (the call is on file).
        if node is not None:
            if result is not None and status == "ok":
                ids = [c.id for c in result.tool_calls]
                self._outputs[prep.call_id] = node.id
                for c in result.tool_calls:
                    self._by_tool_id[c.id] = prep.call_id
                    self._args[c.id] = c.arguments
                    prompt = delegation_prompt(self.rule, c.name, c.arguments)
                    if prompt is not None:
                        self._delegations[prompt] = (prep.call_id, self.tree.nodes[prep.path[0]].root)
                if not ids:
                    text = result.content.strip()
                    self._text_last[text] = prep.call_id
                    self._text_at[(parent, text)] = prep.call_id
        self._roles[leaf] = prep.role
        self.calls.append(record)
        return record

    def undelivered(self, record: dict) -> None:
        """A call recorded ok whose answer never reached the harness (the connection or the
        proxy went while it was sent): the harness retries it, and the retry is the call that
        continues the conversation; this output stays on file but is not trained, as a
        disconnected call's. On file as a `meta` line (records.load_execution applies it)."""
        node = record["output_node"]
        self._write("meta", {"event": "undelivered", "t": time.time(), "call_id": record["call_id"], "node": node})
        record["status"] = "undelivered"
        if node is not None:
            self.tree.nodes[node].policy = False

    def record_reply(self, req: ChatRequest, output_ids: list[int], *, prep: Prepared | None = None,
                     finish: str = "stop", logprobs: list[float] | None = None, versions: list[int] | None = None,
                     engine: str = "scripted", new_call_id: Callable[[], str] | None = None,
                     sampling: dict | None = None, cached_tokens: int | None = None,
                     prefill_tokens: int | None = None) -> tuple[ChatResult, dict]:
        """Record `output_ids` as the model's whole output for `req` (prepared here, unless `prep`
        is), as the server records a call that ended normally (`finish`: the engine's stop or
        length): parsed by the server's parser (tool calls, stop strings; tool-call ids from
        `new_call_id`, else the API's), only the tokens the answer kept. Log-probs -0.5 and
        version 0 unless given. Returns what the harness is answered and the call's record."""
        prep = prep if prep is not None else self.prepare(req, {})
        api = APIS[req.api]
        parser = output_parser(self.tokenizer, req, new_call_id or api.new_tool_call_id)
        parser.feed(list(output_ids))
        parser.finish()
        n = len(output_ids) if parser.kept is None else parser.kept
        result = parsed_result(parser, req, api.new_response_id(), finish, len(prep.prompt_ids), n)
        record = self.complete(prep, output_ids=list(output_ids[:n]), logprobs=list(logprobs or [-0.5] * n)[:n],
                               versions=list(versions or [0] * n)[:n], finish_reason=result.finish_reason,
                               status="ok", engine=engine, result=result, request=req,
                               invalid_tool_calls=parser.invalid_tool_calls, sampling=sampling,
                               cached_tokens=cached_tokens, prefill_tokens=prefill_tokens)
        return result, record

    def _call_record(self, prep: Prepared, request: ChatRequest, *, status: str, finish_reason: str, engine: str,
                     result: ChatResult | None, out_node: int | None, output_ids: list[int], versions: list[int],
                     invalid_tool_calls: int, cached_tokens: int | None, prefill_tokens: int | None,
                     sampling: dict | None) -> dict:
        record = {
            "call_id": prep.call_id, "execution": self.id, "api": request.api, "model": request.model,
            "role": prep.role, "status": status, "finish_reason": finish_reason, "engine": engine,
            "t_start": prep.t_start, "t_end": time.time(), "stream": request.stream,
            "prompt_node": prep.path[-1], "prompt_tokens": len(prep.prompt_ids), "new_prompt_tokens": prep.new_tokens,
            # The engine's prefill: prompt tokens whose KV it reused, and those it computed
            # (None: the engine did not say, or the call never reached one).
            "cached_tokens": cached_tokens, "prefill_tokens": prefill_tokens,
            "output_node": out_node, "output_tokens": len(output_ids),
            "versions": sorted(set(versions)), "invalid_tool_calls": invalid_tool_calls,
            "tool_calls": [c.id for c in result.tool_calls] if result else [],
            "has_tools": bool(request.tools),  # what a resumed Recorder classifies its later calls by
        }
        if prep.delegated_by is not None:
            record["delegated_by"] = prep.delegated_by
        if sampling is not None:  # what the engine sampled with, and what the harness asked for
            record["sampling"] = sampling
        return record

    def _transcript(self, request: ChatRequest, result: ChatResult | None, output_ids: list[int]) -> dict:
        """A call's messages (those a recent call did not send) and the model's answer: the text
        and tool calls the harness got, or for a call that ended unanswered (an error, a
        disconnect) the decoding of what was generated before it ended."""
        if result is not None:
            return transcript_fields(request.messages, self._sent, result.content, result.tool_calls)
        text = self.tokenizer.decode(list(output_ids)) if output_ids else ""
        return transcript_fields(request.messages, self._sent, text, [])

    def record_request(self, body: Any, headers: dict[str, str], path: str) -> None:
        """Keep a raw request (for harness debugging); credentials never reach the file."""
        secret = {"authorization", "x-api-key", "proxy-authorization", "cookie"}
        entry = {"seq": self._n_calls + 1, "t": time.time(), "path": path, "body": body,
                 "headers": {k: v for k, v in headers.items() if k.lower() not in secret}}
        try:
            line = _dumps(entry)
        except TypeError as e:  # nested past orjson's writing depth (255), which its reader (1024) accepts
            line = _dumps({**entry, "body": None, "body_error": f"not kept: {e}"})
        self._commit([("requests", line)])

    # --- training data ------------------------------------------------------------------

    def prompt_path(self, call: dict) -> list[int]:
        """A recorded call's prompt as its path of nodes (the file's `prompt_path`)."""
        return self.tree.path(call["prompt_node"])

    @property
    def leaf_roles(self) -> dict[int, str]:
        """Role of each current leaf (a node later extended by another call is no leaf)."""
        return {n: r for n, r in self._roles.items() if not self.tree.nodes[n].children}

    def admit(self, j_max: int | None = J_MAX, seed: int = 0) -> tuple[list[Trajectory], Rows]:
        trajectories = admit(self.tree, self.leaf_roles, j_max=j_max, rng=random.Random(seed))
        return trajectories, materialise(self.tree, trajectories)

    # --- files --------------------------------------------------------------------------

    def _node_line(self, node: Node, text: str | None = None) -> bytes:
        """A node's line in nodes.jsonl; `text`: a text node's segment (the tree keeps its key)."""
        return _dumps({"id": node.id, "parent": node.parent, "kind": node.kind, "policy": node.policy,
                       "call_id": node.call_id, "tokens": node.tokens, "logprobs": node.logprobs,
                       "versions": node.versions, "key": display_key(text if text is not None else node.key)})

    def _write(self, name: str, obj: Any) -> None:
        self._commit([(name, _dumps(obj))])

    def _commit(self, lines: list[tuple[str, bytes]]) -> None:
        """Append each file's lines in one write, all files or none: a failure cuts the files
        already written back and raises JournalError."""
        if self.dir is None or not lines:
            return
        by_file: dict[str, list[bytes]] = {}
        for name, line in lines:
            by_file.setdefault(name, []).append(line)
        done: list[tuple[Journal, int]] = []
        try:
            for name, chunk in by_file.items():
                j = self._journals.get(name)
                if j is None:
                    try:
                        j = self._journals[name] = Journal(self.dir / f"{name}.jsonl")
                    except OSError as e:  # e.g. no room for the new file's inode
                        raise JournalError(e.errno, f"opening {self.dir / name}.jsonl: {e.strerror or e}") from e
                size = j.size
                j.append(b"".join(chunk))
                done.append((j, size))
        except JournalError:
            for j, size in done:
                j.cut(size)
            raise

    def _take_back(self, n: int) -> None:
        """Remove the nodes added since the tree held `n` (their lines never reached a file)."""
        while len(self.tree.nodes) > n:
            node = self.tree.nodes.pop()
            table = self.tree.nodes[node.parent].children if node.parent >= 0 else self.tree.roots
            del table[(node.kind, node.key)]

    def sync(self) -> None:
        """fsync every record written so far (the folder's entries too); the coordinator calls
        it at checkpoints. Works after close(). Raises JournalError when the disk refuses."""
        if self.dir is None:
            return
        for j in self._journals.values():
            j.sync()
        if not self._synced_dir:  # (each new file's entry in the folder: Journal.sync)
            sync_dir(self.dir.parent)  # executions/: the execution's own folder entry
            self._synced_dir = True

    def close(self) -> None:
        self.closed = True
        # No call comes after this: the memos of recent requests (whole rendered histories)
        # go; the tree and the records stay until the execution is trained.
        self._segmenter.recent.clear()
        self.parse_memo.recent.clear()
        self._sent.clear()
        try:
            self._write("meta", {"event": "closed", "t": time.time(), "leaf_roles": self.leaf_roles,
                                 "tree": self.tree.stats(), "refusals": self.refusals,
                                 "refused_last": self.refused_last, "last_refusal": self.last_refusal})
        except JournalError as e:  # a summary only (the tree and calls are on file): not worth failing an end for
            log.warning("execution %s: its closing summary was not written: %s", self.id, e)
        for j in self._journals.values():
            j.close()  # kept: sync() still reaches the files


def output_parser(tok: ChatTokenizer, req: ChatRequest, new_call_id: Callable[[], str]) -> OutputParser:
    """A call's output parser as the server wires it: the tokenizer's stop tokens and tool-call
    tags, the client's stop strings, tool-call ids from `new_call_id` (the API's)."""
    return OutputParser(tok.decode, stop_token_ids=tok.stop_token_ids, tool_open=tok.tool_call_open,
                        tool_close=tok.tool_call_close, new_call_id=new_call_id, stop_strings=req.stop)


def parsed_result(parser: OutputParser, req: ChatRequest, response_id: str, finish: str, prompt_tokens: int,
                  kept: int) -> ChatResult:
    """A call's answer from its parsed output: finish_reason tool_calls when it made any, else
    the engine's `finish`; `kept` the output tokens that count (OutputParser.kept)."""
    return ChatResult(id=response_id, model=req.model, content=parser.content, tool_calls=list(parser.tool_calls),
                      finish_reason="tool_calls" if parser.tool_calls else finish, usage=Usage(prompt_tokens, kept))


def _dumps(obj: Any) -> bytes:
    return orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY) + b"\n"


def new_key() -> str:
    return "gyre-" + secrets.token_urlsafe(24)
