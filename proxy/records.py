"""records.py: an execution's record files (nodes.jsonl, calls.jsonl): written as journals,
read back as trees.

`Journal` is the one way a run's JSONL files are appended (these and metrics.jsonl): whole
lines in one write(), a failed or short write cut back to the last whole line, fsync on
request. The reader rebuilds the tree node by node in recording order, so `gyre inspect`,
admission and the coordinator's resume see exactly what the proxy recorded; a torn last
line (a crash mid-write) is skipped with a warning, damage anywhere else is a
`RecordsError` naming the file and line. Not the recorder: recorder.py decides what to write.
"""

from __future__ import annotations

import errno
import logging
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from gyre.proxy.admission import J_MAX, Rows, Trajectory, admit, materialise
from gyre.proxy.tree import LOGPROB_DTYPE, VERSION_DTYPE, Node, Tree, text_key
from gyre.proxy.types import Message, ToolCall

log = logging.getLogger("gyre.records")

# A call's line in calls.jsonl also holds its transcript (`gyre inspect --transcript`), in the
# file only: the Recorder's calls and load_execution's keep none of it in memory. Records from
# before it have none of these keys, and what they would say is unknown (never empty).
TRANSCRIPT_KEYS = ("messages_from", "messages_seen_in", "messages", "output_text", "output_tool_calls")
SENT_KEEP = 4  # an execution's recent requests a call's messages are compared with


class JournalError(OSError):
    """A record that could not be written (disk full, over quota, an I/O error). The file was
    cut back to its last whole line: it holds every earlier record and nothing of this one."""


class RecordsError(ValueError):
    """Record files that cannot be read back as a tree; the message names the file and line."""


class Journal:
    """An append-only JSONL file. Each `append` is whole lines in one write(); a short write
    (the disk filling up mid-line) writes the rest, and any failure cuts the file back to
    where the append began, so a torn line is never followed by another. A torn last line
    left by a crash is cut off when the file is opened again. One writer per file (the run
    directory's lock), on one thread."""

    def __init__(self, path: Path):
        self.path = path
        existed = path.exists()
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self._size = os.fstat(self._fd).st_size
        self._cut_to: int | None = None  # a cut-back that failed: retried before the next write
        self._dirty = not existed  # written (or created) since the last sync
        self.created = not existed  # the directory entry is new: sync() also syncs the folder
        if self._size:
            self._cut_torn_tail()

    def _cut_torn_tail(self) -> None:
        with open(self.path, "rb") as f:
            f.seek(self._size - 1)
            if f.read(1) == b"\n":
                return
            at, keep = self._size, 0
            while at > 0:  # back to the last newline, a block at a time
                start = max(0, at - 65536)
                f.seek(start)
                nl = f.read(at - start).rfind(b"\n")
                if nl >= 0:
                    keep = start + nl + 1
                    break
                at = start
        log.warning("%s: cut off a torn last line (%d bytes) left by an interrupted write", self.path,
                    self._size - keep)
        os.ftruncate(self._fd, keep)
        self._size = keep

    @property
    def size(self) -> int:
        """Bytes of whole lines in the file."""
        return self._size

    def append(self, data: bytes) -> None:
        """Write `data` (whole lines, ending in a newline) or, raising JournalError, nothing.
        A closed journal opens again (a call that ends after its execution was closed)."""
        if self._fd is None:
            try:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
            except OSError as e:
                raise JournalError(e.errno, f"opening {self.path}: {e.strerror or e}") from e
            self._size = os.fstat(self._fd).st_size
        if self._cut_to is not None:
            self.cut(self._cut_to)
            if self._cut_to is not None:
                raise JournalError(errno.EIO, f"{self.path}: a torn line could not be cut off")
        start, done, view = self._size, 0, memoryview(data)
        try:
            while done < len(data):
                n = os.write(self._fd, view[done:])
                if n == 0:  # never for a regular file with room; do not spin
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                done += n
        except OSError as e:
            self.cut(start)
            raise JournalError(e.errno, f"writing {self.path}: {e.strerror or e}") from e
        self._size = start + done
        self._dirty = True

    def cut(self, size: int) -> None:
        """Back to `size` bytes (an append undone: this one, or one of a transaction of files).
        A cut that fails is retried before the next append."""
        try:
            os.ftruncate(self._fd, size)
        except OSError as e:
            log.error("%s: cannot cut a failed write back to %d bytes (%s); retried before the next write",
                      self.path, size, e)
            self._cut_to = size
            return
        self._cut_to = None
        self._size = size

    def sync(self) -> None:
        """fsync what was written since the last sync (and the folder's entry for a new file),
        even after close()."""
        if not self._dirty:
            return
        try:
            if self._fd is not None:
                os.fsync(self._fd)
            else:
                fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            if self.created:
                sync_dir(self.path.parent)
                self.created = False
        except OSError as e:
            raise JournalError(e.errno, f"syncing {self.path}: {e.strerror or e}") from e
        self._dirty = False

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def sync_dir(folder: Path) -> None:
    """fsync a folder, so the entries of files created in it survive a power cut."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_lines(path: Path) -> list[tuple[int, Any]]:
    """(line number, object) of each whole JSON line. A torn last line is skipped with a
    warning; a line that is not JSON elsewhere is skipped with a warning saying so (the
    callers decide whether a gap matters: for nodes it does)."""
    if not path.exists():
        return []
    return parse_lines(path.read_bytes().split(b"\n"), path)[0]


def parse_lines(lines: list[bytes], path: Path, *, warn: bool = True) -> tuple[list[tuple[int, Any]], list[int]]:
    """The JSON lines of a journal `lines` (numbered from 1, blank ones skipped): (line number,
    object) of each whole one, and the numbers of the others, each logged with `warn` as a
    torn last line or one torn mid-file. Also metrics.read_events' parser."""
    last = max((i for i, raw in enumerate(lines) if raw.strip()), default=-1)
    out, bad = [], []
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        try:
            out.append((i + 1, orjson.loads(raw)))
        except orjson.JSONDecodeError:
            bad.append(i + 1)
            if warn:
                where = "its torn last line" if i == last else "a line that is no whole record (torn mid-file)"
                log.warning("%s: skipped %s: line %d, %d bytes", path, where, i + 1, len(raw))
    return out, bad


def transcript_fields(messages: list[Message], recent: list[tuple[str, list[Message]]], output_text: str,
                      tool_calls: list[ToolCall]) -> dict:
    """A call's transcript keys: the request's messages from `messages_from` on, the first one
    that the closest of the `recent` requests ((call id, messages), newest first) did not send
    (`messages_seen_in` names that call; None: all are written), and the model's answer."""
    start, seen_in = 0, None
    for call_id, sent in recent:
        n = 0
        for a, b in zip(sent, messages):  # one harness resends the same Message objects (ParseMemo)
            if a is not b and a != b:
                break
            n += 1
        if n > start:
            start, seen_in = n, call_id
    return {"messages_from": start, "messages_seen_in": seen_in,
            "messages": [_message(m) for m in messages[start:]], "output_text": output_text,
            "output_tool_calls": [_tool_call(c) for c in tool_calls]}


def _message(m: Message) -> dict:
    out: dict = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [_tool_call(c) for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name
    return out


def _tool_call(c: ToolCall) -> dict:
    return {"id": c.id, "name": c.name, "arguments": c.arguments}


@dataclass
class Recorded:
    id: str
    tree: Tree
    calls: list[dict]
    leaf_roles: dict[int, str]

    @property
    def closed(self) -> bool:
        """As Recorder.closed: read from its files, nothing more is recorded."""
        return True

    def admit(self, j_max: int | None = J_MAX, seed: int = 0) -> tuple[list[Trajectory], Rows]:
        """As Recorder.admit: a resumed coordinator trains recorded executions through this."""
        trajectories = admit(self.tree, self.leaf_roles, j_max=j_max, rng=random.Random(seed))
        return trajectories, materialise(self.tree, trajectories)


def _node(tree: Tree, n: Any, text: Callable[[str], str] | None = None) -> Node:
    parent = tree.nodes[n["parent"]] if n["parent"] >= 0 else None
    # As Tree.add_text keys it (`text`: the recorded text as the live tree had it).
    key = text_key(text(n["key"]) if text else n["key"]) if n["kind"] == "text" else n["key"]
    lps = None if n["logprobs"] is None else np.asarray(n["logprobs"], LOGPROB_DTYPE)
    vers = None if n["versions"] is None else np.asarray(n["versions"], VERSION_DTYPE)
    return Node(id=n["id"], parent=n["parent"], kind=n["kind"], key=key,
                tokens=np.asarray(n["tokens"], tree.ids), policy=n["policy"], call_id=n["call_id"],
                logprobs=lps, versions=vers, end=(parent.end if parent else 0) + len(n["tokens"]),
                root=parent.root if parent else len(tree.roots))


def load_execution(folder: Path, *, transcript: bool = False, text: Callable[[str], str] | None = None) -> Recorded:
    """An execution's tree, calls and leaf roles from its folder; the calls keep their
    TRANSCRIPT_KEYS only with `transcript` (a resumed run holds many executions); `text`
    turns a text node's recorded text into the one its key is taken of. RecordsError
    when the files do not make a tree: a node missing (a line lost mid-file), a node or call
    naming a node the file does not hold, a record without its fields."""
    tree = Tree()
    nodes = folder / "nodes.jsonl"
    for line, n in read_lines(nodes):
        try:
            ident, parent = n["id"], n["parent"]
            if ident == len(tree.nodes) and -1 <= parent < ident:
                node = _node(tree, n, text)
        except (KeyError, TypeError, ValueError) as e:
            raise RecordsError(f"{nodes} line {line}: not a node record ({type(e).__name__}: {e})") from None
        if ident != len(tree.nodes):
            gap = f"node {len(tree.nodes)} is missing" if ident > len(tree.nodes) else "a node repeated"
            raise RecordsError(f"{nodes} line {line}: node {ident} out of order ({gap})")
        if not -1 <= parent < ident:
            raise RecordsError(f"{nodes} line {line}: node {ident} names parent {parent}, not a node before it")
        tree.nodes.append(node)
        p = tree.nodes[parent] if parent >= 0 else None
        (p.children if p else tree.roots)[(node.kind, node.key)] = node.id
    calls_path = folder / "calls.jsonl"
    calls: list[dict] = []
    roles: dict[int, str] = {}
    for line, c in read_lines(calls_path):
        try:
            leaf = c["output_node"] if c["output_node"] is not None else c["prompt_path"][-1]
            role = c["role"]
        except (KeyError, TypeError, IndexError) as e:
            raise RecordsError(f"{calls_path} line {line}: not a call record ({type(e).__name__}: {e})") from None
        if not isinstance(leaf, int) or not 0 <= leaf < len(tree.nodes):
            raise RecordsError(f"{calls_path} line {line}: call {c.get('call_id')!r} ends at node {leaf}, but "
                               f"{nodes.name} holds {len(tree.nodes)} nodes (records lost after a crash "
                               "or a full disk)")
        roles[leaf] = role
        calls.append(c if transcript else {k: v for k, v in c.items() if k not in TRANSCRIPT_KEYS})
    _undelivered(folder, tree, calls)
    roles = {k: v for k, v in roles.items() if not tree.nodes[k].children}
    return Recorded(folder.name, tree, calls, roles)


def _undelivered(folder: Path, tree: Tree, calls: list[dict]) -> None:
    """Apply meta.jsonl's `undelivered` lines (Recorder.undelivered): the call's status, and
    its output node no longer trainable."""
    gone = {m["call_id"]: m.get("node") for _, m in read_lines(folder / "meta.jsonl")
            if isinstance(m, dict) and m.get("event") == "undelivered" and "call_id" in m}
    if not gone:
        return
    for c in calls:
        if c.get("call_id") in gone:
            c["status"] = "undelivered"
    for node in gone.values():
        if isinstance(node, int) and 0 <= node < len(tree.nodes):
            tree.nodes[node].policy = False


def load_run(run_dir: Path) -> list[Recorded]:
    root = run_dir / "executions"
    if not root.is_dir():
        raise FileNotFoundError(f"{run_dir} has no executions/ folder (is it a gyre run directory?)")
    return [load_execution(d) for d in sorted(root.iterdir()) if d.is_dir()]
