"""process.py: the `process` backend: a folder on the coordinator's host and plain subprocesses.

No isolation (the embedded default and harnesses that need none): the workspace is a host
folder, `exec` starts the command in its own session with the host's environment plus the
given variables, and the deadline is SIGTERM to its process group, SIGKILL after the grace.
Every process it starts carries GYRE_SANDBOX_OWNER / GYRE_SANDBOX_RUN_DIR (and the maker's
process and the execution) in its environment, which is how `reap` finds the harnesses a
killed coordinator left behind.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import BinaryIO

from gyre.coordinator.sandbox.base import (
    LABEL_EXECUTION,
    LABEL_OWNER,
    LABEL_PROCESS,
    LABEL_RUN_DIR,
    ExecResult,
    Sandbox,
    SandboxBackend,
    SandboxError,
    SandboxSpec,
)

OUTPUT_TAIL = 64 * 1024
ENV_OWNER, ENV_RUN_DIR, ENV_PROCESS = "GYRE_SANDBOX_OWNER", "GYRE_SANDBOX_RUN_DIR", "GYRE_SANDBOX_PROCESS"
ENV_EXECUTION = "GYRE_SANDBOX_EXECUTION"
_ENV_MARKERS = {ENV_OWNER.encode(), ENV_RUN_DIR.encode(), ENV_PROCESS.encode(), ENV_EXECUTION.encode()}


async def _read_tail(stream: asyncio.StreamReader | None, log: BinaryIO | None) -> bytes:
    tail = bytearray()
    if stream is None:
        return b""
    while chunk := await stream.read(65536):
        if log is not None:
            log.write(chunk)
            log.flush()
        else:
            tail += chunk
            del tail[:-OUTPUT_TAIL]
    return bytes(tail)


def killpg(pid: int, sig: int) -> bool:
    try:
        os.killpg(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


async def run_group(argv: list[str], *, env: Mapping[str, str], cwd: str | None, timeout_s: float | None,
                    grace_s: float, log: BinaryIO | None, procs: set) -> ExecResult:
    """`argv` as a session leader; its group is stopped at the deadline or on cancellation."""
    # A log file takes the output directly (no copy through the event loop).
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
    reader = asyncio.ensure_future(_read_tail(None if direct else proc.stdout, log))
    timed_out = False
    try:
        try:
            await asyncio.wait_for(proc.wait(), timeout_s)
        except TimeoutError:
            timed_out = True
            await stop_group(proc, grace_s)
        except asyncio.CancelledError:
            await asyncio.shield(stop_group(proc, grace_s))
            raise
        # A child that kept the pipe open (a daemon it forked) must not hold the call.
        try:
            output = await asyncio.wait_for(asyncio.shield(reader), 5.0)
        except TimeoutError:
            killpg(proc.pid, signal.SIGKILL)
            output = await reader
        return ExecResult(proc.returncode, timed_out, output)
    finally:
        procs.discard(proc)
        if not reader.done():
            reader.cancel()


async def stop_group(proc: asyncio.subprocess.Process, grace_s: float) -> None:
    """SIGTERM the process group, SIGKILL after the grace period."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        if proc.returncode is not None or not killpg(proc.pid, sig):
            return
        try:
            await asyncio.wait_for(proc.wait(), wait)
            return
        except TimeoutError:
            continue


def _copy(src: Path, dest: Path) -> None:
    if not src.exists():
        raise FileNotFoundError(str(src))
    if src.is_dir():
        shutil.copytree(src, dest, dirs_exist_ok=True, symlinks=True)
    else:
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest)


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
                               timeout_s=timeout_s, grace_s=grace_s, log=log, procs=self._procs)

    async def upload(self, src: Path, dest: str) -> None:
        await asyncio.to_thread(_copy, Path(src), self._host(dest))

    async def download(self, src: str, dest: Path) -> None:
        host = self._host(src)
        if host.resolve() == Path(dest).resolve():
            return  # the workspace is already where the run directory keeps it
        await asyncio.to_thread(_copy, host, Path(dest))

    async def cancel(self) -> None:
        await asyncio.gather(*(stop_group(p, 0.0) for p in list(self._procs)))

    async def stop(self) -> None:
        await self.cancel()  # the folder is the run directory's: it stays


class ProcessBackend(SandboxBackend):
    name = "process"
    enforces = frozenset()

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
