"""process.py: the `process` backend: a folder on the coordinator's host and plain subprocesses.

No isolation (the embedded default and harnesses that need none): the workspace is a host
folder, `exec` starts the command in its own session with the host's environment plus the
given variables, and the deadline is SIGTERM to its process group, SIGKILL after the grace;
what is left of the group when the command ends is SIGKILLed. Every process it starts
carries GYRE_SANDBOX_OWNER / GYRE_SANDBOX_RUN_DIR (and the maker's process and the
execution) in its environment, which is how `cancel` finds what left the group (a `setsid`
daemon) and `reap` the harnesses a killed coordinator left behind. A process that drops its
environment (`env -i`) escapes both: this backend isolates nothing (ISOLATION). Every harness
runs as the coordinator's user, so each can read the others' environments (/proc/PID/environ),
their API keys among them; the proxy serves a key only to the sessions its sandbox started
(`binds_keys`, proxy/binding.py), so a sibling cannot act as another with it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import shutil
import signal
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import BinaryIO

from gyre.coordinator.sandbox.base import (
    COPY_LIMIT_BYTES,
    LABEL_EXECUTION,
    LABEL_OWNER,
    LABEL_PROCESS,
    LABEL_RUN_DIR,
    CopyReport,
    ExecResult,
    Sandbox,
    SandboxBackend,
    SandboxError,
    SandboxSpec,
    keep_output,
)
from gyre.coordinator.sandbox.files import copy_capped

log = logging.getLogger("gyre.coordinator")
READ_GRACE_S = 5.0  # output still coming once the command has ended is read this long, then dropped
KILL_ROUNDS = 100  # `cancel` sweeps for marked processes until one finds none, at most this often
ENV_OWNER, ENV_RUN_DIR, ENV_PROCESS = "GYRE_SANDBOX_OWNER", "GYRE_SANDBOX_RUN_DIR", "GYRE_SANDBOX_PROCESS"
ENV_EXECUTION = "GYRE_SANDBOX_EXECUTION"
ISOLATION = ("isolates nothing: harnesses run as the coordinator's user with its files, its environment and "
             "network; each can read the others' environments, but a key works only from its own "
             "execution's processes")
_ENV_MARKERS = {ENV_OWNER.encode(), ENV_RUN_DIR.encode(), ENV_PROCESS.encode(), ENV_EXECUTION.encode()}


async def _read_tail(stream: asyncio.StreamReader | None, log: BinaryIO | None, tail: bytearray) -> None:
    """Copy `stream` to `log`, else keep its tail in `tail` (filled as it comes: a reader
    cancelled after the grace leaves what it had)."""
    if stream is None:
        return
    while chunk := await stream.read(65536):
        keep_output(chunk, log, tail)


def exit_of(pid: int) -> asyncio.Future:
    """A future done once process `pid` has exited, from its pidfd. asyncio's own
    `Process.wait()` returns only once its pipes have closed too, which a child that keeps
    them open (a daemon the command left) would put off for as long as it lives."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:  # gone (and reaped) already
        fut.set_result(None)
        return fut

    def release(_=None) -> None:
        loop.remove_reader(fd)
        os.close(fd)

    def exited() -> None:
        if not fut.done():
            fut.set_result(None)

    loop.add_reader(fd, exited)
    fut.add_done_callback(release)  # also when the waiter is cancelled
    return fut


async def end_pipes(proc: asyncio.subprocess.Process, grace_s: float, *readers: asyncio.Future) -> None:
    """Once `proc` has exited: let `readers` finish for `grace_s`, then close its pipes (a
    process that left its group may still hold them) and reap it."""
    pending = [r for r in readers if not r.done()]
    if pending:
        await asyncio.wait(pending, timeout=grace_s)
    transport = getattr(proc, "_transport", None)  # asyncio has no public way to give up a child's pipes
    if transport is not None:
        for fd in (1, 2):
            pipe = transport.get_pipe_transport(fd)
            if pipe is not None:
                pipe.close()
    try:
        await asyncio.wait_for(proc.wait(), 10.0)  # returns once the pipes are closed and it is reaped
    except TimeoutError:
        log.warning("process %d not reaped 10 s after its exit", proc.pid)


def killpg(pid: int, sig: int) -> bool:
    try:
        os.killpg(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


async def run_group(argv: list[str], *, env: Mapping[str, str], cwd: str | None, timeout_s: float | None,
                    grace_s: float, log: BinaryIO | None, procs: set,
                    started: Callable[[int], None] | None = None) -> ExecResult:
    """`argv` as a session leader; its group is stopped at the deadline or on cancellation,
    and what is left of it SIGKILLed when the leader ends. `started` is told the session's
    id (the leader's pid) once it runs."""
    # A plain log file takes the output directly (no copy through the event loop); a capped
    # one (no fileno) is written through here.
    direct = log is not None and hasattr(log, "fileno")
    if direct:
        log.flush()
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, cwd=cwd, env=dict(env), stdin=asyncio.subprocess.DEVNULL,
            stdout=log if direct else asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            start_new_session=True)
    except OSError as e:
        raise SandboxError(f"cannot start {argv[0]!r}: {e}") from None
    procs.add(proc)
    if started is not None:
        started(proc.pid)
    tail = bytearray()
    reader = asyncio.ensure_future(_read_tail(None if direct else proc.stdout, log, tail))
    exited = exit_of(proc.pid)
    timed_out = False
    try:
        try:
            await asyncio.wait_for(asyncio.shield(exited), timeout_s)
        except TimeoutError:
            timed_out = True
            await stop_group(proc, grace_s, exited)
        except asyncio.CancelledError:
            await asyncio.shield(_stopped(proc, grace_s, exited, reader))
            raise
        # The leader has ended (its pid names the group while any member lives, so it is
        # not reused yet): nothing it started in its group outlives it.
        killpg(proc.pid, signal.SIGKILL)
        # A process that left the group and holds the pipe must not hold the call: the
        # output is read for a grace, then what came is kept.
        await end_pipes(proc, READ_GRACE_S, reader)
        return ExecResult(proc.returncode, timed_out, bytes(tail))
    finally:
        procs.discard(proc)
        exited.cancel()
        if not reader.done():
            reader.cancel()


async def _stopped(proc: asyncio.subprocess.Process, grace_s: float, exited: asyncio.Future,
                   reader: asyncio.Future) -> None:
    await stop_group(proc, grace_s, exited)
    await end_pipes(proc, 0.0, reader)


async def stop_group(proc: asyncio.subprocess.Process, grace_s: float, exited: asyncio.Future | None = None) -> None:
    """SIGTERM the process group, SIGKILL after the grace period (the group's stragglers
    too, once the leader is gone). `exited`: the leader's `exit_of`."""
    own = exited is None
    exited = exit_of(proc.pid) if own else exited
    try:
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            if exited.done() or proc.returncode is not None or not killpg(proc.pid, sig):
                break
            try:
                await asyncio.wait_for(asyncio.shield(exited), wait)
                break
            except TimeoutError:
                continue
        killpg(proc.pid, signal.SIGKILL)
    finally:
        if own:
            exited.cancel()


def _copy(src: Path, dest: Path) -> None:
    if not src.exists():
        raise FileNotFoundError(str(src))
    if src.is_dir():
        shutil.copytree(src, dest, dirs_exist_ok=True, symlinks=True)
    else:
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest)


def kill_marked(owner: str, execution: str, spare_groups: frozenset[int] = frozenset()) -> int:
    """SIGKILL every process whose environment carries this sandbox's markers (but those in
    `spare_groups`), sweeping until a sweep finds none: a process forking as it dies is
    caught by the next. Returns how many were killed; SandboxError when they keep coming."""
    if not owner or not execution:
        return 0  # an unlabelled sandbox: its markers would match every other unlabelled one
    want = {ENV_OWNER: owner, ENV_EXECUTION: execution}
    killed = 0
    for _ in range(KILL_ROUNDS):
        found = 0
        for entry in os.listdir("/proc"):
            if entry.isdigit() and _kill_if_marked(int(entry), want, spare_groups):
                found += 1
        if not found:
            return killed
        killed += found
    raise SandboxError(f"processes of execution {execution} kept appearing after {KILL_ROUNDS} sweeps")


def _kill_if_marked(pid: int, want: dict[str, str], spare_groups: frozenset[int]) -> bool:
    try:
        fd = os.pidfd_open(pid)  # pins the process: a pid reused after the check is not signalled
    except OSError:
        return False
    try:
        env = _environ(str(pid))
        if any(env.get(k) != v for k, v in want.items()) or os.getpgid(pid) in spare_groups:
            return False
        if select.select([fd], [], [], 0)[0]:  # it has exited already: /proc may show another now
            return False
        signal.pidfd_send_signal(fd, signal.SIGKILL)
        return True
    except (ProcessLookupError, PermissionError):
        return False
    finally:
        os.close(fd)


def tree_bytes(root: str) -> int:
    """Disk blocks in use under `root`, links not followed (a sparse file counts what it holds)."""
    total = 0
    for here, dirs, files in os.walk(root):
        for name in files + dirs:
            try:
                total += os.lstat(os.path.join(here, name)).st_blocks * 512
            except OSError:
                continue
    return total


class ProcessSandbox(Sandbox):
    def __init__(self, spec: SandboxSpec):
        self.spec = spec
        self.workdir = spec.workdir or ""
        self._procs: set[asyncio.subprocess.Process] = set()

    def _host(self, path: str) -> Path:
        return Path(self.workdir, path) if not os.path.isabs(path) else Path(path)

    async def exec(self, argv, *, env=None, cwd=None, timeout_s=None, grace_s=5.0, log=None, user=None):
        full = {**os.environ, **(env or {}), **markers(self.spec.labels)}
        return await run_group(argv, env=full, cwd=str(self._host(cwd)) if cwd else self.workdir,
                               timeout_s=timeout_s, grace_s=grace_s, log=log, procs=self._procs,
                               started=self._started)

    def _started(self, session: int) -> None:
        if self.on_start is not None:
            self.on_start({"session": session})

    async def upload(self, src: Path, dest: str) -> None:
        await asyncio.to_thread(_copy, Path(src), self._host(dest))

    async def download(self, src: str, dest: Path, *, limit_bytes: int = COPY_LIMIT_BYTES) -> CopyReport:
        host = self._host(src)
        if host.resolve() == Path(dest).resolve():
            return CopyReport()  # the workspace is already where the run directory keeps it
        return await asyncio.to_thread(copy_capped, host, Path(dest), limit_bytes)

    def _spared_groups(self) -> frozenset[int]:
        return frozenset()  # bubblewrap: its network holder's

    async def cancel(self) -> None:
        await asyncio.gather(*(stop_group(p, 0.0) for p in list(self._procs)))
        labels = self.spec.labels
        await asyncio.to_thread(kill_marked, labels.get(LABEL_OWNER, ""), labels.get(LABEL_EXECUTION, ""),
                                self._spared_groups())

    async def storage_used(self) -> int | None:
        return await asyncio.to_thread(tree_bytes, self.workdir)

    async def stop(self) -> None:
        await self.cancel()  # the folder is the run directory's: it stays


class ProcessBackend(SandboxBackend):
    name = "process"
    enforces = frozenset()
    isolation = ISOLATION
    binds_keys = True  # harnesses share the host: a key works only from its own sessions (proxy/binding.py)

    async def create(self, spec: SandboxSpec) -> Sandbox:
        if not spec.workdir:
            raise SandboxError("the process backend needs a host workdir")
        Path(spec.workdir).mkdir(parents=True, exist_ok=True)
        return ProcessSandbox(spec)

    async def reap(self, alive) -> int:
        return await asyncio.to_thread(reap_processes, alive)


def markers(labels) -> dict[str, str]:
    """A sandbox's labels as the environment markers its processes carry (the reaper reads them)."""
    return {ENV_OWNER: labels.get(LABEL_OWNER, ""), ENV_RUN_DIR: labels.get(LABEL_RUN_DIR, ""),
            ENV_PROCESS: labels.get(LABEL_PROCESS, ""), ENV_EXECUTION: labels.get(LABEL_EXECUTION, "")}


def _environ(pid: str) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep and key in _ENV_MARKERS:
            out[key.decode()] = value.decode(errors="replace")
    return out


def reap_processes(alive) -> int:
    """SIGKILL the process groups gyre started for runs that are not alive; returns how many
    sandboxes they made up (one sandbox is several processes: a bubblewrap holder alone is three)."""
    reaped: set[tuple[str, str]] = set()
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        env = _environ(entry)
        if ENV_OWNER not in env:
            continue
        execution = env.get(ENV_EXECUTION, "")
        if alive({LABEL_OWNER: env[ENV_OWNER], LABEL_RUN_DIR: env.get(ENV_RUN_DIR, ""),
                  LABEL_PROCESS: env.get(ENV_PROCESS, ""), LABEL_EXECUTION: execution}):
            continue
        try:
            pgid = os.getpgid(int(entry))
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            continue
        # A process of an older gyre carries no execution: its group stands for its sandbox.
        reaped.add((env[ENV_OWNER], execution or f"group {pgid}"))
    return len(reaped)
