"""jsonprefix.py: how much of a growing JSON object text can be sent as it arrives.

Anthropic clients parse `input_json_delta` fragments as they come (the SDKs' partial-JSON
parser throws on malformed text), so a tool call's arguments go out only up to the last
*safe point*: a position where closing what is open (a string's quote, then brackets)
gives valid JSON. If the model's arguments end malformed, the client is sent those
closers at the last safe point instead of the rest: it sees valid, truncated input. Pure
and incremental: `feed` costs time proportional to the new text. Not a JSON parser of
values: json.loads judges the finished text.
"""

from __future__ import annotations

import re

_WS = " \t\n\r"
_LITERALS = ("true", "false", "null")


class JsonPrefix:
    def __init__(self) -> None:
        self.text = ""
        self.safe = 0  # the longest prefix that `closers()` turns into valid JSON
        self.failed = False  # the text can no longer be a prefix of one JSON object
        self._stack: list[str] = []  # open containers: "{" or "["
        self._state = "start"
        self._key = False  # the open string is an object key
        self._esc = 0  # inside a string: 1 after a backslash, 2..5 inside \\uXXXX
        self._tok = ""  # a number or literal being read
        self._safe_closers = ""

    @property
    def complete(self) -> bool:
        """One whole object was read (whitespace after it allowed)."""
        return not self.failed and self._state == "done"

    def closers(self) -> str:
        """What to append to text[:safe] for valid JSON ("" when the object is complete)."""
        return self._safe_closers

    def feed(self, piece: str) -> None:
        """Scan more text; after a failure nothing more is read (`text` stops there)."""
        for ch in piece:
            if self.failed:
                return
            self._step(ch)
            if self.failed:
                return
            self.text += ch
            closers = self._closers_here()
            if closers is not None:
                self.safe, self._safe_closers = len(self.text), closers

    # --- the scanner --------------------------------------------------------------------

    def _fail(self) -> None:
        self.failed = True

    def _closers_here(self) -> str | None:
        """Closers if the text so far ends at a safe point, else None."""
        if self.failed:
            return None
        end = "".join("}" if c == "{" else "]" for c in reversed(self._stack))
        s = self._state
        if s == "done":
            return ""
        if s == "string":
            return None if self._key or self._esc else '"' + end
        if s == "number":
            return end if _number_complete(self._tok) else None
        if s in ("after_value", "object_first"):
            return end
        if s == "value" and self._stack and self._stack[-1] == "[" and self.text.rstrip(_WS).endswith("["):
            return end  # right after "[": an empty array
        return None

    def _step(self, ch: str) -> None:
        s = self._state
        if s == "string":
            self._string_char(ch)
        elif s == "number":
            if ch in "0123456789+-.eE":
                self._tok += ch
                if not _number_prefix(self._tok):
                    self._fail()
            else:
                if not _number_complete(self._tok):
                    return self._fail()
                self._state = "after_value"
                self._step(ch)
        elif s == "literal":
            self._tok += ch
            if not any(lit.startswith(self._tok) for lit in _LITERALS):
                return self._fail()
            if self._tok in _LITERALS:
                self._value_done()
        elif ch in _WS:
            return
        elif s == "start":
            if ch != "{":
                return self._fail()
            self._open("{")
        elif s == "done":
            self._fail()
        elif s in ("value", "value_or_end"):
            if ch == "]" and s == "value_or_end":
                self._close("]")
            else:
                self._value_start(ch)
        elif s in ("object_first", "key"):
            if ch == '"':
                self._state, self._key = "string", True
            elif ch == "}" and s == "object_first":
                self._close("}")
            else:
                self._fail()
        elif s == "colon":
            if ch != ":":
                return self._fail()
            self._state = "value"
        elif s == "after_value":
            if ch == ",":
                self._state = "key" if self._stack[-1] == "{" else "value"
            elif ch in "}]" and self._stack and ch == ("}" if self._stack[-1] == "{" else "]"):
                self._close(ch)
            else:
                self._fail()

    def _value_start(self, ch: str) -> None:
        if ch == '"':
            self._state, self._key = "string", False
        elif ch in "{[":
            self._open(ch)
        elif ch in "-0123456789":
            self._state, self._tok = "number", ch
        elif ch in "tfn":
            self._state, self._tok = "literal", ch
        else:
            self._fail()

    def _string_char(self, ch: str) -> None:
        if self._esc == 1:
            if ch == "u":
                self._esc = 2
            elif ch in '"\\/bfnrt':
                self._esc = 0
            else:
                self._fail()
        elif self._esc >= 2:
            if ch not in "0123456789abcdefABCDEF":
                return self._fail()
            self._esc = 0 if self._esc == 5 else self._esc + 1
        elif ch == "\\":
            self._esc = 1
        elif ch == '"':
            if self._key:
                self._state, self._key = "colon", False
            else:
                self._value_done()
        elif ord(ch) < 0x20:
            self._fail()  # a raw control character inside a string

    def _open(self, ch: str) -> None:
        self._stack.append(ch)
        self._state = "object_first" if ch == "{" else "value_or_end"

    def _close(self, ch: str) -> None:
        self._stack.pop()
        self._value_done()

    def _value_done(self) -> None:
        self._state = "after_value" if self._stack else "done"


_NUMBER_PREFIX = re.compile(r"-|-?(0|[1-9]\d*)(\.\d*)?([eE][+-]?\d*)?")
_NUMBER = re.compile(r"-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?")


def _number_prefix(tok: str) -> bool:
    return _NUMBER_PREFIX.fullmatch(tok) is not None


def _number_complete(tok: str) -> bool:
    return _NUMBER.fullmatch(tok) is not None
