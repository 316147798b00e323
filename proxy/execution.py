"""execution.py: one execution's recorder: its tree, its calls, its files in the run dir.

`prepare()` turns a parsed request into the exact prompt token ids (recorded tokens for
the matched prefix, fresh tokens only for new segments) and `complete()` records the
model's output as a policy node with its behaviour log-probs and versions. Recorded
outputs are found again by tool-call id (the harness may re-serialise the arguments) or
by their text. Not HTTP and not the engine: server.py drives both.
"""

from __future__ import annotations

import random
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import orjson

from gyre.proxy.admission import Rows, Trajectory, admit, materialise
from gyre.proxy.chat import ChatTokenizer, Ref
from gyre.proxy.roles import CallInfo, RoleRule
from gyre.proxy.tree import Node, Tree
from gyre.proxy.types import ChatRequest, ChatResult


@dataclass(slots=True)
class Prepared:
    call_id: str
    path: list[int]
    prompt_ids: list[int]
    new_tokens: int  # prompt tokens that had to be encoded for this call
    role: str
    t_start: float


@dataclass(slots=True)
class _Output:
    node: int
    content: str
    tool_call_ids: list[str]


@dataclass
class Execution:
    id: str
    key: str
    tokenizer: ChatTokenizer
    rule: RoleRule
    dir: Path | None = None
    tree: Tree = field(default_factory=Tree)
    calls: list[dict] = field(default_factory=list)
    closed: bool = False

    def __post_init__(self) -> None:
        self._outputs: dict[str, _Output] = {}
        self._by_tool_id: dict[str, str] = {}
        self._by_text: dict[str, list[str]] = {}
        self._args: dict[str, str] = {}  # tool-call id -> arguments exactly as we emitted them
        self._first_model: str | None = None
        self._first_root_tools = False
        self._n_calls = 0
        self._files: dict[str, IO[bytes]] = {}
        self._roles: dict[int, str] = {}  # node -> role of the call that ended there
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)

    # --- a call's prompt ----------------------------------------------------------------

    def prepare(self, req: ChatRequest, headers: dict[str, str]) -> Prepared:
        self._n_calls += 1
        call_id = f"{self.id}-c{self._n_calls:05d}"
        candidates = self._resolve_outputs(req)
        segments = self.tokenizer.segments(req.messages, req.tools, {i: str(i) for i in candidates},
                                           restore_args=self._args)
        parent, path, new_tokens, strip = -1, [], 0, None
        for seg in segments:
            if isinstance(seg, Ref):
                node = self._place_output(parent, candidates[int(seg.key)], call_id)
                last = node.tokens[-1] if node.tokens else None
                strip = self.tokenizer.token_text(last) if last in self.tokenizer.stop_token_ids else None
            else:
                text = seg.text
                if strip and text.startswith(strip):  # the template re-closes a turn the output closed
                    text = text[len(strip):]
                strip = None
                if not text:
                    continue
                nid = self.tree.child(parent, "text", text)
                if nid is None:
                    tokens = self.tokenizer.encode(text)
                    node = self._write_node(self.tree.add_text(parent, text, tokens, call_id))
                    new_tokens += len(tokens)
                else:
                    node = self.tree.nodes[nid]
            path.append(node.id)
            parent = node.id
        if not path:
            raise ValueError("the request renders to an empty prompt")
        role = self._classify(req, headers, self.tree.nodes[path[0]].root)
        return Prepared(call_id, path, self.tree.tokens(path), new_tokens, role, time.time())

    def _resolve_outputs(self, req: ChatRequest) -> dict[int, list[str]]:
        """Assistant messages that are our recorded outputs: message index -> call ids
        (most recent first), by tool-call id, else by text."""
        found: dict[int, list[str]] = {}
        for i, m in enumerate(req.messages):
            if m.role != "assistant":
                continue
            if m.tool_calls:
                owners = {self._by_tool_id.get(c.id) for c in m.tool_calls}
                if len(owners) == 1 and None not in owners:
                    found[i] = [owners.pop()]
            elif m.content.strip() in self._by_text:
                found[i] = self._by_text[m.content.strip()][::-1]
        return found

    def _place_output(self, parent: int, call_ids: list[str], call_id: str) -> Node:
        for cid in call_ids:  # recorded under this very context: the policy node itself
            nid = self.tree.child(parent, "output", cid)
            if nid is not None:
                return self.tree.nodes[nid]
        source = self.tree.nodes[self._outputs[call_ids[0]].node]
        return self._write_node(self.tree.add_output_copy(parent, source, call_id))

    def _classify(self, req: ChatRequest, headers: dict[str, str], root: int) -> str:
        if self._first_model is None:
            self._first_model, self._first_root_tools = req.model, bool(req.tools)
        last_user = next((m.content for m in reversed(req.messages) if m.role == "user"), "")
        return self.rule.classify(CallInfo(root=root, model=req.model, has_tools=bool(req.tools),
                                           last_user=last_user, first_model=self._first_model,
                                           first_root_has_tools=self._first_root_tools, headers=headers))

    # --- a call's output ----------------------------------------------------------------

    def complete(self, prep: Prepared, *, output_ids: list[int], logprobs: list[float], versions: list[int],
                 finish_reason: str, status: str, engine: str, result: ChatResult | None,
                 request: ChatRequest, invalid_tool_calls: int = 0) -> dict:
        """Record the call. Only a call that ended normally leaves a trainable output."""
        parent = prep.path[-1]
        leaf = parent
        out_node = None
        if output_ids:
            node = self.tree.add_output(parent, prep.call_id, list(output_ids), list(logprobs), list(versions))
            node.policy = status == "ok"
            self._write_node(node)
            out_node, leaf = node.id, node.id
            if result is not None and status == "ok":
                ids = [c.id for c in result.tool_calls]
                self._outputs[prep.call_id] = _Output(node.id, result.content, ids)
                for c in result.tool_calls:
                    self._by_tool_id[c.id] = prep.call_id
                    self._args[c.id] = c.arguments
                if not ids:
                    self._by_text.setdefault(result.content.strip(), []).append(prep.call_id)
        self._roles[leaf] = prep.role
        record = {
            "call_id": prep.call_id, "execution": self.id, "api": request.api, "model": request.model,
            "role": prep.role, "status": status, "finish_reason": finish_reason, "engine": engine,
            "t_start": prep.t_start, "t_end": time.time(), "stream": request.stream,
            "prompt_path": prep.path, "prompt_tokens": len(prep.prompt_ids), "new_prompt_tokens": prep.new_tokens,
            "output_node": out_node, "output_tokens": len(output_ids),
            "versions": sorted(set(versions)), "invalid_tool_calls": invalid_tool_calls,
            "tool_calls": [c.id for c in result.tool_calls] if result else [],
        }
        self.calls.append(record)
        self._write("calls", record)
        return record

    # --- training data ------------------------------------------------------------------

    @property
    def leaf_roles(self) -> dict[int, str]:
        """Role of each current leaf (a node later extended by another call is no leaf)."""
        return {n: r for n, r in self._roles.items() if not self.tree.nodes[n].children}

    def admit(self, j_max: int | None = 5, seed: int = 0) -> tuple[list[Trajectory], Rows]:
        trajectories = admit(self.tree, self.leaf_roles, j_max=j_max, rng=random.Random(seed))
        return trajectories, materialise(self.tree, trajectories)

    # --- files --------------------------------------------------------------------------

    def _write_node(self, node: Node) -> Node:
        self._write("nodes", {"id": node.id, "parent": node.parent, "kind": node.kind, "policy": node.policy,
                              "call_id": node.call_id, "tokens": node.tokens, "logprobs": node.logprobs,
                              "versions": node.versions, "key": node.key})
        return node

    def _write(self, name: str, obj: Any) -> None:
        if self.dir is None:
            return
        f = self._files.get(name)
        if f is None:
            f = self._files[name] = open(self.dir / f"{name}.jsonl", "ab")
        f.write(orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS) + b"\n")
        f.flush()

    def close(self) -> None:
        self.closed = True
        self._write("meta", {"event": "closed", "t": time.time(), "leaf_roles": self.leaf_roles,
                             "tree": self.tree.stats()})
        for f in self._files.values():
            f.close()
        self._files.clear()


def new_key() -> str:
    return "gyre-" + secrets.token_urlsafe(24)
