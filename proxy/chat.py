"""chat.py: a model directory's tokenizer and chat template, and message-level segmentation.

`ChatTokenizer.segments()` renders a conversation with the model's own chat template (the
same Jinja environment Hugging Face uses) and cuts the text at message boundaries and at
recorded model outputs, so the trajectory tree can match requests message by message and
splice the model's exact recorded tokens in place of its past outputs. Text is tokenised
per segment, with a cache, so a repeated history costs a dictionary lookup, not a
re-tokenisation. Not the tree: matching lives in tree.py.
"""

from __future__ import annotations

import json
import secrets
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox

from gyre.proxy.types import Message, RequestError, ToolSpec

# Private-use markers with a per-process nonce: they cannot come from a client by accident.
_NONCE = secrets.token_hex(4)
MARK = f"\ue000{_NONCE}\ue000"  # end of one message's content
REF_OPEN, REF_CLOSE = f"\ue001{_NONCE}:", "\ue001"  # a recorded output, by key


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
    def __init__(self, model_dir: str | Path, *, cache_size: int = 65536):
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
        self.tool_call_open = self.tokenizer.token_to_id("<tool_call>")
        self.tool_call_close = self.tokenizer.token_to_id("</tool_call>")
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self._cache: OrderedDict[str, list[int]] = OrderedDict()
        self._cache_size = cache_size

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
        """Token ids of `text` (added tokens recognised), cached by the text itself."""
        ids = self._cache.get(text)
        if ids is not None:
            self._cache.move_to_end(text)
            return ids
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        self._cache[text] = ids
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return ids

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
        """Render for generation and cut into segments: one text segment per message (its
        content plus the template text before it), and a `Ref` wherever `refs` maps a
        message index to a recorded output that must be spliced in verbatim."""
        restore_args = restore_args or {}
        rendered = []
        for i, m in enumerate(messages):
            for piece in (m.content, *(c.arguments for c in m.tool_calls)):
                if MARK in piece or REF_OPEN in piece:
                    raise RequestError(f"messages[{i}]", "contains gyre's private segment markers")
            if i in refs:
                rendered.append({"role": "assistant", "content": f"{REF_OPEN}{refs[i]}{REF_CLOSE}"})
            else:
                rendered.append(_template_message(m, restore_args))
        text = self.render(rendered, [t.as_template_tool() for t in tools], add_generation_prompt=True)
        out: list[Text | Ref] = []
        for chunk in text.split(MARK):
            while REF_OPEN in chunk:
                before, rest = chunk.split(REF_OPEN, 1)
                key, chunk = rest.split(REF_CLOSE, 1)
                if before:
                    out.append(Text(before))
                out.append(Ref(key))
            if chunk:
                out.append(Text(chunk))
        return out


def _template_message(m: Message, restore_args: dict[str, str]) -> dict[str, Any]:
    # Empty content stays empty (templates test its truthiness); that message then shares
    # a segment with the next one, which only makes matching coarser, never wrong.
    d: dict[str, Any] = {"role": m.role, "content": m.content + MARK if m.content else ""}
    if m.tool_calls:
        calls = []
        for c in m.tool_calls:
            raw = restore_args.get(c.id, c.arguments)  # the original payload, if we emitted it
            try:
                args = json.loads(raw)
            except ValueError:
                args = raw
            calls.append({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": args}})
        d["tool_calls"] = calls
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    if m.name:
        d["name"] = m.name
    return d


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value
