"""binding.py: keys that work only from the processes they were given to (the process backend).

On the process backend every harness runs as the coordinator's user, so each can read the
others' environments (/proc/PID/environ), their keys among them (issue 36: 32 of 32 executions
wrote into a sibling's record with a key read there). A key given to such an execution is
bound to the sessions its sandbox started (each exec is a session leader): the proxy serves a
call with it only when the connecting socket belongs to a process of one of those sessions,
found through /proc/net/tcp{,6} (the socket's inode) and the fds of the sessions' processes.
A process cannot move into another session (setsid makes a new one), so a sibling that read
the key is refused 401, and so is a process of the harness that left its session. Checked off
the event loop (reading /proc/net/tcp takes milliseconds), once per connection and execution
(a connection is remembered by its transport while it lives, never by its port, which a
sibling's next connection may reuse). Not covered: a harness that hands its open connection
to another process (the fd passed over a socket) lends it its key.
"""

from __future__ import annotations

import asyncio
import os
import weakref
from dataclasses import dataclass, field
from pathlib import Path

SESSION_WAIT_S = 10.0  # a call that came before its harness's session was told waits this long


@dataclass(slots=True)
class _Bound:
    sessions: set[int] = field(default_factory=set)
    told: asyncio.Event = field(default_factory=asyncio.Event)


class Bindings:
    """Executions whose keys are bound to sessions (the process backend's): `bind` when the
    key is made, `add` each session its sandbox starts, `forget` when the key is revoked."""

    def __init__(self, proc: str = "/proc"):
        self.proc = proc
        self._bound: dict[str, _Bound] = {}
        self._passed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # transport -> executions it passed for

    def bind(self, execution: str) -> None:
        self._bound.setdefault(execution, _Bound())

    def add(self, execution: str, session: int) -> None:
        bound = self._bound.get(execution)
        if bound is not None:
            bound.sessions.add(session)
            bound.told.set()

    def forget(self, execution: str) -> None:
        self._bound.pop(execution, None)

    def bound(self, execution: str) -> bool:
        return execution in self._bound

    async def refusal(self, execution: str, transport) -> str | None:
        """None when the call may go on (the key is not bound, or the connecting socket is a
        process's of the execution's sessions); else why not, in one line."""
        bound = self._bound.get(execution)
        if bound is None:
            return None
        passed = self._passed.get(transport) if transport is not None else None
        if passed is not None and execution in passed:
            return None
        if not bound.sessions:
            try:
                await asyncio.wait_for(bound.told.wait(), SESSION_WAIT_S)
            except TimeoutError:
                return "this key's harness has not started"
        peer = transport.get_extra_info("peername") if transport is not None else None
        local = transport.get_extra_info("sockname") if transport is not None else None
        if not isinstance(peer, tuple) or not isinstance(local, tuple):
            return "the connection's process cannot be told (not TCP)"
        owner = await asyncio.to_thread(socket_session, self.proc, peer[1], local[1], frozenset(bound.sessions))
        if owner is None:
            return "this key belongs to another execution's processes"
        self._passed.setdefault(transport, set()).add(execution)
        return None


def socket_session(proc: str, peer_port: int, local_port: int, sessions: frozenset[int]) -> int | None:
    """The session, of `sessions`, whose process holds the client end of the TCP connection
    from `peer_port` to our `local_port`; None when no process of them does."""
    inodes = _inodes(proc, peer_port, local_port)
    if not inodes:
        return None
    want = {f"socket:[{inode}]" for inode in inodes}
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        pid = int(name)
        try:
            sid = os.getsid(pid)
        except OSError:
            continue
        if sid not in sessions:
            continue
        try:
            fds = os.listdir(f"{proc}/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"{proc}/{pid}/fd/{fd}") in want:
                    return sid
            except OSError:
                continue
    return None


def _inodes(proc: str, peer_port: int, local_port: int) -> set[str]:
    """Inodes of the sockets whose own port is `peer_port` and whose remote port is
    `local_port` (the client's end, as the kernel lists it)."""
    out = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(proc, "net", table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) < 10:
                continue
            mine, theirs = parts[1].rsplit(":", 1)[1], parts[2].rsplit(":", 1)[1]
            if int(mine, 16) == peer_port and int(theirs, 16) == local_port and parts[9] != "0":
                out.add(parts[9])
    return out
