"""tree.py: an execution's prefix-sharing trajectory tree.

Each node is one segment of context: a run of external text (system, user, tool results,
template glue) or one recorded model output. A request's segments are matched from the
root by key (a dictionary lookup per segment), so the deepest existing path that is a
prefix of the request supplies its recorded tokens and only the new segments are added;
a divergent segment starts a branch, an unseen first segment a new root. Nodes are never
changed once added: a recorded output keeps its conditioning context for ever.

Tokens, log-probs and versions are compact numpy arrays (ids uint16 where the vocabulary
fits, else int32; log-probs float32; versions int32), not Python lists: a coordinator holds
a thousand executions' histories of hundreds of thousands of tokens each. For the same
reason a text node keeps no text: it is found by `text_key`, and its text is in the
records (nodes.jsonl). Not the renderer (chat.py) and not the HTTP layer.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

LOGPROB_DTYPE = np.float32
VERSION_DTYPE = np.int32


def text_key(text: str) -> int:
    """A text segment's key among its siblings: Python's string hash (SipHash-1-3 under a
    random per-process key, computed once per string object and cached on it, so the
    segments a harness resends cost a lookup, not a pass over their text) with the length
    folded in. A real tokenizer's token is about 4 characters, so keeping the text, the
    tree's keys would outweigh its uint16 ids at least twice over (more for text past
    Latin-1, which Python stores at 2-4 bytes a character). Two different texts of one
    length under one parent would have to agree on 64 keyed bits to be confused."""
    return (hash(text) & 0xFFFF_FFFF_FFFF_FFFF) | (len(text) << 64)


def id_dtype(vocab_size: int | None) -> np.dtype:
    """The narrowest id type for a vocabulary: uint16 up to 65,536 ids, else int32."""
    return np.dtype(np.uint16 if vocab_size is not None and vocab_size <= 1 << 16 else np.int32)


@dataclass(slots=True)
class Node:
    id: int
    parent: int  # -1 for a root
    kind: str  # "text" | "output"
    key: int | str  # text_key(segment text), or the output's call id
    tokens: np.ndarray  # ids (Tree.ids dtype)
    policy: bool  # sampled by our engine in this very context (trainable)
    call_id: str  # the call that added it
    logprobs: np.ndarray | None = None  # float32 behaviour log-probs (policy outputs)
    versions: np.ndarray | None = None  # int32 policy version per output token
    end: int = 0  # tokens from the root through this node
    children: dict[tuple[str, int | str], int] = field(default_factory=dict)
    root: int = 0  # index of its root among roots, in creation order


class Tree:
    def __init__(self, vocab_size: int | None = None) -> None:
        self.nodes: list[Node] = []
        self.roots: dict[tuple[str, int | str], int] = {}
        self.ids = id_dtype(vocab_size)

    def _add(self, parent: int, kind: str, key: int | str, tokens: Sequence[int], policy: bool, call_id: str,
             logprobs=None, versions=None) -> Node:
        p = self.nodes[parent] if parent >= 0 else None
        tokens = np.asarray(tokens, dtype=self.ids)
        if logprobs is not None:
            logprobs = np.asarray(logprobs, dtype=LOGPROB_DTYPE)
            versions = np.asarray(versions, dtype=VERSION_DTYPE)
        node = Node(id=len(self.nodes), parent=parent, kind=kind, key=key, tokens=tokens, policy=policy,
                    call_id=call_id, logprobs=logprobs, versions=versions,
                    end=(p.end if p else 0) + len(tokens), root=p.root if p else len(self.roots))
        self.nodes.append(node)
        (p.children if p else self.roots)[(kind, key)] = node.id
        return node

    def child(self, parent: int, kind: str, key: int | str) -> int | None:
        """The child of `parent` (-1: the roots) under `key` (an output's call id, or a text's
        `text_key`; `child_text` takes the text)."""
        table = self.nodes[parent].children if parent >= 0 else self.roots
        return table.get((kind, key))

    def child_text(self, parent: int, text: str) -> int | None:
        return self.child(parent, "text", text_key(text))

    def add_text(self, parent: int, text: str, tokens: Sequence[int], call_id: str) -> Node:
        return self._add(parent, "text", text_key(text), tokens, False, call_id)

    def add_output(self, parent: int, call_id: str, tokens: Sequence[int], logprobs: Sequence[float],
                   versions: Sequence[int]) -> Node:
        """The model's output of `call_id`, conditioned on the path ending at `parent`."""
        return self._add(parent, "output", call_id, tokens, True, call_id, logprobs, versions)

    def add_output_copy(self, parent: int, source: Node, call_id: str) -> Node:
        """A recorded output the harness placed in a different context: its exact tokens,
        but external here (its log-probs belong to its original context)."""
        return self._add(parent, "output", source.key, source.tokens, False, call_id)

    def path(self, node_id: int) -> list[int]:
        out = []
        while node_id >= 0:
            out.append(node_id)
            node_id = self.nodes[node_id].parent
        return out[::-1]

    def tokens(self, path: list[int]) -> list[int]:
        """The path's ids as a list of ints (tests, tools; the proxy keeps the array)."""
        return self.token_array(path).tolist()

    def token_array(self, path: list[int]) -> np.ndarray:
        """The path's ids (a prompt for the engine), one new array."""
        if not path:
            return np.zeros(0, self.ids)
        return np.concatenate([self.nodes[n].tokens for n in path])

    def nbytes(self) -> int:
        """Bytes of the nodes' arrays (what the tree's size is made of; texts are not kept)."""
        return sum(n.tokens.nbytes + (n.logprobs.nbytes + n.versions.nbytes if n.logprobs is not None else 0)
                   for n in self.nodes)

    def leaves(self) -> Iterator[Node]:
        return (n for n in self.nodes if not n.children)

    # --- accounting for `gyre inspect` and the benchmark -------------------------------

    def stats(self) -> dict:
        unique = sum(len(n.tokens) for n in self.nodes)
        expanded = sum(n.end for n in self.leaves())
        policy = sum(len(n.tokens) for n in self.nodes if n.policy)
        return {"nodes": len(self.nodes), "roots": len(self.roots), "leaves": sum(1 for _ in self.leaves()),
                "unique_tokens": unique, "expanded_tokens": expanded, "policy_tokens": policy,
                "external_tokens": unique - policy}
