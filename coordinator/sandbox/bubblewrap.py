"""bubblewrap.py: the `bubblewrap` backend: a light local sandbox for harnesses that need no image.

The system is read-only (/usr, /etc and the merged-/usr links; the harness's own Python and
gyre's source, read-only, so the host's harness commands run unchanged), the execution's
folder (workspace and harness state) is the one writable place, /tmp is private, and every
command gets private PID, IPC and UTS namespaces. The network namespace is the sandbox's
own: a holder process (`bwrap --unshare-net ... sleep infinity`) keeps it alive, each `exec`
enters it (nsenter) and the proxy's listener is bound in it (netns.py), so the harness
reaches the proxy and nothing else. Paths inside are the host's paths. Needs bwrap and,
for entering the namespace, root. Limits are not enforced (no cgroup of its own).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from gyre.coordinator.sandbox.base import SandboxBackend, SandboxError, SandboxSpec
from gyre.coordinator.sandbox.process import ProcessSandbox, markers, reap_processes, run_group

SYSTEM_RO = ("/usr", "/etc", "/opt")
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


class BubblewrapSandbox(ProcessSandbox):
    def __init__(self, spec: SandboxSpec, folder: str, holder: subprocess.Popen, child: int, bwrap: str,
                 nsenter: str):
        super().__init__(spec)
        self.folder = folder  # the writable execution folder (the workspace is inside it)
        self.holder = holder  # bwrap itself, in the host's namespaces
        self.child = child  # its `sleep`, in the sandbox's network namespace
        self.bwrap, self.nsenter = bwrap, nsenter

    def netns_pid(self) -> int | None:
        return self.child if self.holder.poll() is None else None

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
        if self.holder.poll() is None:
            self.holder.send_signal(signal.SIGKILL)
            await asyncio.to_thread(self.holder.wait)


class BubblewrapBackend(SandboxBackend):
    name = "bubblewrap"
    isolated_network = True

    async def open(self) -> None:
        self.bwrap, self.nsenter = shutil.which("bwrap"), shutil.which("nsenter")
        if self.bwrap is None:
            raise SandboxError("bubblewrap is not installed (apt-get install -y bubblewrap)")
        if self.nsenter is None or os.geteuid() != 0:
            raise SandboxError("the bubblewrap backend needs root and nsenter (util-linux) to give its sandboxes "
                               "their proxy-only network")

    async def create(self, spec: SandboxSpec) -> BubblewrapSandbox:
        if not spec.workdir:
            raise SandboxError("the bubblewrap backend needs a host workdir")
        Path(spec.workdir).mkdir(parents=True, exist_ok=True)
        folder = str(Path(spec.workdir).resolve().parent)  # executions/ID: workspace and harness state
        env = {**os.environ, **markers(spec.labels)}
        holder = subprocess.Popen([self.bwrap, *_system_args(), "--unshare-net", "--unshare-pid", "--die-with-parent",
                                   "--", "sleep", "infinity"], env=env, stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        # The namespace exists once bwrap has made its child (bwrap itself stays in the host's).
        child = await asyncio.to_thread(_wait_child, holder)
        if child is None:
            err = holder.stderr.read().decode(errors="replace") if holder.poll() is not None else ""
            holder.kill()
            raise SandboxError(f"bubblewrap could not start: {err.strip() or 'no child process'}")
        holder.stderr.close()
        return BubblewrapSandbox(spec, folder, holder, child, self.bwrap, self.nsenter)

    async def reap(self, alive) -> int:
        return await asyncio.to_thread(reap_processes, alive)


def _wait_child(holder: subprocess.Popen, timeout_s: float = 10.0) -> int | None:
    """The pid of the holder's `sleep` (inside the new namespaces), polling /proc."""
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
