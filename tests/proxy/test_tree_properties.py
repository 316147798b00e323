"""Property tests of the trajectory processor: token round trips through random
conversations (tool calls re-serialised, compaction, sub-agents) and admission."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gyre.proxy.admission import admit, materialise
from gyre.proxy.recorder import Recorder
from gyre.proxy.roles import PRIORITY, GenericRule
from gyre.proxy.tree import Tree
from gyre.proxy.types import ChatRequest, Message, ToolCall, ToolSpec

TOOLS = [ToolSpec("write_file", "Write", {"type": "object"}), ToolSpec("read_file", "Read", {"type": "object"})]
texts = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)
args = st.dictionaries(st.sampled_from(["path", "content", "mode", "n"]),
                       st.one_of(texts, st.integers(-5, 10**6), st.floats(allow_nan=False, allow_infinity=False)),
                       max_size=3)
output = st.one_of(st.tuples(st.just("text"), texts),
                   st.tuples(st.just("tools"), st.lists(st.tuples(st.sampled_from(["write_file", "read_file"]), args),
                                                         min_size=1, max_size=2)))
action = st.one_of(st.tuples(st.just("main"), output), st.tuples(st.just("sub"), output),
                   st.just(("compact", None)), st.tuples(st.just("inject"), texts))


def model_text(out) -> str:
    kind, body = out
    if kind == "text":
        return body
    return "".join(f'<tool_call>\n{json.dumps({"name": n, "arguments": a})}\n</tool_call>' for n, a in body)


def reserialise(arguments: str, rng: random.Random) -> str:
    """What harnesses do to arguments: re-parse and dump with other key order and spacing."""
    obj = json.loads(arguments)
    return json.dumps(obj, sort_keys=rng.random() < 0.5, indent=rng.choice([None, 1]), separators=rng.choice(
        [None, (",", ":")]))


class Harness:
    def __init__(self, tok, system: str):
        self.tok = tok
        self.messages = [Message("system", system), Message("user", "Begin the task.")]
        self.last: tuple[list[int], list[int]] | None = None  # (prompt, output) of our last call
        self.last_path: list[int] = []  # its prompt path and output node


def run_call(ex: Recorder, tok, h: Harness, out, rng: random.Random, checks: list):
    req = ChatRequest(api="openai", model="m", messages=list(h.messages), tools=TOOLS)
    prep = ex.prepare(req, {})
    # The prompt is exactly the tree's tokens on the path...
    assert prep.prompt_ids.tolist() == ex.tree.tokens(prep.path)
    # ...and a request repeating the history starts with the recorded prompt + output, verbatim,
    # on the recorded path through the recorded output itself (not a copy of it on a branch).
    if h.last is not None:
        p, o = h.last
        checks.append(prep.prompt_ids[: len(p) + len(o)].tolist() == p + o)
        checks.append(prep.path[: len(h.last_path)] == h.last_path)
    ids = tok.encode(model_text(out)) + tok.encode("<|im_end|>")
    result, _ = ex.record_reply(req, ids, prep=prep)
    h.last = (prep.prompt_ids.tolist(), ids)
    h.last_path = [*prep.path, ex.calls[-1]["output_node"]]
    calls = [ToolCall(c.id, c.name, reserialise(c.arguments, rng)) for c in result.tool_calls]
    h.messages.append(Message("assistant", result.content, tool_calls=calls))
    for c in calls:
        h.messages.append(Message("tool", f"result of {c.name}", tool_call_id=c.id))
    if not calls:
        h.messages.append(Message("user", "Continue."))
    return prep


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(actions=st.lists(action, min_size=1, max_size=12), seed=st.integers(0, 1000))
# An injected reply, then the model (main or sub-agent) writing the same text: the injected
# message, already recorded as text, must stay text, not turn into a copy of the later output
# (the first found by hypothesis; with equal texts the tokens agree but the path branched).
@example(actions=[("inject", "0"), ("main", ("text", "0 ")), ("main", ("text", ""))], seed=0)
@example(actions=[("inject", "0"), ("main", ("text", "0")), ("main", ("text", ""))], seed=0)
@example(actions=[("inject", "0"), ("main", ("text", "")), ("sub", ("text", "0 ")), ("main", ("text", ""))], seed=0)
def test_recorded_tokens_round_trip(any_tokenizer, actions, seed):
    """On the byte-level tokenizer and on BPEs with merges (tool tags single tokens or text)."""
    rng = random.Random(seed)
    tok = any_tokenizer
    ex = Recorder("x", "k", tok, GenericRule())
    main, sub = Harness(tok, "You are the main agent."), Harness(tok, "You are a sub-agent.")
    checks: list[bool] = []
    for kind, arg in actions:
        if kind == "main":
            run_call(ex, tok, main, arg, rng, checks)
        elif kind == "sub":
            run_call(ex, tok, sub, arg, rng, checks)
        elif kind == "compact":
            main.messages = [main.messages[0], Message("user", "This session is being continued. Summary: ...")]
            main.last = None
        else:  # the harness injects assistant text the model never produced
            main.messages += [Message("assistant", arg or "No response requested."), Message("user", "go on")]
            main.last = None
    assert all(checks)
    # Every recorded output is stored once, as a policy node; injected text never is.
    outputs = [n for n in ex.tree.nodes if n.kind == "output"]
    assert len([n for n in outputs if n.policy]) == len(ex.calls)
    roots = {ex.tree.nodes[ex.prompt_path(c)[0]].root: c["role"] for c in ex.calls}
    assert all((r == "main") == (root == 0) for root, r in roots.items() if r in ("main", "sub-agent"))


def test_compaction_and_subagent_shapes(chat_tokenizer):
    tok = chat_tokenizer
    ex = Recorder("x", "k", tok, GenericRule())
    rng = random.Random(0)
    main, sub = Harness(tok, "You are the main agent."), Harness(tok, "You are a sub-agent.")
    for _ in range(2):
        run_call(ex, tok, main, ("tools", [("write_file", {"path": "a"})]), rng, [])
    run_call(ex, tok, sub, ("text", "sub report"), rng, [])
    # A summary request: the history plus an instruction; then a new context from the summary.
    main.messages.append(Message("user", "Summarize the conversation so far."))
    summary = run_call(ex, tok, main, ("text", "SUMMARY"), rng, [])
    main.messages = [main.messages[0], Message("user", "This session is being continued. Summary: SUMMARY"),
                     Message("assistant", "No response requested."), Message("user", "go")]
    main.last = None
    after = run_call(ex, tok, main, ("text", "ok"), rng, [])
    roles = [c["role"] for c in ex.calls]
    assert roles == ["main", "main", "sub-agent", "main-summary", "main"]
    assert len(ex.tree.roots) == 2  # the sub-agent's own system prompt is its own root
    # The summary branches off the main path; the continued context shares only the system node.
    assert summary.path[0] == after.path[0] and ex.tree.nodes[summary.path[0]].root == 0
    assert summary.path[1] != after.path[1]
    injected = [n for n in ex.tree.nodes if "No response requested." in tok.decode(n.tokens.tolist())]
    assert injected and not any(n.policy for n in injected)
    assert sorted(ex.leaf_roles.values()) == ["main", "main-summary", "sub-agent"]


# --- admission --------------------------------------------------------------------------

@st.composite
def trees(draw):
    tree = Tree()
    for i in range(draw(st.integers(1, 30))):
        parent = draw(st.integers(-1, len(tree.nodes) - 1))
        n = draw(st.integers(1, 20))
        if draw(st.booleans()):
            tree.add_output(parent, f"c{i}", [1] * n, [-1.0] * n, [0] * n)
        else:
            tree.add_text(parent, f"t{i}", [2] * n, f"c{i}")
    roles = {leaf.id: draw(st.sampled_from([*PRIORITY, "side"])) for leaf in tree.leaves()}
    return tree, roles


@settings(max_examples=200, deadline=None)
@given(data=trees(), j_max=st.one_of(st.none(), st.integers(1, 6)), seed=st.integers(0, 99))
def test_admission_properties(data, j_max, seed):
    tree, roles = data
    trajs = admit(tree, roles, j_max=j_max, rng=random.Random(seed))
    targets = [t.targets for t in trajs]
    # Disjoint, never more than j_max, only policy nodes, never on a side leaf.
    assert sum(len(t) for t in targets) == len(set().union(*targets)) if targets else True
    assert j_max is None or len(trajs) <= j_max
    assert all(tree.nodes[n].policy for t in targets for n in t)
    assert all(roles[t.leaf] != "side" for t in trajs)
    # Priority: when a trajectory was drawn, no higher-priority leaf had unmasked targets.
    masked: set[int] = set()
    for t in trajs:
        for leaf, role in roles.items():
            if role in PRIORITY and PRIORITY.index(role) < PRIORITY.index(t.role):
                assert not any(tree.nodes[n].policy and n not in masked for n in tree.path(leaf))
        masked.update(t.path)
    # Unlimited: every trainable token (policy, on a non-side leaf's path) is admitted exactly once.
    if j_max is None:
        trainable = {n for leaf, r in roles.items() if r != "side" for n in tree.path(leaf) if tree.nodes[n].policy}
        assert set().union(*targets) == trainable if targets else not trainable
    rows = materialise(tree, trajs)
    assert rows.targets == sum(t.target_tokens(tree) for t in trajs)
    assert all(len(a) == len(b) == len(c) for a, b, c in zip(rows.input_ids, rows.target_mask, rows.behaviour_logprobs))
    if rows.targets:
        assert rows.loss_weight == pytest.approx(1 / rows.targets)
