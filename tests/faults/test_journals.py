"""A full disk and torn lines (issue 26, findings 4 and 7): a real small filesystem (tmpfs,
mounted here as root) that a test fills and empties, a live proxy recording onto it, and
run directories with the torn lines a crash or an older gyre left.

Where mounting is not allowed, the disk is simulated at the OS boundary instead: `os.write`
to a file under the disk's folder writes half its bytes (a short write), then fails with
ENOSPC, as tmpfs does when it fills (the test's id says which one ran).
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import subprocess
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import anthropic
import openai
import pytest

from gyre.coordinator.metrics import Metrics
from gyre.proxy.records import load_execution
from gyre.proxy.server import ProxyConfig, ProxyServer
from tests.scripted import ScriptedEngine
from tests.support import ThreadEngineBackend

# --- a disk that fills up ------------------------------------------------------------------


class Disk:
    """A folder on a filesystem of its own: `fill()` leaves no free block, `free()` gives
    the space back."""

    def __init__(self, root: Path, kind: str, monkeypatch: pytest.MonkeyPatch):
        self.root, self.kind, self.full = root, kind, False
        self._filler = root / "filler"
        if kind == "patched os.write":
            real, short = os.write, set()

            def write(fd: int, data) -> int:
                if self.full and self._under_root(fd):
                    if fd not in short and len(data) > 1:
                        short.add(fd)
                        return real(fd, bytes(data[: len(data) // 2]))
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                return real(fd, data)

            self._short = short
            monkeypatch.setattr(os, "write", write)

    def _under_root(self, fd: int) -> bool:
        try:
            return os.readlink(f"/proc/self/fd/{fd}").startswith(str(self.root))
        except OSError:
            return False

    def fill(self) -> None:
        self.full = True
        if self.kind != "tmpfs":
            self._short.clear()
            return
        fd = os.open(self._filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            for size in (1 << 16, 1 << 12, 1):  # to the last block
                try:
                    while True:
                        os.write(fd, b"\0" * size)
                except OSError as e:
                    assert e.errno == errno.ENOSPC
        finally:
            os.close(fd)

    def free(self) -> None:
        self.full = False
        if self.kind == "tmpfs":
            self._filler.unlink()


@pytest.fixture
def disk(tmp_path, monkeypatch):
    root = tmp_path / "disk"
    root.mkdir()
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(root)],
                                 capture_output=True).returncode == 0
    except OSError:  # no mount(8)
        mounted = False
    yield Disk(root, "tmpfs" if mounted else "patched os.write", monkeypatch)
    if mounted:
        subprocess.run(["umount", "-l", str(root)], check=True)


# --- a live proxy recording onto it --------------------------------------------------------


@asynccontextmanager
async def live_proxy(tok, run_dir: Path, script=None, **config):
    engine = ScriptedEngine(tok, script=script if script is not None else [])
    backend = ThreadEngineBackend(engine, sampling_cls=lambda **kw: kw)
    server = ProxyServer(tok, backend, ProxyConfig(ping_interval_s=0.2, **config), run_dir=run_dir)
    await server.start()
    try:
        yield server, engine
    finally:
        await server.stop()
        backend.close()


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


CALLS = {  # api -> (path, body of a call whose last user message is `text`)
    "chat": ("/v1/chat/completions", lambda text, stream: {
        "model": "m", "stream": stream, "messages": [{"role": "system", "content": "s"}, *_user(text)]}),
    "messages": ("/v1/messages", lambda text, stream: {
        "model": "m", "max_tokens": 4000, "stream": stream, "system": "s", "messages": _user(text)}),
    "responses": ("/v1/responses", lambda text, stream: {
        "model": "m", "stream": stream, "input": [{"role": "developer", "content": "s"}, *_user(text)]}),
}


# A record longer than a page: a full tmpfs has no room for it in the slack of a file's last page.
SECOND = "second, a new user message " * 200


async def post(server, ex, api: str, text: str, stream: bool) -> tuple[int, dict, bytes]:
    path, body = CALLS[api]
    headers = {"x-api-key": ex.key} if api == "messages" else {"Authorization": f"Bearer {ex.key}"}
    async with aiohttp.ClientSession() as s, s.post(server.base_url + path, json=body(text, stream),
                                                    headers=headers) as r:
        return r.status, dict(r.headers), await r.read()


def assert_overloaded(api: str, status: int, headers: dict, raw: bytes) -> None:
    """A 503 with retry-after in the provider's error shape."""
    assert status == 503 and int(headers["Retry-After"]) > 0
    body = json.loads(raw)
    if api == "messages":
        assert body["type"] == "error" and body["error"]["type"] == "overloaded_error"
        assert "cannot record" in body["error"]["message"]
    else:
        assert "cannot record" in body["error"]["message"] and body["error"]["type"] == "server_error"


def assert_files_hold_what_memory_holds(ex) -> None:
    """Every line whole, and the files read back as exactly the recorder's tree and calls."""
    for name in ("nodes", "calls"):
        for line in (ex.dir / f"{name}.jsonl").read_bytes().splitlines():
            json.loads(line)
    rec = load_execution(ex.dir)
    assert [(n.parent, n.kind, n.tokens.tolist(), n.policy) for n in rec.tree.nodes] == \
        [(n.parent, n.kind, n.tokens.tolist(), n.policy) for n in ex.tree.nodes]
    assert [c["call_id"] for c in rec.calls] == [c["call_id"] for c in ex.calls]
    assert rec.leaf_roles == ex.leaf_roles


@pytest.mark.parametrize("api, stream", [("chat", False), ("messages", True), ("responses", True)])
async def test_a_full_disk_before_generation_is_a_503_before_any_byte_and_a_later_call_works(
        disk, chat_tokenizer, api, stream):
    """The new prompt's nodes cannot be written: a 503 (retry-after) in the provider's shape,
    even for a stream (no SSE byte went out), nothing recorded, nothing generated; once the
    space is back the same request works and is recorded. (Disk: tmpfs, or os.write patched.)"""
    async with live_proxy(chat_tokenizer, disk.root / "run", min_free_disk_bytes=0) as (server, engine):
        ex = server.register("e1")
        assert (await post(server, ex, api, "first", stream))[0] == 200
        nodes, calls, prompts = len(ex.tree.nodes), len(ex.calls), len(engine.prompts)
        disk.fill()
        assert_overloaded(api, *await post(server, ex, api, SECOND, stream))
        assert (len(ex.tree.nodes), len(ex.calls), len(engine.prompts)) == (nodes, calls, prompts)
        assert_files_hold_what_memory_holds(ex)
        disk.free()
        assert (await post(server, ex, api, SECOND, stream))[0] == 200
        assert [c["status"] for c in ex.calls] == ["ok", "ok"]
        assert_files_hold_what_memory_holds(ex)


@pytest.mark.parametrize("api, stream, ending", [
    ("chat", False, None), ("messages", False, None),
    ("messages", True, b"overloaded_error"), ("chat", True, b'"error"'), ("responses", True, b"response.failed")])
async def test_a_full_disk_after_generation_records_nothing_of_the_call(disk, chat_tokenizer, api, stream, ending):
    """The disk fills while the engine generates (the prompt's nodes are on file): the
    output and its call record are not written, and the tree takes the output back. The
    harness is told: a 503 before any byte, or, a stream having started, the API's error
    event in place of its end. Space back: the retried call is recorded whole."""
    def script(prompt: str) -> str:
        if len(engine.prompts) == 2:  # the second call: fill the disk once its prompt is on file
            disk.fill()
        return "An answer. " * 300  # its node's line is past the slack of a file's last page

    async with live_proxy(chat_tokenizer, disk.root / "run", script=script, min_free_disk_bytes=0) as (server, engine):
        ex = server.register("e1")
        assert (await post(server, ex, api, "first", stream))[0] == 200
        status, headers, raw = await post(server, ex, api, "second", stream)
        if ending is None:
            assert_overloaded(api, status, headers, raw)
        else:
            assert status == 200 and ending in raw  # the stream had begun: the error is in it
            for end in (b"message_stop", b"response.completed", b'"finish_reason":"stop"'):
                assert end not in raw
        assert len(ex.calls) == 1 and sum(n.kind == "output" for n in ex.tree.nodes) == 1
        assert_files_hold_what_memory_holds(ex)
        disk.free()
        assert (await post(server, ex, api, "second", stream))[0] == 200
        assert len(ex.calls) == 2 and ex.calls[-1]["status"] == "ok" and ex.calls[-1]["output_tokens"] > 0
        assert_files_hold_what_memory_holds(ex)


async def test_a_nearly_full_disk_is_a_503_before_generation_through_the_sdks(disk, chat_tokenizer):
    """Below min_free_disk_bytes a call is refused before anything is generated (a stream
    never starts), in each SDK's error type; with space back the SDK call succeeds."""
    async with live_proxy(chat_tokenizer, disk.root / "run", min_free_disk_bytes=1 << 20) as (server, engine):
        ex = server.register("e1")
        if disk.kind != "tmpfs":
            pytest.skip("the free-space check needs a real filesystem to fill")
        oa = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=ex.key, max_retries=0)
        an = anthropic.AsyncAnthropic(base_url=server.base_url, api_key=ex.key, max_retries=0)
        try:
            disk.fill()
            with pytest.raises(openai.InternalServerError) as e:
                await oa.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
            assert e.value.status_code == 503 and e.value.response.headers["retry-after"]
            with pytest.raises(anthropic.InternalServerError) as e:
                await an.messages.create(model="m", max_tokens=20, messages=[{"role": "user", "content": "hi"}],
                                         stream=True)
            assert e.value.status_code == 503 and e.value.body["error"]["type"] == "overloaded_error"
            assert engine.prompts == [] and ex.calls == [] and ex.tree.nodes == []
            disk.free()
            r = await an.messages.create(model="m", max_tokens=20, messages=[{"role": "user", "content": "hi"}])
            assert r.content[0].text == "Done." and len(ex.calls) == 1
        finally:
            await oa.close()
            await an.close()


# --- metrics.jsonl ---------------------------------------------------------------------------


def whole_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_bytes().splitlines()]


def test_metrics_hold_the_events_a_full_disk_refuses_and_write_them_in_order_later(disk, caplog):
    """emit() never raises on a full disk (the run goes on); no partial line reaches the file
    (tmpfs writes what fits of the page, then refuses: cut back); the held events are
    written, in order, with the first event the disk takes again; sync() then succeeds."""
    m = Metrics(disk.root / "metrics.jsonl")
    m.emit("dispatch", group=0, pad="x" * 200)
    disk.fill()
    with caplog.at_level(logging.WARNING):
        for g in (1, 2, 3):
            m.emit("dispatch", group=g, pad="x" * 6000)
    assert [e["group"] for e in whole_lines(m.path)] == [0] and m.held == 3
    assert sum("held in memory" in r.getMessage() for r in caplog.records) == 1  # once, not per event
    with pytest.raises(OSError):
        m.sync()  # a checkpoint must not claim a journal the disk does not have
    disk.free()
    m.emit("dispatch", group=4)
    m.sync()
    m.close()
    assert [e["group"] for e in whole_lines(m.path)] == [0, 1, 2, 3, 4]


def test_a_resumed_run_cuts_the_crash_torn_line_instead_of_leaving_it_mid_file(tmp_path, caplog):
    """A crash mid-write leaves a torn last line; the resumed run's Metrics cuts it off (with a
    warning) before appending, so every line of the file stays a whole event."""
    m = Metrics(tmp_path / "metrics.jsonl")
    m.emit("dispatch", group=0)
    m.close()
    with open(m.path, "ab") as f:
        f.write(b'{"event": "execution", "id": "g0-1", "sta')
    with caplog.at_level(logging.WARNING):
        m = Metrics(m.path)
    m.emit("resume", step=0)
    m.close()
    assert [e["event"] for e in whole_lines(m.path)] == ["dispatch", "resume"]
    assert any("torn last line" in r.getMessage() for r in caplog.records)


def old_run(tmp_path: Path) -> Path:
    """A run directory an older gyre left: a crash's torn line that a resume then ended with
    a newline, so it sits mid-metrics.jsonl, and the resumed run's events after it."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"run_dir": str(run), "cells": 2, "policy": "elastic", "steps": 2,
                                                 "group_size": 2, "groups_per_step": 1}))
    events = [{"event": "dispatch", "t": 0.1, "group": 0, "task": "t", "version": 0, "runs": ["a", "b"]},
              {"event": "execution", "t": 5.0, "id": "a", "group": 0, "status": "completed", "reward": 1.0,
               "valid": True, "t_start": 0.2, "t_end": 5.0}]
    later = [{"event": "resume", "t": 7.0, "step": 0},
             {"event": "execution", "t": 9.0, "id": "b", "group": 0, "status": "completed", "reward": 0.0,
              "valid": True, "t_start": 7.1, "t_end": 9.0},
             {"event": "role", "t": 10.0, "cell": 1, "to": "training", "seconds": 0.5},
             {"event": "step", "t": 12.0, "step": 1, "seconds": 2.0, "cells_training": 1, "groups": 1,
              "staleness_mean": 0.0},
             {"event": "publish", "t": 12.5, "version": 1, "seconds": 0.5}]
    (run / "metrics.jsonl").write_bytes(b"".join(json.dumps(e).encode() + b"\n" for e in events)
                                        + b'{"event": "execution", "id": "x", "sta\n'
                                        + b"".join(json.dumps(e).encode() + b"\n" for e in later))
    return run


def test_the_timeline_and_workload_of_a_resumed_run_skip_a_torn_line_mid_file(tmp_path, caplog, capsys):
    """`gyre up --resume`'s closing timeline (and `gyre sim --workload`) read every whole
    event of a run whose metrics.jsonl holds a torn line mid-file, and warn about it."""
    from gyre.cli.up import write_timeline
    from gyre.coordinator.resume import read_journal
    from gyre.coordinator.workloads import workload_from_metrics

    run = old_run(tmp_path)
    with caplog.at_level(logging.WARNING):
        write_timeline(run)
        workload = workload_from_metrics(run / "metrics.jsonl")
    assert "1 steps" in capsys.readouterr().out and (run / "timeline.svg").exists()
    assert workload.cells == 2 and len(workload.empirical_groups_h[0]) == 2
    assert any("line 3" in r.getMessage() and "torn mid-file" in r.getMessage() for r in caplog.records)
    dispatches, outcomes, last_t = read_journal(run)  # what the resume itself reads
    assert sorted(outcomes) == ["a", "b"] and last_t == 12.5


# --- the records of an execution -----------------------------------------------------------


async def test_records_read_back_skip_a_torn_last_line_and_name_a_torn_middle_one(tmp_path, chat_tokenizer, caplog):
    """A torn last line of nodes.jsonl (a crash mid-write) is skipped with a warning and the
    calls before it load; a torn line mid-file (an older writer's, after a full disk) is an
    error naming the file, the line and the missing node, never an IndexError."""
    async with live_proxy(chat_tokenizer, tmp_path / "run") as (server, engine):
        ex = server.register("e1")
        for text in ("one", "two", "three"):
            assert (await post(server, ex, "chat", text, False))[0] == 200
    nodes = ex.dir / "nodes.jsonl"
    whole = nodes.read_bytes()
    nodes.write_bytes(whole + b'{"id": 99, "par')
    with caplog.at_level(logging.WARNING):
        rec = load_execution(ex.dir)
    assert len(rec.calls) == 3 and len(rec.tree.nodes) == len(ex.tree.nodes)
    assert any("torn last line" in r.getMessage() for r in caplog.records)
    lines = whole.splitlines(keepends=True)
    lines[2] = lines[2][:20] + b"\n"  # node 2 torn; the later nodes and calls whole
    nodes.write_bytes(b"".join(lines))
    with pytest.raises(ValueError, match=r"nodes\.jsonl line 4: node 3 out of order \(node 2 is missing\)"):
        load_execution(ex.dir)
    nodes.write_bytes(b"".join(lines[:2]))  # the nodes cut short where the calls go on
    with pytest.raises(ValueError, match=r"calls\.jsonl line \d: call 'e1-c0000\d' ends at node \d+, but nodes"):
        load_execution(ex.dir)


async def test_sync_fsyncs_every_journal_and_new_folder(tmp_path, chat_tokenizer, monkeypatch):
    """At a checkpoint the coordinator calls Metrics.sync() and ProxyServer.sync(): each file
    written since the last sync is fsynced once (a closed execution's too), and the folders
    holding new files; a second sync with nothing new fsyncs nothing."""
    synced: list[str] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd)))
    m = Metrics(tmp_path / "metrics.jsonl")
    m.emit("dispatch", group=0)
    async with live_proxy(chat_tokenizer, tmp_path / "run") as (server, engine):
        a, b = server.register("a"), server.register("b")
        assert (await post(server, a, "chat", "one", False))[0] == 200
        assert (await post(server, b, "chat", "one", False))[0] == 200
        server.revoke("a")
        m.sync()
        server.sync()
        run = tmp_path / "run" / "executions"
        # Each new file's folder entry with it; executions/ once per new execution folder.
        assert sorted(synced) == sorted([str(tmp_path / "metrics.jsonl"), str(tmp_path)]
                                        + [str(run / x / f) for x in "ab" for f in ("nodes.jsonl", "calls.jsonl")]
                                        + [str(run / "a" / "meta.jsonl")] + [str(run / "a")] * 3
                                        + [str(run / "b")] * 2 + [str(run)] * 2)
        synced.clear()
        m.sync()
        server.sync()
        assert synced == []
        assert (await post(server, b, "chat", "two", False))[0] == 200
        server.sync()
        assert sorted(synced) == [str(run / "b" / "calls.jsonl"), str(run / "b" / "nodes.jsonl")]
    m.close()


def test_a_journal_line_written_with_room_for_half_of_it_is_never_left_torn(disk):
    """The torn line of the issue: the disk has room for part of a line (tmpfs writes what
    fits of its last page and returns short). The record is cut back whole, the file ends
    at its last whole line, and appending later continues it."""
    from gyre.proxy.records import Journal, JournalError

    j = Journal(disk.root / "nodes.jsonl")
    j.append(b'{"id": 0}\n')
    disk.fill()
    with pytest.raises(JournalError) as e:
        j.append(b'{"id": 1, "tokens": [' + b"7, " * 4000 + b'7]}\n')
    assert e.value.errno == errno.ENOSPC and "nodes.jsonl" in str(e.value)
    assert (disk.root / "nodes.jsonl").read_bytes() == b'{"id": 0}\n' and j.size == 10
    disk.free()
    j.append(b'{"id": 1}\n')
    j.close()
    assert (disk.root / "nodes.jsonl").read_bytes() == b'{"id": 0}\n{"id": 1}\n'


async def test_a_full_disk_leaves_the_run_serving_with_no_traceback(disk, chat_tokenizer, caplog):
    """Many calls on a full disk are answered, each a 503, logged once per interval as a
    warning (no traceback, no ERROR record); the run serves again when space returns."""
    async with live_proxy(chat_tokenizer, disk.root / "run", min_free_disk_bytes=0) as (server, engine):
        ex = server.register("e1")
        disk.fill()
        with caplog.at_level(logging.WARNING):
            results = await asyncio.gather(*(post(server, ex, "messages", f"q{i}", False) for i in range(8)))
        assert [r[0] for r in results] == [503] * 8
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
        assert sum("answered 503" in r.getMessage() for r in caplog.records) == 1
        disk.free()
        assert (await post(server, ex, "messages", "q0", False))[0] == 200
