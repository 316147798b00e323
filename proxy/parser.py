"""parser.py: turns sampled token ids into what the harness sees, as they arrive.

Text streams out as it decodes (an incomplete UTF-8 tail is held back); a Hermes/Qwen
`<tool_call>{json}</tool_call>` block becomes one tool call when it closes. A block whose
body is not a JSON object with a string `name` is returned as plain text (never a 500),
and counted in `invalid_tool_calls`. Stop strings end the output. Not the recorder: the
tokens themselves are recorded untouched by the caller.
"""

from __future__ import annotations

import json
from typing import Callable

from gyre.proxy.types import Delta, TextDelta, ToolCall, ToolCallDelta


class OutputParser:
    def __init__(self, decode: Callable[[list[int]], str], *, stop_token_ids: frozenset[int],
                 tool_open: int | None, tool_close: int | None, new_call_id: Callable[[], str],
                 stop_strings: list[str] | None = None):
        self._decode = decode
        self._stop_ids = stop_token_ids
        self._open, self._close = tool_open, tool_close
        self._new_id = new_call_id
        self._stops = [s for s in (stop_strings or []) if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._text_ids: list[int] = []  # current run of text tokens
        self._run_emitted = 0  # chars of the current run already accounted for
        self._pending = ""  # decoded text not yet emitted (held back for stop strings)
        self._call_ids: list[int] | None = None  # inside <tool_call> ... </tool_call>
        self.content = ""
        self.tool_calls: list[ToolCall] = []
        self.invalid_tool_calls = 0
        self.stopped = False  # a stop string matched: the caller aborts generation

    def feed(self, ids: list[int]) -> list[Delta]:
        out: list[Delta] = []
        for t in ids:
            if self.stopped:
                break
            if t in self._stop_ids:
                continue
            if self._call_ids is not None:
                if t == self._close:
                    out += self._close_call()
                else:
                    self._call_ids.append(t)
            elif t == self._open and self._open is not None:
                out += self._flush_text(final=True)
                self._call_ids = []
            else:
                self._text_ids.append(t)
        out += self._flush_text(final=False)
        return out

    def finish(self) -> list[Delta]:
        """End of output: flush held text; an unclosed tool call is returned as text."""
        out = self._flush_text(final=True)
        if self._call_ids is not None and not self.stopped:
            out += self._emit_text("<tool_call>" + self._decode(self._call_ids), final=True)
            self.invalid_tool_calls += 1
            self._call_ids = None
        return out

    def _flush_text(self, final: bool) -> list[Delta]:
        if not self._text_ids:
            return self._emit_text("", final) if final else []
        text = self._decode(self._text_ids)
        safe = text if final else text.rstrip("\ufffd")  # hold an incomplete UTF-8 tail
        new = safe[self._run_emitted:]
        self._run_emitted = len(safe)
        if final:
            self._text_ids, self._run_emitted = [], 0
        return self._emit_text(new, final)

    def _emit_text(self, new: str, final: bool) -> list[Delta]:
        self._pending += new
        for s in self._stops:
            at = self._pending.find(s)
            if at >= 0:
                self._pending = self._pending[:at]
                self.stopped = True
        cut = len(self._pending) if final or self.stopped else max(0, len(self._pending) - self._hold)
        text, self._pending = self._pending[:cut], self._pending[cut:]
        if not text:
            return []
        self.content += text
        return [TextDelta(text)]

    def _close_call(self) -> list[Delta]:
        body = self._decode(self._call_ids)
        self._call_ids = None
        try:
            obj = json.loads(body)
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                raise ValueError("not a {name, arguments} object")
            args = obj.get("arguments", {})
            if isinstance(args, str):
                args = json.loads(args)
            if not isinstance(args, dict):
                raise ValueError("arguments is not an object")
        except ValueError:
            self.invalid_tool_calls += 1
            return self._emit_text(f"<tool_call>{body}</tool_call>", final=True)
        call = ToolCall(id=self._new_id(), name=obj["name"], arguments=json.dumps(args, ensure_ascii=False))
        self.tool_calls.append(call)
        return [ToolCallDelta(len(self.tool_calls) - 1, call)]
