"""A scripted test policy: an engine stand-in that emits chosen outputs as token ids.

The tiny model cannot drive an agent, so protocol tests replace the *engine* (only the
engine) with this responder; rendering, TITO records, the tree and the role rules stay
real. Outputs are written in the model's chat format (`<tool_call>{json}</tool_call>`,
then the stop token) and streamed a few tokens per step. Lives under tests/, never in the
product path.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Out:
    rid: str
    token_ids: list[int]
    logprobs: list[float]
    version: int
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0


def tool_call(name: str, **arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


@dataclass
class ScriptedEngine:
    tokenizer: object
    script: list[str] | Callable[[str], str] = field(default_factory=list)
    tokens_per_step: int = 3
    version: int = 0
    hold: bool = False  # keep requests open (never finish) until released
    final_reason: str = "stop"  # the finish reason of a completed output ("length": as if cut at max tokens)
    gate: threading.Event | None = None  # when given, no token comes out until it is set (a slow engine)
    refuse: str | None = None  # a prompt containing this text is refused (ValueError), as an engine refuses
    stalls: dict[int, float] = field(default_factory=dict)  # output position -> seconds the engine goes silent there
    prompts: list[list[int]] = field(default_factory=list)

    def __post_init__(self):
        self._running: dict[str, list] = {}
        self.aborted: list[str] = []
        self.abort_seen = threading.Event()
        self.stop_id = self.tokenizer.encode("<|im_end|>")[0]

    @property
    def running(self) -> int:
        return len(self._running)

    def next_output(self, prompt_text: str) -> str:
        if callable(self.script):
            return self.script(prompt_text)
        return self.script.pop(0) if self.script else "Done."

    def add_request(self, rid, prompt_ids, params) -> None:
        prompt = self.tokenizer.decode(prompt_ids)
        if self.refuse is not None and self.refuse in prompt:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens refused")
        self.prompts.append(list(prompt_ids))
        text = self.next_output(prompt)
        ids = self.tokenizer.encode(text) + [self.stop_id]
        self._running[rid] = [ids, 0, len(prompt_ids)]

    def step(self) -> list[Out]:
        if self.gate is not None and not self.gate.wait(0.01):
            return []
        outs = []
        for rid, st in list(self._running.items()):
            ids, pos, n_prompt = st
            if self.hold and pos + self.tokens_per_step >= len(ids):
                continue
            for at in [a for a in self.stalls if pos <= a < pos + self.tokens_per_step]:
                threading.Event().wait(self.stalls.pop(at))  # a slow engine: nothing comes out meanwhile
            chunk = ids[pos:pos + self.tokens_per_step]
            st[1] = pos + len(chunk)
            done = st[1] >= len(ids)
            if done:
                del self._running[rid]
            outs.append(Out(rid, chunk, [-0.25] * len(chunk), self.version, done,
                            self.final_reason if done else None, n_prompt))
        return outs

    def abort(self, rid):
        self.aborted.append(rid)
        self.abort_seen.set()
        st = self._running.pop(rid, None)
        return None if st is None else Out(rid, [], [], self.version, True, "abort", st[2])
