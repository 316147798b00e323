"""parser.py: turns sampled token ids into what the harness sees, as they arrive.

Tokens are detokenised incrementally (each new token costs a decode of a few tokens, never
of the whole output; an incomplete UTF-8 tail waits for the token that completes it). A
Hermes/Qwen `<tool_call>{json}</tool_call>` block is found in the decoded *text* (the tags
are single tokens in Qwen's vocabulary and several pieces in most others) and streams as it
is generated: `ToolCallStart` once `{"name": "...", "arguments": {` has been read, the
arguments' exact text in `ToolArgsDelta` pieces (holding back what may be the outer brace
or the start of `</tool_call>`), `ToolCallEnd` at the close. A started call stays a call
whatever follows: arguments that end malformed are counted in `invalid_tool_calls` (each
API then shows them its own way). A block that never names a function that way is judged
whole at its close, and returned as plain text when it is not a call (never a 500).

Stop strings end the output where the client's text ends: the token in which a stop string
begins is dropped whole, with everything after it, so the text returned is exactly the
decoding of the tokens kept (`kept`), which the caller records. What that token carried
before the stop string is therefore not returned either (the recorded output and the reply
stay the same tokens: the next prompt then continues what the harness really has). Text is
held back by whole tokens while it could still begin a stop string. One exception: a stop
string that begins in the token closing a tool call keeps that token (the call stands); the
record then holds the stop string's first characters, which the reply does not. Not the
recorder: the caller records `ids[:kept]`.
"""

from __future__ import annotations

import json
import re
from collections import deque
from collections.abc import Callable

from gyre.proxy.types import Delta, TextDelta, ToolArgsDelta, ToolCall, ToolCallDelta, ToolCallEnd, ToolCallStart

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"


class IncrementalDecoder:
    """Text of a growing token sequence, a piece per token, decoding a short window each time
    (vLLM's prefix/read offsets): the window keeps the previous token, so decoders that
    strip a leading space at the start of a sequence (SentencePiece's) do so only once.

    While the text ends in U+FFFD a character may still be incomplete, so it is held. Held
    past MAX_PENDING tokens (no UTF-8 character spans more: every token is a byte or more),
    the bytes are invalid; what of them is settled comes out: the text up to the latest cut
    among the last three tokens where decoding the two sides apart gives the same text as
    decoding them together. A cut like that is a boundary of the lossy decoding's maximal
    subparts, and bytes appended later can only extend the last subpart, after the cut: the
    streamed pieces always join to the decoding of the whole sequence, at bounded work."""

    MAX_PENDING = 4  # tokens held for an incomplete character (a UTF-8 character is <= 4 bytes)

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self.ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # tokens whose text has been returned

    def push(self, token: int) -> str:
        """The new text once `token` is appended ("" while a UTF-8 character may be incomplete)."""
        self.ids.append(token)
        before = self._decode(self.ids[self._prefix:self._read])
        now = self._decode(self.ids[self._prefix:])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            # Context for the next window: the last token (its text is settled: no U+FFFD ends it).
            self._prefix, self._read = len(self.ids) - 1, len(self.ids)
            return now[len(before):]
        if len(self.ids) - self._read > self.MAX_PENDING:
            return self._settle(before, now)
        return ""

    def _settle(self, before: str, now: str) -> str:
        window = self.ids[self._prefix:]
        for cut in range(len(window) - 1, max(len(window) - 4, self._read - self._prefix), -1):
            head = self._decode(window[:cut])
            if len(head) > len(before) and head + self._decode(window[cut:]) == now:
                at = self._prefix + cut
                self._prefix, self._read = at - 1, at
                return head[len(before):]
        if len(window) > 3 * self.MAX_PENDING:  # a decoder whose pieces never join (not byte-level): bound the work
            self._prefix, self._read = len(self.ids) - 1, len(self.ids)
            return now[len(before):]
        return ""  # no settled cut yet (a maximal invalid subpart is <= 3 bytes: one comes soon)

    def flush(self) -> str:
        """What is still held (an incomplete character at the end is returned as U+FFFD)."""
        if self._read == len(self.ids):
            return ""
        before = self._decode(self.ids[self._prefix:self._read])
        now = self._decode(self.ids[self._prefix:])
        self._prefix = self._read = len(self.ids)
        return now[len(before):]


class OutputParser:
    def __init__(self, decode: Callable[[list[int]], str], *, stop_token_ids: frozenset[int],
                 new_call_id: Callable[[], str], stop_strings: list[str] | None = None,
                 tool_open: str = TOOL_OPEN, tool_close: str = TOOL_CLOSE):
        self._decoder = IncrementalDecoder(decode)
        self._stop_ids = stop_token_ids
        self._open, self._close = tool_open, tool_close
        self._new_id = new_call_id
        self._stops = [s for s in (stop_strings or []) if s]
        self._stop_hold = max((len(s) for s in self._stops), default=1) - 1
        self._n = 0  # tokens fed
        self._pending_tok = 0  # the first token whose text the decoder has not returned yet
        self._text = ""  # decoded text outside a tool call, not yet emitted
        self._base = 0  # offset of _text[0] in the whole decoded output
        self._starts: deque[tuple[int, int]] = deque()  # (offset, token) where each token's text begins
        self._call: str | None = None  # text inside <tool_call> ... </tool_call>, while open
        self._started: dict | None = None  # the open call, once its start went out (see _stream_call)
        self._index = -1  # the output token being fed
        self._floor = 0  # tokens a stop string may not cut into: through the one closing the last tool call
        self.content = ""
        self.tool_calls: list[ToolCall] = []
        self.invalid_tool_calls = 0
        self.invalid_call_ids: set[str] = set()  # started calls whose arguments ended malformed
        self.stopped = False  # a stop string matched: the caller aborts generation
        self.kept: int | None = None  # after a stop string: how many output tokens to record

    def feed(self, ids: list[int]) -> list[Delta]:
        out: list[Delta] = []
        for t in ids:
            if self.stopped:
                break
            index, self._n = self._n, self._n + 1
            self._index = index
            if t in self._stop_ids:
                if self._pending_tok == index:  # nothing held by the decoder: text resumes after it
                    self._pending_tok = index + 1
                continue
            piece = self._decoder.push(t)
            if piece:
                out += self._take(piece, self._pending_tok)
                self._pending_tok = index + 1
        if not self.stopped:
            out += self._emit(final=False)
        return out

    def finish(self) -> list[Delta]:
        """End of output: flush held text; an unclosed tool call is returned as text."""
        out: list[Delta] = []
        if not self.stopped:
            piece = self._decoder.flush()
            if piece:
                out += self._take(piece, self._pending_tok)
        if self.stopped:
            return out
        if self._call is not None:
            body, self._call = self._call, None
            if self._started is not None:  # it streamed: it ends as a call, malformed
                st, self._started = self._started, None
                args = body[st["from"]:]
                if len(args) > st["sent"]:
                    out.append(ToolArgsDelta(st["index"], args[st["sent"]:]))
                return out + [self._end_call(st, args, False)]
            self.invalid_tool_calls += 1
            return out + self._text_delta(self._open + body)
        return out + self._emit(final=True)

    # --- text outside tool calls --------------------------------------------------------

    def _take(self, piece: str, token: int) -> list[Delta]:
        """New decoded text, which began in output token `token`."""
        if self._call is not None:
            return self._in_call(piece)
        self._starts.append((self._base + len(self._text), token))
        longest = max([len(self._open), *(len(x) for x in self._stops)])
        scan = max(0, len(self._text) - longest + 1)  # earlier text was searched already
        self._text += piece
        found = [(at, x) for x in self._stops if (at := self._text.find(x, scan)) >= 0]
        stop = min(found)[0] if found else -1
        tag = self._text.find(self._open, scan)
        if stop >= 0 and (tag < 0 or stop < tag):
            return self._stop_at(stop)
        if tag < 0:
            return []
        after = self._text[tag + len(self._open):]
        self._text = self._text[:tag]
        out = self._emit(final=True)
        self._base += len(self._open)
        self._starts.clear()
        self._call = ""
        return out + self._in_call(after)

    def _stop_at(self, at: int) -> list[Delta]:
        """A stop string begins at `at` in the held text: keep the tokens before the one it
        begins in and return their held text (held whole tokens at a time, see _emit)."""
        where = self._base + at
        offset, token = self._starts[0]
        for o, t in self._starts:
            if o > where:
                break
            offset, token = o, t
        self.stopped = True
        if token < self._floor:
            # The stop string begins in the token that closed a tool call (SmolLM2 has `>.`):
            # that token is kept, the call stands, and only its text before the stop is returned.
            self.kept, offset = self._floor, where
        else:
            self.kept = token
        text, self._text = self._text[:max(0, offset - self._base)], ""
        return self._text_delta(text)

    def _emit(self, final: bool) -> list[Delta]:
        """Emit the held text that can no longer begin the tool tag or a stop string."""
        n = cut = len(self._text)
        if not final:
            for k in range(min(len(self._open) - 1, n), 0, -1):  # a partial "<tool_call>" waits
                if self._text.endswith(self._open[:k]):
                    cut = n - k
                    break
            if self._stops:  # and whole tokens, while they could begin a stop string
                cut = min(cut, n - self._stop_hold)
                if cut < n:
                    cut = max((o - self._base for o, _ in self._starts if o - self._base <= cut), default=0)
        if cut <= 0:
            return []
        text, self._text = self._text[:cut], self._text[cut:]
        self._base += cut
        while self._starts and self._starts[0][0] < self._base:
            self._starts.popleft()
        return self._text_delta(text)

    def _text_delta(self, text: str) -> list[Delta]:
        if not text:
            return []
        self.content += text
        return [TextDelta(text)]

    # --- inside a tool call -------------------------------------------------------------

    def _in_call(self, piece: str) -> list[Delta]:
        scan = max(0, len(self._call) - len(self._close) + 1)
        self._call += piece
        end = self._call.find(self._close, scan)
        if end < 0:
            return self._stream_call(self._call, final=False)
        body, rest = self._call[:end], self._call[end + len(self._close):]
        self._call = None
        self._floor = self._index + 1
        out = self._stream_call(body, final=True) if self._started is not None else self._close_call(body)
        self._started = None
        self._base += len(body) + len(self._close)
        return out + (self._take(rest, self._pending_tok) if rest else [])

    def _stream_call(self, text: str, *, final: bool) -> list[Delta]:
        """A call whose body begins `{"name": "...", "arguments": {` streams as it comes: the
        start once the name is known, then the arguments' text, holding back what may be
        the outer object's closing brace or the start of `</tool_call>`."""
        out: list[Delta] = []
        st = self._started
        if st is None:
            m = _HEADER.match(text)
            if m is None or not text[m.end():].lstrip():
                return out
            if text[m.end():].lstrip()[0] != "{":
                return out  # arguments as a JSON string, or odd: judged whole at the close
            st = self._started = {"index": len(self.tool_calls), "id": self._new_id(),
                                  "name": json.loads(f'"{m.group(1)}"'), "from": m.end(), "sent": 0}
            out.append(ToolCallStart(st["index"], st["id"], st["name"]))
        args = text[st["from"]:]
        if final:
            stripped = args.rstrip()
            args = stripped[:-1] if stripped.endswith("}") else args  # the outer object's brace
        else:
            for k in range(min(len(self._close) - 1, len(args)), 0, -1):
                if args.endswith(self._close[:k]):
                    args = args[:-k]
                    break
            args = args.rstrip()
            args = args[:-1] if args.endswith("}") else args
        if len(args) > st["sent"]:
            out.append(ToolArgsDelta(st["index"], args[st["sent"]:]))
            st["sent"] = len(args)
        if final:
            out.append(self._end_call(st, args, _is_call(text)))
        return out

    def _end_call(self, st: dict, args: str, body_ok: bool) -> ToolCallEnd:
        try:
            valid = body_ok and isinstance(json.loads(args), dict)
        except ValueError:
            valid = False
        if not valid:
            self.invalid_tool_calls += 1
            self.invalid_call_ids.add(st["id"])
        call = ToolCall(id=st["id"], name=st["name"], arguments=args)
        self.tool_calls.append(call)
        return ToolCallEnd(st["index"], call, valid)

    def _close_call(self, body: str) -> list[Delta]:
        """A call that never streamed: judged whole; a malformed one is returned as text."""
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
            return self._text_delta(f"{self._open}{body}{self._close}")
        call = ToolCall(id=self._new_id(), name=obj["name"], arguments=json.dumps(args, ensure_ascii=False))
        self.tool_calls.append(call)
        return [ToolCallDelta(len(self.tool_calls) - 1, call)]


# `{"name": "...", "arguments": ` at the start of a Hermes call's body (JSON escapes allowed in the name)
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


def _is_call(body: str) -> bool:
    try:
        obj = json.loads(body)
    except ValueError:
        return False
    return isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get("arguments"), dict)
