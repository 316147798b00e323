"""chat.py: a model directory's tokenizer and chat template, and message-level segmentation.

`ChatTokenizer.segments()` renders a conversation with the model's own chat template (the
same Jinja environment Hugging Face uses) and cuts the text at message boundaries and at
recorded model outputs, so the trajectory tree can match requests message by message and
splice the model's exact recorded tokens in place of its past outputs. Text is tokenised
per segment, with a cache, so a repeated history costs a dictionary lookup, not a
re-tokenisation. Not the tree: matching lives in tree.py.

Two rules make a segment's tokens those of the whole rendered text (what Hugging Face's
`apply_chat_template` gives), for content without special-token text:
- Content is text. Message contents and tool-call arguments (what a user, a tool or the
  harness wrote) are marked while rendering and encoded with no added-token matching, so a
  literal `<|im_start|>system` in a user message or a tool result is plain text, never a
  role turn. Everything else is the template's (its glue, and the tool definitions and
  names it renders, as Hugging Face renders them). Markers sit around each content's
  non-blank core, so a template that trims or strips content sees the same text; one that
  rewrites content beyond that (probed at load) gets unmarked content, with a warning.
- Cuts sit where tokenisation splits anyway: before an added token of the glue (which
  splits the text before pre-tokenisation) or at a recorded output. The end of a message's
  content moves forward to the next such place (Qwen's `result\\n` + `\\n</tool_response>`
  stays one `\\n\\n` token); where none comes before the next content, the two messages
  share one segment.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import numpy as np

from gyre.proxy.tree import id_dtype
from gyre.proxy.types import ContextOverflow, Message, RequestError, ToolCall, ToolSpec

log = logging.getLogger("gyre.proxy")

# Markers with a per-process nonce: they cannot come from a client by accident (a message
# containing the nonce is refused). Digits, so a template's upper() / lower() leaves them as
# they are, between C1 control characters (U+0091-U+0094: no case, not whitespace to trim(),
# kept by tojson) rather than private-use ones: those are Latin-1, so a rendered chunk of
# ASCII or Latin-1 text stays one byte a character in memory, where a single U+E000 would
# make Python store the whole chunk at two (a coordinator holds a thousand live histories).
_NONCE = f"{secrets.randbelow(10 ** 8):08d}"
MARK = f"\x91{_NONCE}\x91"  # end of one message's content
REF_OPEN, REF_CLOSE = f"\x92{_NONCE}:", "\x92"  # a recorded output, by key
C_OPEN, C_CLOSE = f"\x93{_NONCE}\x93", f"\x94{_NONCE}\x94"  # around content: plain text
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"  # Hermes tool calls, matched as text


class ModelFilesError(FileNotFoundError):
    """A tokenizer or chat-template file is missing from the model directory."""


@dataclass(frozen=True, slots=True)
class Text:
    text: str


@dataclass(frozen=True, slots=True)
class Ref:
    key: str  # the recorded output's id


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message):
    raise jinja2.exceptions.TemplateError(message)


def _environment() -> jinja2.Environment:
    """The environment transformers' apply_chat_template uses (same filters and flags)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class ChatTokenizer:
    def __init__(self, model_dir: str | Path, *, cache_size: int = 65536, cache_bytes: int = 16 << 20):
        from tokenizers import Tokenizer

        root = Path(model_dir)
        tok_path = root / "tokenizer.json"
        if not tok_path.exists():
            raise ModelFilesError(f"model directory {root} has no tokenizer.json")
        self.tokenizer = Tokenizer.from_file(str(tok_path))
        cfg_path = root / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_path = root / "chat_template.jinja"
        if template is None and jinja_path.exists():
            template = jinja_path.read_text()
        if template is None:
            raise ModelFilesError(f"model directory {root} has no chat template "
                                  "(tokenizer_config.json 'chat_template' or chat_template.jinja)")
        self.template = _environment().from_string(template)
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.stop_token_ids = self._stop_ids(root)
        # Tool calls are found in the decoded text: the tags are single tokens in Qwen's
        # vocabulary but several pieces in most others (Llama 3, Mistral, SmolLM2).
        self.tool_call_open, self.tool_call_close = TOOL_OPEN, TOOL_CLOSE
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        spec = json.loads(tok_path.read_text())
        # A run after an added token is not at the text's start: SentencePiece-style "first"
        # pre-tokenizers prepend their word marker only at offset 0 of the whole prompt.
        self._plain, self._plain_first = _plain_tokenizer(spec, first=False), _plain_tokenizer(spec, first=True)
        self._added, self._added_re = _added_tokens(spec)
        # Memos of recent segments and chunks (a harness resends the same texts), each bounded
        # by entries and bytes: a coordinator serving a thousand long histories must not keep
        # a copy of them here. Ids are kept as the trees keep them (compact arrays).
        self.id_dtype = id_dtype(self.vocab_size)
        self._cache = _Memo(cache_size, cache_bytes)  # segment text -> its ids
        self._cache_first = _Memo(cache_size, cache_bytes)  # segments that begin a prompt
        self._cache_size = cache_size
        self._leads = _Memo(cache_size, cache_bytes)  # chunk -> where its leading glue may be cut (see to_segments)
        self._split = _Memo(cache_size, cache_bytes)  # segment text -> its Text/Ref pieces
        self.marked = True  # content marked as plain text; off for a template that rewrites content
        self.marked = self._markers_survive(root)
        self.supports_tools = self._renders_tools()
        if not self.supports_tools:
            log.warning("the chat template in %s ignores `tools`: tool schemas and earlier tool calls never reach "
                        "the prompt, so the policy cannot call tools (use a template with tool support)", root)

    def _stop_ids(self, root: Path) -> frozenset[int]:
        ids = set()
        gen = root / "generation_config.json"
        if gen.exists():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        for t in (self.eos_token, "<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
            if t and self.tokenizer.token_to_id(t) is not None:
                ids.add(self.tokenizer.token_to_id(t))
        return frozenset(ids)

    # --- tokens -------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` with added tokens recognised, as the model writes them (outputs,
        tests). Prompts are encoded by `encode_segment`."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_plain(self, text: str, *, at_start: bool = False) -> list[int]:
        """Token ids of `text` as plain text: special-token strings in it are just characters
        (`at_start`: the text begins the prompt, for pre-tokenizers that treat that specially).
        A long text goes through `encode_batch`, the one call of `tokenizers` that lets go of
        the GIL while it works: `encode` holds it throughout (4 MiB: 11 s), so even on the
        proxy's prompt thread it would stop the event loop as long."""
        tok = self._plain_first if at_start else self._plain
        if len(text) < _GIL_FREE_CHARS:
            return tok.encode(text, add_special_tokens=False).ids
        return tok.encode_batch([text], add_special_tokens=False)[0].ids

    @property
    def max_json_bytes_per_token(self) -> int:
        """The most bytes one token's text can take in a JSON request body, escaped as badly
        as JSON allows (a control character as `\\u0000`, any other non-ASCII character as
        `\\uXXXX`, an astral one as two, a partial byte as a whole character): a body longer
        than this times the context's tokens (and the slack the server adds) cannot fit the
        context, whatever it says."""
        return self._token_bounds[0]

    @property
    def max_chars_per_token(self) -> int:
        """More characters than one token's text can stand for (added tokens included): a
        text of n characters is at least n / this many tokens, known before tokenizing it.
        Twice the longest token, and a character more (a decoder that drops a word marker's
        space, a normaliser that joins characters, as NFC does, stay under it)."""
        return self._token_bounds[1]

    @cached_property
    def _token_bounds(self) -> tuple[int, int]:
        """(max_json_bytes_per_token, max_chars_per_token), once over the whole vocabulary."""
        texts = self.tokenizer.decode_batch([[i] for i in range(self.vocab_size)], skip_special_tokens=False)
        return max(1, max((_json_cost(t) for t in texts), default=1)), 2 * (max(map(len, texts), default=1) + 1)

    def encode_segment(self, text: str, *, at_start: bool = False) -> np.ndarray:
        """Token ids of one prompt segment (rendered text with its content marked), cached
        by the segment: the glue's added tokens become their ids, everything between them
        (glue text and content together) is encoded as one plain run, as a whole text is.
        `at_start`: the segment begins the prompt. A content marker the template separated
        from its pair (Qwen3 keeps only the text after a `</think>`) is dropped, its text
        encoded as glue."""
        cache = self._cache if not at_start else self._cache_first
        known = cache.get(text)
        if known is not None:
            return known
        ids: list[int] = []
        plain: list[str] = []

        def flush() -> None:  # the run so far; only the segment's first can begin the prompt
            run = "".join(plain)
            if run:
                ids.extend(self.encode_plain(run, at_start=at_start and not ids))
            plain.clear()

        for is_content, piece in _pieces_of(text):
            if is_content:
                plain.append(piece)
                continue
            pos = 0
            for m in self._added_re.finditer(piece) if self._added_re is not None else ():
                plain.append(piece[pos:m.start()])
                flush()
                key = m.group(0)
                ids.append(self._added[key] if key in self._added else self._added[key.strip()])
                pos = m.end()
            plain.append(piece[pos:])
        flush()
        out = np.asarray(ids, dtype=self.id_dtype)
        out.flags.writeable = False  # shared: by the memo and every tree node made from it
        cache.put(text, out, sys.getsizeof(text) + out.nbytes)
        return out

    def prompt_ids(self, messages: list[Message], tools: list[ToolSpec], max_context: int | None = None) -> list[int]:
        """The prompt of a conversation with no recorded outputs (count_tokens, tests);
        ContextOverflow, before tokenizing, when it has `max_context` tokens at least."""
        segments = self.segments(messages, tools, {})
        if max_context is not None:
            at_least = sum(token_chars(seg.text) for seg in segments) // self.max_chars_per_token
            if at_least >= max_context:
                raise ContextOverflow(at_least, max_context)
        return [t for i, seg in enumerate(segments) for t in self.encode_segment(seg.text, at_start=i == 0).tolist()]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.id_to_token(token_id) or ""

    # --- rendering ----------------------------------------------------------------------

    def render(self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> str:
        try:
            return self.template.render(messages=messages, tools=tools or None,
                                        add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except jinja2.exceptions.TemplateError as e:
            raise RequestError("messages", f"the chat template rejected the conversation: {e}") from None

    def segments(self, messages: list[Message], tools: list[ToolSpec], refs: dict[int, str],
                 restore_args: dict[str, str] | None = None) -> list[Text | Ref]:
        """Render for generation and cut into segments: about one text segment per message
        (its content plus template text around it, cut as the module docstring says), and a
        `Ref` wherever `refs` maps a message index to a recorded output that must be spliced
        in verbatim."""
        return self.to_segments(self.chunks(messages, [t.as_template_tool() for t in tools], refs,
                                            restore_args or {}))

    def to_segments(self, chunks: list[str]) -> list[Text | Ref]:
        """Rendered chunks (cut at each content's end) -> segments whose cuts tokenisation
        respects: each cut moves to the next chunk's first added token or recorded output,
        or, when that chunk's content comes first, disappears (two messages, one segment)."""
        out: list[Text | Ref] = []
        cur = chunks[:1]
        for chunk in chunks[1:]:
            lead = self._lead(chunk)
            if lead is None:
                cur.append(chunk)
                continue
            cur.append(chunk[:lead])
            out += self._pieces("".join(cur))
            cur = [chunk[lead:]]
        if cur:
            out += self._pieces("".join(cur))
        return out

    def _lead(self, chunk: str) -> int | None:
        lead = self._leads.get(chunk, -1)
        if lead != -1:
            return lead
        c = chunk.find(C_OPEN)
        head = chunk if c < 0 else chunk[:c]
        r = head.find(REF_OPEN)
        if r >= 0:
            head = head[:r]
        m = self._added_re.search(head) if self._added_re is not None else None
        lead = m.start() if m else r if r >= 0 else None
        self._leads.put(chunk, lead, sys.getsizeof(chunk))
        return lead

    def _pieces(self, text: str) -> list[Text | Ref]:
        pieces = self._split.get(text)
        if pieces is None:
            pieces = chunks_to_segments([text])
            self._split.put(text, pieces, sys.getsizeof(text) + sum(64 + _own_size(p, text) for p in pieces))
        return pieces

    def _markers_survive(self, root: Path) -> bool:
        """Whether content can be marked for this template: rendering marked content and
        removing the markers gives exactly the plain render (a template that trims content,
        or splits it, still sees the same text). Else content is rendered unmarked, with a
        warning: special-token strings in it then match as Hugging Face would match them."""
        probe = [Message("system", "  You are terse.\n"), Message("user", "\n hello there \n"),
                 Message("assistant", "<think>\nmaybe\n</think>\n\nok  "), Message("user", "next"),
                 Message("assistant", " ", tool_calls=[ToolCall("c1", "f", '{"x": " a\\n"}')]),
                 Message("tool", "result\n", tool_call_id="c1"), Message("tool", "more", tool_call_id="c1")]
        tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {
            "type": "object", "properties": {"x": {"type": "string"}}}}}]
        try:
            for msgs, spec in ((probe, tools), (probe[:4], None), (probe[1:4], None)):
                plain = self.render([_template_message(m, {}, None) for m in msgs], spec, True)
                marked = self.render([_template_message(m, {}, True) for m in msgs], spec, True)
                if _strip_markers(marked) != plain:
                    log.warning("the chat template in %s rewrites message content in a way gyre's content markers "
                                "cannot follow: content is encoded with special-token matching for this model "
                                "(a literal special token in a tool result would be one)", root)
                    return False
        except RequestError:
            return True  # a template that refuses the probe's shape: judged on real requests
        return True

    def _renders_tools(self) -> bool:
        """Whether the template renders a tool list at all (SmolLM2's stock one does not)."""
        probe = [{"role": "user", "content": "hi"}]
        tool = [{"type": "function", "function": {"name": "probe_tool_x", "description": "d",
                                                  "parameters": {"type": "object", "properties": {}}}}]
        try:
            return self.render(probe, tool, True) != self.render(probe, None, True)
        except RequestError:
            return False

    def chunks(self, messages: list[Message], tools: list[dict], refs: dict[int, str],
               restore_args: dict[str, str], start: int = 0) -> list[str]:
        """The rendered text cut at the end of each marked message's content (messages
        with empty content carry no mark). Markers are checked from message `start` on."""
        rendered = []
        for i, m in enumerate(messages):
            if i >= start:
                for piece in (m.content, *(c.arguments for c in m.tool_calls)):
                    if _NONCE in piece:
                        raise RequestError(f"messages[{i}]", "contains gyre's private segment markers")
            if i in refs:
                rendered.append({"role": "assistant", "content": f"{REF_OPEN}{refs[i]}{REF_CLOSE}"})
            else:
                rendered.append(_template_message(m, restore_args, self.marked))
        return self.render(rendered, tools, add_generation_prompt=True).split(MARK)

    @cached_property
    def local(self) -> bool:
        """Whether this chat template is local enough for incremental rendering (see
        segmenter.py): probed once on synthetic conversations, never assumed."""
        from gyre.proxy.segmenter import probe_locality

        return probe_locality(self)


def token_chars(text: str) -> int:
    """Characters of a segment's text that become tokens (its content markers do not)."""
    return len(text) - len(C_OPEN) * text.count(C_OPEN) - len(C_CLOSE) * text.count(C_CLOSE)


_GIL_FREE_CHARS = 4096  # texts this long and longer are encoded with the GIL released (encode_plain)
_JSON_SHORT_ESCAPES = frozenset('"\\/\b\f\n\r\t')


def _json_cost(text: str) -> int:
    """Bytes `text` can take at most as a JSON string's contents (see max_json_bytes_per_token)."""
    n = 0
    for c in text:
        o = ord(c)
        if c in _JSON_SHORT_ESCAPES:
            n += 2
        elif 0x20 <= o < 0x7F:
            n += 1
        elif o == 0xFFFD:  # a token of partial UTF-8 bytes (up to 3 of them, 3 escaped bytes each)
            n += 12
        else:
            n += 6 if o < 0x10000 else 12
    return n


def _own_size(piece: Text | Ref, whole: str) -> int:
    """Bytes a piece holds beyond the text it was cut from (a whole-text piece is that string)."""
    own = piece.key if isinstance(piece, Ref) else piece.text
    return 0 if own is whole else sys.getsizeof(own)


def chunks_to_segments(chunks: list[str]) -> list[Text | Ref]:
    out: list[Text | Ref] = []
    for chunk in chunks:
        while REF_OPEN in chunk:
            before, rest = chunk.split(REF_OPEN, 1)
            key, chunk = rest.split(REF_CLOSE, 1)
            if before:
                out.append(Text(before))
            out.append(Ref(key))
        if chunk:
            out.append(Text(chunk))
    return out


def _content(text: str, marked: bool | None) -> str:
    """A message's content as rendered: its end marked (MARK, where chunks are cut) and,
    with `marked`, its non-blank core between content markers. Whitespace stays outside
    them, so a template's trim / strip sees plain text; None: no markers at all (probes)."""
    if not text or marked is None:
        return text
    core = text.strip()
    if not marked or not core:
        return text + MARK
    lead = len(text) - len(text.lstrip())
    return f"{text[:lead]}{C_OPEN}{core}{C_CLOSE}{MARK}{text[lead + len(core):]}"


def _template_message(m: Message, restore_args: dict[str, str], marked: bool | None) -> dict[str, Any]:
    # Empty content stays empty (templates test its truthiness); that message then shares
    # a segment with the next one, which only makes matching coarser, never wrong.
    d: dict[str, Any] = {"role": m.role, "content": _content(m.content, marked)}
    if m.tool_calls:
        calls = []
        for c in m.tool_calls:
            raw = restore_args.get(c.id, c.arguments)  # the original payload, if we emitted it
            try:
                args = json.loads(raw)
                args = _content_leaves(args) if marked else args
            except ValueError:
                args = f"{C_OPEN}{raw}{C_CLOSE}" if marked and raw else raw
            calls.append({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": args}})
        d["tool_calls"] = calls
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    if m.name:
        d["name"] = m.name
    return d


_MARKERS = re.compile(f"({re.escape(C_OPEN)}|{re.escape(C_CLOSE)})")


def _pieces_of(text: str) -> list[tuple[bool, str]]:
    """(is_content, text) runs of a segment: content is what lies between a C_OPEN and the
    C_CLOSE right after it; markers left without their pair are dropped."""
    if _NONCE not in text:
        return [(False, text)]
    items = _MARKERS.split(text)
    texts, marks = items[0::2], items[1::2]
    out = []
    for j, t in enumerate(texts):
        content = j > 0 and marks[j - 1] == C_OPEN and j < len(marks) and marks[j] == C_CLOSE
        if t:
            out.append((content, t))
    return out


def _strip_markers(text: str) -> str:
    return text.replace(C_OPEN, "").replace(C_CLOSE, "").replace(MARK, "")


def display_key(text: str) -> str:
    """A segment's text for records and display: the per-process content markers become
    the fixed characters U+E002 / U+E003 (content starts / ends)."""
    return text.replace(C_OPEN, "\ue002").replace(C_CLOSE, "\ue003") if _NONCE in text else text


def live_key(shown: str) -> str:
    """`display_key` undone in this process: a recorded segment's text with this process's
    content markers, as its tree keys it (a resumed Recorder's tree, Recorder.resumed)."""
    return shown.replace("\ue002", C_OPEN).replace("\ue003", C_CLOSE) if "\ue002" in shown or "\ue003" in shown \
        else shown


def _content_leaves(obj: Any) -> Any:
    """Tool-call arguments with every string (keys too) marked as content: text the harness
    sent, encoded plain wherever the template puts it (its `tojson` keeps the markers)."""
    if isinstance(obj, str):
        return f"{C_OPEN}{obj}{C_CLOSE}" if obj else obj
    if isinstance(obj, dict):
        return {_content_leaves(k): _content_leaves(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_content_leaves(v) for v in obj]
    return obj


def _plain_tokenizer(spec: dict, *, first: bool):
    """The same tokenizer without its added tokens: text encoded by it is never split on a
    special-token string (the model part, normaliser and pre-tokeniser are the same). With
    `first` False, a Metaspace pre-tokenizer that prepends its marker at the text's start
    only (prepend_scheme "first") prepends none: a run after an added token is not there."""
    from tokenizers import Tokenizer

    plain = {**spec, "added_tokens": []}
    if not first:
        plain["pre_tokenizer"] = _no_first_prepend(spec.get("pre_tokenizer"))
    return Tokenizer.from_str(json.dumps(plain))


def _no_first_prepend(pre: Any) -> Any:
    if not isinstance(pre, dict):
        return pre
    if pre.get("type") == "Metaspace" and pre.get("prepend_scheme") == "first":
        return {**pre, "prepend_scheme": "never"}
    if pre.get("type") == "Sequence":
        return {**pre, "pretokenizers": [_no_first_prepend(p) for p in pre.get("pretokenizers", [])]}
    return pre


def _added_tokens(spec: dict) -> tuple[dict[str, int], re.Pattern | None]:
    """The added tokens (content -> id) and a regex finding them leftmost-longest, with the
    whitespace an lstrip / rstrip token absorbs."""
    tokens = {t["content"]: t["id"] for t in spec.get("added_tokens", []) if t.get("content")}
    if not tokens:
        return tokens, None
    flags = {t["content"]: (t.get("lstrip", False), t.get("rstrip", False)) for t in spec["added_tokens"]}
    alternatives = []
    for text in sorted(tokens, key=len, reverse=True):
        left, right = flags.get(text, (False, False))
        alternatives.append(("\\s*" if left else "") + re.escape(text) + ("\\s*" if right else ""))
    return tokens, re.compile("|".join(alternatives))


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class _Memo:
    """A least-recently-used memo bounded by entries and by bytes (each entry's size as the
    caller counts it: the key's string as Python stores it, 1 to 4 bytes a character by its
    widest character, and the value's). Safe across threads: the proxy's prompt threads
    share one tokenizer."""

    _MISSING = object()

    def __init__(self, entries: int, nbytes: int):
        self.entries, self.budget = entries, nbytes
        self._d: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self.bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._d)

    def get(self, key: str, default: Any = None) -> Any:
        with self._lock:
            hit = self._d.get(key, self._MISSING)
            if hit is self._MISSING:
                return default
            self._d.move_to_end(key)
            return hit[0]

    def put(self, key: str, value: Any, size: int) -> None:
        with self._lock:
            old = self._d.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            if size > self.budget:
                return  # larger than the whole memo: not kept
            self._d[key] = (value, size)
            self.bytes += size
            while len(self._d) > self.entries or self.bytes > self.budget:
                _, (_, n) = self._d.popitem(last=False)
                self.bytes -= n
