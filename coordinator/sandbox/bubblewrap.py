"""bubblewrap.py: the `bubblewrap` backend: a light local sandbox for harnesses that need no image.

The system is read-only (/usr, /etc and the merged-/usr links; the harness's own Python and
gyre's source, read-only, so the host's harness commands run unchanged), the execution's
folder (workspace and harness state) is the one writable place, /tmp is private, and every
command gets private PID, IPC and UTS namespaces. The network namespace is the sandbox's
own: a holder process (`bwrap --unshare-net ... sleep infinity`) keeps it alive, each `exec`
enters it (nsenter) and the proxy's listener is bound in it (netns.py), so the harness
reaches the proxy and nothing else. An exec's PID namespace ends with its command (bwrap's
init goes, and the kernel kills what it left); `cancel` also sweeps for the sandbox's
markers, as the process backend does. `stop` returns once every process of the sandbox is
gone. Paths inside are the host's paths. Needs bwrap and, for entering the namespace, root.
Limits are not enforced (no cgroup of its own).
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from gyre.coordinator.sandbox.base import SandboxBackend, SandboxError, SandboxSpec
from gyre.coordinator.sandbox.process import ProcessSandbox, killpg, markers, reap_processes, run_group

log = logging.getLogger("gyre.coordinator")
SYSTEM_RO = ("/usr", "/etc", "/opt")
STOP_WAIT_S = 10.0  # a killed sandbox's processes are waited for this long (SIGKILL: microseconds)
MERGED_LINKS = ("/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")


def _system_args() -> list[str]:
    args: list[str] = []
    for path in SYSTEM_RO:
        if os.path.isdir(path):
            args += ["--ro-bind", path, path]
    for link in MERGED_LINKS:
        if os.path.islink(link):
            args += ["--symlink", os.readlink(link), link]
        elif os.path.isdir(link):
            args += ["--ro-bind", link, link]
    return args


def _harness_roots() -> list[str]:
    """This Python and gyre's source, visible read-only (the demo harness runs from them)."""
    gyre_root = str(Path(__file__).resolve().parents[2])
    roots = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, gyre_root)}
    return sorted(r for r in roots if not any(r == s or r.startswith(s + "/") for s in SYSTEM_RO))


def unavailable() -> str | None:
    """Why this host cannot run bubblewrap sandboxes, ending with the fix; None when it can
    (open and the preflight both ask)."""
    if shutil.which("bwrap") is None:
        return "the `bwrap` command is not on PATH; install it (apt-get install -y bubblewrap)"
    if shutil.which("nsenter") is None:  # each exec enters the sandbox's network namespace with it
        return "the `nsenter` command is not on PATH; install it (apt-get install -y util-linux)"
    if os.geteuid() != 0:
        return "entering its sandboxes' proxy-only network needs root; run gyre as root"
    return None


class BubblewrapSandbox(ProcessSandbox):
    def __init__(self, spec: SandboxSpec, folder: str, holder: subprocess.Popen, child: int, bwrap: str,
                 nsenter: str, pidfd: int | None = None):
        super().__init__(spec)
        self.folder = folder  # the writable execution folder (the workspace is inside it)
        self.holder = holder  # bwrap itself, in the host's namespaces
        # bwrap's child: the init of the sandbox's PID namespace, in its network namespace
        # (`sleep` runs under it); `pidfd` refers to it, reuse-proof, for the wait in `stop`.
        self.child = child
        self.pidfd = pidfd
        self.bwrap, self.nsenter = bwrap, nsenter

    def netns_pid(self) -> int | None:
        return self.child if self.holder.poll() is None else None

    def _spared_groups(self) -> frozenset[int]:
        return frozenset({self.holder.pid})  # the holder carries the markers too; `stop` ends it

    def _argv(self, argv: list[str], cwd: str) -> list[str]:
        binds = []
        for root in _harness_roots():
            binds += ["--ro-bind", root, root]
        for host, inside in self.spec.mounts.items():
            binds += ["--ro-bind", host, inside]
        # /tmp first: the execution folder may live under it (mounts apply in order).
        return [self.nsenter, f"--net=/proc/{self.child}/ns/net", "--", self.bwrap, "--tmpfs", "/tmp",
                *_system_args(), *binds, "--bind", self.folder, self.folder, "--proc", "/proc", "--dev", "/dev",
                "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--die-with-parent", "--new-session",
                "--chdir", cwd, "--", *argv]

    async def exec(self, argv, *, env=None, cwd=None, timeout_s=None, grace_s=5.0, log=None, user=None):
        if self.netns_pid() is None:
            raise SandboxError("the sandbox's network holder has exited")
        full = {**os.environ, **(env or {}), **markers(self.spec.labels)}
        where = str(self._host(cwd)) if cwd else self.workdir
        return await run_group(self._argv(list(argv), where), env=full, cwd=self.folder, timeout_s=timeout_s,
                               grace_s=grace_s, log=log, procs=self._procs)

    async def stop(self) -> None:
        await super().stop()
        pidfd, self.pidfd = self.pidfd, None
        await asyncio.to_thread(end_holder, self.holder, pidfd)


class BubblewrapBackend(SandboxBackend):
    name = "bubblewrap"
    isolated_network = True

    async def open(self) -> None:
        why = unavailable()
        if why is not None:
            raise SandboxError(f"sandbox bubblewrap: {why}")
        self.bwrap, self.nsenter = shutil.which("bwrap"), shutil.which("nsenter")

    async def create(self, spec: SandboxSpec) -> BubblewrapSandbox:
        if not spec.workdir:
            raise SandboxError("the bubblewrap backend needs a host workdir")
        Path(spec.workdir).mkdir(parents=True, exist_ok=True)
        folder = str(Path(spec.workdir).resolve().parent)  # executions/ID: workspace and harness state
        env = {**os.environ, **markers(spec.labels)}
        holder = subprocess.Popen([self.bwrap, *_system_args(), "--unshare-net", "--unshare-pid", "--die-with-parent",
                                   "--", "sleep", "infinity"], env=env, stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        try:
            # The namespace exists once bwrap has made its child (bwrap itself stays in the host's).
            child = await asyncio.to_thread(_wait_child, holder)
            pidfd = _pidfd(child) if child is not None else None
        except BaseException:  # cancelled while starting: nothing of it may outlive the call
            await asyncio.shield(asyncio.to_thread(end_holder, holder, None))
            holder.stderr.close()
            raise
        if child is None:
            err = holder.stderr.read().decode(errors="replace") if holder.poll() is not None else ""
            await asyncio.to_thread(end_holder, holder, None)
            holder.stderr.close()
            raise SandboxError(f"bubblewrap could not start: {err.strip() or 'no child process'}")
        holder.stderr.close()
        return BubblewrapSandbox(spec, folder, holder, child, self.bwrap, self.nsenter, pidfd)

    async def reap(self, alive) -> int:
        return await asyncio.to_thread(reap_processes, alive)


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):  # gone already, or a kernel before 5.3: `stop` does not wait for it
        return None


def end_holder(holder: subprocess.Popen, pidfd: int | None, timeout_s: float = STOP_WAIT_S) -> None:
    """SIGKILL a sandbox's holder and its PID namespace, and return once they are gone (or
    after `timeout_s`). bwrap exits before its namespace's processes do: without the wait
    they would still be dying when the reaper looks at shutdown, and be reported as orphans."""
    if holder.poll() is None:  # not reaped, so its pid (the group's id) is not reused yet
        killpg(holder.pid, signal.SIGKILL)  # bwrap, the namespace's init and `sleep` share its group
    if pidfd is not None:
        try:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)  # the init: the kernel ends the whole namespace
        except ProcessLookupError:
            pass
    try:
        holder.wait(timeout_s)
    except subprocess.TimeoutExpired:
        log.warning("bubblewrap: sandbox holder %d not gone %g s after SIGKILL", holder.pid, timeout_s)
    if pidfd is not None:
        # Readable once the init has exited, which the kernel lets happen only after every
        # other process of its namespace is gone.
        try:
            if not select.select([pidfd], [], [], timeout_s)[0]:
                log.warning("bubblewrap: sandbox namespace of %d not gone %g s after SIGKILL", holder.pid, timeout_s)
        finally:
            os.close(pidfd)


def _wait_child(holder: subprocess.Popen, timeout_s: float = 10.0) -> int | None:
    """The pid of the holder's child in the new namespaces (their PID namespace's init), polling /proc."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and holder.poll() is None:
        for pid in _descendants(holder.pid):
            try:
                if os.readlink(f"/proc/{pid}/ns/net") != os.readlink(f"/proc/{holder.pid}/ns/net"):
                    return pid
            except OSError:
                continue
        time.sleep(0.01)
    return None


def _descendants(pid: int) -> list[int]:
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    out = [int(c) for c in children]
    for c in list(out):
        out += _descendants(c)
    return out
