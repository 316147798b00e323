"""base.py: the sandbox interface every backend implements: six verbs, limits, labels.

A `SandboxBackend` makes `Sandbox`es from a `SandboxSpec` (an image or a host folder, resource
limits, read-only mounts, the labels naming the run and execution). A sandbox has the verbs
the systems gyre is compared with converge on: `exec` (with its deadline enforced inside the
sandbox), `upload`, `download` (never following a link, under a size cap), `stop` (remove it),
`cancel` (kill everything that runs in it, what escaped its exec's process group too, keep its
files; nothing runs in it again), plus `netns_pid` for the proxy-only network (workerd/netns.py binds
the proxy's listener in that process's network namespace), `storage_used` (what the agent
wrote, for storage_mb) and `run_fresh` (one command in a new sandbox from the same image,
holding only the files put in: where the verifier runs, away from all the agent changed).
`reap` removes the sandboxes of runs that are no longer alive. One file per backend:
process.py, docker_api.py (podman, docker), bubblewrap.py; files.py copies out, storage.py
measures. `CappedLog` bounds a log file.
Not the launcher: it decides what runs in a sandbox and when.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from gyre.workerd.wire import GyreError

OUTPUT_TAIL = 64 * 1024  # what of a command's output is kept when it goes to no log


def keep_output(chunk: bytes, log: BinaryIO | None, tail: bytearray) -> None:
    """One chunk of a command's output: into `log`, else into `tail`, of which the last
    OUTPUT_TAIL bytes are kept (the engine's exec and the process backend alike)."""
    if log is not None:
        log.write(chunk)
        log.flush()
    else:
        tail += chunk
        del tail[:-OUTPUT_TAIL]

LABEL_RUN = "gyre.run"  # the run's id (rundir.run_id): which run a sandbox belongs to
LABEL_RUN_DIR = "gyre.run_dir"  # the run directory: the reaper asks whether its run is alive
LABEL_OWNER = "gyre.owner"  # a token per coordinator process: sandboxes of an earlier process are orphans
LABEL_PROCESS = "gyre.process"  # HOST:PID:START of the process that made it: alive means not an orphan
LABEL_EXECUTION = "gyre.execution"
LABEL_TASK = "gyre.task"
IN_SANDBOX_ROOT = "/opt/gyre"  # where read-only harness mounts land inside container sandboxes
COPY_LIMIT_BYTES = 512 << 20  # a download stops here unless its caller gives another cap
SKIPPED_KEPT = 20  # a copy's report names this many of the entries it left out (and counts them all)


def _start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22, after the command's parentheses


def process_label(pid: int | None = None) -> str:
    """This process (or `pid`) as HOST:PID:START, START its start time in clock ticks since
    boot: a pid reused by another process does not match."""
    import socket

    pid = os.getpid() if pid is None else pid
    return f"{socket.gethostname()}:{pid}:{_start_time(pid)}"


def process_alive(label: str | None) -> bool | None:
    """Whether the process a LABEL_PROCESS names still runs; None when it names another
    host (or nothing): the caller falls back to the run directory's lock."""
    import socket

    try:
        host, pid, start = (label or "").rsplit(":", 2)
        pid_n = int(pid)
    except ValueError:
        return None
    if host != socket.gethostname():
        return None
    return start != "None" and _start_time(pid_n) == start


TRUSTED_BUSYBOX = "/.gyre-trusted/busybox"  # inside a copy of the agent's sandbox (run_in_copy): the host's, read-only
PRELOAD_LIST = "/etc/ld.so.preload"


class SandboxError(GyreError):
    """The sandbox layer failed (engine unreachable, image missing, start refused): an
    infrastructure failure, never the agent's fault; the execution ends aborted_infra."""


class ImageBuildError(SandboxError):
    """A task's image could not be built or pulled."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """Resource limits; None: the backend's default (no limit). Where a backend cannot
    enforce one it says so in `Backend.enforces`."""

    cpus: float | None = None
    memory_mb: int | None = None
    pids: int | None = None
    storage_mb: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SandboxSpec:
    execution: str
    labels: Mapping[str, str]  # LABEL_* -> value, put on everything the backend creates
    image: str | None = None  # container backends: the image to start
    workdir: str | None = None  # process/bubblewrap: the host folder; containers: None -> the image's WORKDIR
    limits: Limits = field(default_factory=Limits)
    mounts: Mapping[str, str] = field(default_factory=dict)  # host path -> path inside, read-only
    internet: bool = False  # False: no network but the proxy listener


@dataclass(frozen=True, slots=True)
class ExecResult:
    code: int | None  # None: no exit status could be read (the engine lost the process)
    timed_out: bool
    output: bytes = b""  # stdout + stderr, the tail, when not streamed to a log

    @property
    def killed(self) -> bool:
        """Exit 137: SIGKILL, which is how an OOM kill shows in a container."""
        return self.code == 137


@dataclass
class CopyReport:
    """What a `download` did: the bytes it copied (held to its cap: file contents, plus a
    header's worth per entry where it copies an archive), the entries it left out and why (a
    link that leads out of the copy, a device, a name that escapes), and whether it stopped
    at its cap (`truncated`: what comes after was not copied)."""

    bytes: int = 0
    skipped: list[str] = field(default_factory=list)  # the first SKIPPED_KEPT of them, each with why
    left_out: int = 0  # how many entries were left out
    truncated: bool = False
    # Path inside the copied folder -> (uid, gid), for the entries not owned by root: an upload
    # of the copy (the verifier's fresh sandbox) gives them back their owners.
    owners: dict[str, tuple[int, int]] = field(default_factory=dict)

    def skip(self, why: str) -> None:
        self.left_out += 1
        if len(self.skipped) < SKIPPED_KEPT:
            self.skipped.append(why)

    def problem(self) -> str | None:
        """One line for the execution's record, None when the copy is whole."""
        parts = []
        if self.truncated:
            parts.append(f"stopped at its cap after {self.bytes >> 20} MiB: the rest was not copied")
        if self.left_out:
            parts.append(f"{self.left_out} entries left out ({'; '.join(self.skipped[:3])}"
                         f"{', ...' if self.left_out > 3 else ''})")
        return "; ".join(parts) or None


@dataclass(frozen=True, slots=True)
class Put:
    """A host file or folder to put at `dest` inside a fresh sandbox (`Sandbox.run_fresh`);
    `owners` (path inside the folder -> uid, gid; the rest root's) where given, else the
    host files' own owners."""

    src: Path
    dest: str
    owners: Mapping[str, tuple[int, int]] | None = None


class CappedLog:
    """A binary log file that takes at most `limit` bytes of output, then one line saying so;
    later output is dropped (and still drained by the caller, so the writer never blocks).
    Has no `fileno`: a backend copies through it instead of handing the file to a child."""

    def __init__(self, f: BinaryIO, limit: int, name: str = "log"):
        self.f, self.limit, self.name = f, limit, name
        self.written = 0
        self.truncated = False

    def write(self, data: bytes) -> int:
        room = self.limit - self.written
        if room > 0:
            self.f.write(data[:room])
            self.written += min(room, len(data))
        if len(data) > room and not self.truncated:
            self.truncated = True
            self.f.write(f"\ngyre: {self.name} reached its cap of {self.limit >> 20} MiB; "
                         "the rest of the output was dropped\n".encode())
        return len(data)

    def flush(self) -> None:
        self.f.flush()


class Sandbox(abc.ABC):
    """One live sandbox. Paths given to its verbs are paths inside it."""

    spec: SandboxSpec
    workdir: str  # where the agent starts (inside)
    # Told, on the event loop, what identifies each exec as it starts: {"session": sid} on the
    # process backends (the proxy binds keys to it), {"exec": id, "token": t} in a container
    # (what finds the exec again after a restart: ContainerSandbox.wait_detached).
    on_start: Callable[[dict], None] | None = None

    @abc.abstractmethod
    async def exec(self, argv: list[str], *, env: Mapping[str, str] | None = None, cwd: str | None = None,
                   timeout_s: float | None = None, grace_s: float = 5.0, log: BinaryIO | None = None,
                   user: str | None = None) -> ExecResult:
        """Run `argv` to its end or its deadline, enforced inside the sandbox: at
        `timeout_s` it gets SIGTERM, `grace_s` later SIGKILL, with its whole process group.
        Output goes to `log` as it comes, else the tail is returned. Cancelling the call
        kills the command inside (the host-side client alone would leave it running)."""

    @abc.abstractmethod
    async def upload(self, src: Path, dest: str) -> None:
        """Copy a host file or folder to `dest` inside (a folder's contents land in `dest`)."""

    @abc.abstractmethod
    async def download(self, src: str, dest: Path, *, limit_bytes: int = COPY_LIMIT_BYTES) -> CopyReport:
        """Copy the file or folder `src` inside to the host path `dest` (a folder's contents
        land in `dest`). A link is copied as a link or, where it leads out of the copy, left
        out; nothing is ever read through one. The copy stops after `limit_bytes`. What was
        left out is in the report; a missing `src` raises FileNotFoundError, an engine that
        fails SandboxError."""

    async def read_file(self, path: str, limit: int = 1 << 20) -> bytes | None:
        """The bytes of a file inside (at most `limit`), None when it is not there."""
        import tempfile

        with tempfile.TemporaryDirectory(prefix="gyre-read-") as tmp:
            try:
                await self.download(path, Path(tmp) / "f", limit_bytes=limit)
            except FileNotFoundError:
                return None
            target = Path(tmp) / "f"
            if not target.is_file():
                return None
            with target.open("rb") as f:
                return f.read(limit)

    @abc.abstractmethod
    async def cancel(self) -> None:
        """Kill every process in the sandbox, also what left its exec's process group (a
        daemon, a `setsid`); its files stay (for `download`). The launcher calls it before
        anything is scored: nothing of the agent's may run then. A container sandbox never
        runs anything again after it (a restart would run the agent's files: its `sleep`);
        SandboxError when it cannot be sure."""

    async def run_fresh(self, argv: list[str], *, puts: Sequence[Put] = (), env: Mapping[str, str] | None = None,
                        timeout_s: float | None = None, grace_s: float = 5.0, log: BinaryIO | None = None,
                        read: Sequence[str] = ()) -> tuple[ExecResult, dict[str, bytes | None]]:
        """Run `argv` once in a new sandbox made from this one's image, limits and network,
        holding the image's files and `puts` alone: nothing this sandbox ran or wrote outside
        what is put there reaches it (the verifier's rule: the agent's tools, preload list
        and Python hooks stay behind). The deadline and output as `exec`'s. Returns the
        result and the bytes of each `read` path once it ended (None where missing); the
        new sandbox is removed. SandboxError where the backend cannot."""
        raise SandboxError(f"{type(self).__name__} cannot start a fresh sandbox from an image")

    async def run_in_copy(self, argv: list[str], *, busybox: Path, mounts: Mapping[str, str] | None = None,
                          env: Mapping[str, str] | None = None, timeout_s: float | None = None, grace_s: float = 5.0,
                          log: BinaryIO | None = None, read: Sequence[str] = ()
                          ) -> tuple[ExecResult, dict[str, bytes | None]]:
        """Run `argv` once in a new sandbox made from this one's files as the agent left them
        (its processes gone: call after `cancel`), for tasks that check system state outside
        the workdir. Its command never comes from those files: the host's statically linked
        `busybox` is mounted read-only at TRUSTED_BUSYBOX and runs `argv` under its own
        `timeout`; an empty file is mounted over /etc/ld.so.preload, `mounts` (host -> inside)
        read-only. Returns as `run_fresh`; the new sandbox and what was made for it are
        removed. SandboxError where the backend cannot."""
        raise SandboxError(f"{type(self).__name__} cannot verify in a copy of the agent's sandbox")

    async def changes(self) -> list[dict]:
        """What the sandbox changed against its image (`podman diff`): {"path", "kind"} with kind
        changed, added or deleted. SandboxError where the backend cannot tell."""
        raise SandboxError(f"{type(self).__name__} cannot list the changes of its sandbox")

    async def storage_used(self) -> int | None:
        """Bytes written in the sandbox so far (a container's writable layer, a host
        workspace's files), None when the backend cannot tell; storage.py holds the
        harness to the task's storage_mb with it."""
        return None

    @abc.abstractmethod
    async def stop(self) -> None:
        """Remove the sandbox and what it holds (idempotent)."""

    def netns_pid(self) -> int | None:
        """A host pid in the sandbox's network namespace (for the proxy listener), or None
        when the sandbox shares the host's network or runs on another host."""
        return None

    def engine_pid(self) -> int | None:
        """A pid in the sandbox's network namespace as its own host numbers it (for a relay
        made there by that host's workerd), or None."""
        return self.netns_pid()


class SandboxBackend(abc.ABC):
    name: str
    isolated_network: bool = False  # sandboxes have their own network namespace
    needs_image: bool = False  # a task must name an image (or a Dockerfile)
    # Harnesses share the coordinator's host and user (the process backend): a key works only
    # from the sessions its sandbox started (`Sandbox.on_start`, proxy/binding.py).
    binds_keys: bool = False
    enforces: frozenset[str] = frozenset()  # the Limits fields it enforces

    async def open(self) -> None:
        """Connect (or start the engine service); raise SandboxError when it cannot."""

    async def close(self) -> None:
        """Release what `open` took (a podman service it started)."""

    async def ping(self, timeout_s: float = 5.0) -> None:
        """SandboxError unless the engine answers (backends without one always do)."""

    async def prepare(self, build_dir: str | None, *, image: str | None, dockerfile: str | None = None,
                      timeout_s: float = 600.0, name: str = "task") -> str | None:
        """The image a task's sandbox starts from: `image` as given (present or pulled), or
        built from `build_dir` under a content-hashed tag (cached). ImageBuildError if not."""
        return None

    @abc.abstractmethod
    async def create(self, spec: SandboxSpec) -> Sandbox:
        """Start a sandbox; SandboxError when it cannot."""

    async def reap(self, alive) -> int:
        """Remove sandboxes gyre made whose run is not alive (`alive(labels) -> bool`);
        the number removed."""
        return 0
