"""bubblewrap.py: the `bubblewrap` backend: a light local sandbox for harnesses that need no image.

What it isolates (ISOLATION below): the command runs as an unprivileged uid of its own with
no capability and no way to gain one (setpriv: every set and the bounding set empty,
no-new-privileges), after bwrap, as root, made its mounts: a read-only system (/usr, /etc,
/opt and the merged-/usr links), read-only the harness's own Python and gyre's coordinator
package (the demo harness imports it; never the checkout's tests/, examples/ or .git), the
execution's folder the one writable place (its sub-folders are handed to the uid; the files
gyre writes beside them stay root's), a private /tmp (also $HOME), and an environment that is
only what the launcher passes (proxy URL, key, GYRE_*, the preset's) plus PATH, TERM, LANG.
Every command gets private PID, IPC and UTS namespaces. The network namespace is the sandbox's
own: a holder process (`bwrap --unshare-net ... sleep infinity`) keeps it alive, each `exec`
enters it (nsenter) and the proxy's listener is bound in it (workerd/netns.py), so the harness
reaches the proxy and nothing else. An exec's PID namespace ends with its command (bwrap's
init goes, and the kernel kills what it left); `cancel` also sweeps for the sandbox's
markers, as the process backend does. `stop` returns once every process of the sandbox is
gone. Paths inside are the host's paths. Needs bwrap, setpriv and, for entering the namespace,
root. Limits are not enforced (no cgroup of its own). `confined_argv` is the same jail for
a host-side evaluator (evaluator.py), with no network at all.
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import zlib
from pathlib import Path

from gyre.coordinator.sandbox.base import (
    LABEL_EXECUTION,
    LABEL_OWNER,
    LABEL_RUN_DIR,
    SandboxBackend,
    SandboxError,
    SandboxSpec,
)
from gyre.coordinator.sandbox.process import ProcessSandbox, killpg, markers, reap_processes, run_group

log = logging.getLogger("gyre.coordinator")
SYSTEM_RO = ("/usr", "/etc", "/opt")
STOP_WAIT_S = 10.0  # a killed sandbox's processes are waited for this long (SIGKILL: microseconds)
MERGED_LINKS = ("/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")
# Each sandbox's uid (and gid): far above any the host gives its users, one per execution, so
# two executions share no uid's limits, keyrings or files even where a path leaked.
UID_BASE, UID_SPAN = 2_000_000_000, 1_000_000
KEPT_ENV = ("PATH", "TERM", "LANG", "LC_ALL")  # all a sandbox gets of the coordinator's environment
HOME = "/tmp"  # the sandbox's private tmpfs: a harness's dotfiles never reach the host
ISOLATION = ("isolates each harness: an unprivileged uid of its own with no capabilities, a read-only system, "
             "only its own folder writable, no sibling and nothing of the gyre checkout but its coordinator "
             "package (read-only) visible, an allow-listed environment, private PID/IPC/UTS namespaces and a "
             "network that reaches only the proxy; no resource limits")


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


def within(path: str, roots) -> bool:
    """Whether `path` is one of `roots` or under one (paths as strings, no resolving)."""
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def harness_roots() -> list[str]:
    """This Python and gyre's coordinator package, visible read-only (the demo harness is
    `python -m gyre.coordinator.demo_harness`): the package folder alone, never the checkout
    around it (its tests/, examples/, .git, a run directory)."""
    package = str(Path(__file__).resolve().parents[1])  # .../coordinator
    roots = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, package)}
    return sorted(r for r in roots if not within(r, SYSTEM_RO))


def sandbox_uid(labels) -> int:
    """The uid (and gid) an execution's commands run as: stable for its owner and execution."""
    key = f"{labels.get(LABEL_OWNER, '')}/{labels.get(LABEL_EXECUTION, '')}".encode()
    return UID_BASE + zlib.crc32(key) % UID_SPAN


def allowed_env(env: dict[str, str] | None) -> dict[str, str]:
    """The whole environment a sandboxed command gets: PATH, TERM and the locale of the
    coordinator's, a private HOME, then what the caller passes explicitly (proxy URL, key,
    GYRE_*, the preset's). Never the rest of the coordinator's: its tokens and secrets."""
    out = {k: os.environ[k] for k in KEPT_ENV if k in os.environ}
    out.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    return {**out, "HOME": HOME, **(env or {})}


def jail(setpriv: str, uid: int) -> list[str]:
    """The prefix that runs a command, inside bwrap's mounts (made as root), as `uid` with no
    capability in any set, an empty bounding set and no-new-privileges (a setuid binary gains
    nothing). Root without capabilities could still read root's own 0600/0640 files and
    connect to root's sockets: the uid change is what stops that."""
    return [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all", "--bounding-set=-all",
            "--no-new-privs", "--"]


def confined_argv(argv: list[str], *, bwrap: str, setpriv: str, uid: int, cwd: str,
                  readable: dict[str, str] | None = None, writable: dict[str, str] | None = None, hidden=(),
                  net: bool = False) -> list[str]:
    """bwrap's command line for `argv` jailed: the system and `readable` (host -> inside)
    read-only, `hidden` folders covered by an empty tmpfs, `writable` (host -> inside) bound
    read-write (last, so they show through), private /tmp, /proc and /dev, and `net=False`
    no network at all (True: the caller enters a namespace of its own first)."""
    binds: list[str] = []
    for host, inside in (readable or {}).items():
        binds += [*_parents(inside), "--ro-bind", host, inside]
    for path in hidden:
        binds += [*_parents(path), "--tmpfs", path]
    for host, inside in (readable or {}).items():  # a readable folder under a covered one shows again
        if within(inside, hidden):
            binds += [*_parents(inside), "--ro-bind", host, inside]
    for host, inside in (writable or {}).items():
        binds += [*_parents(inside), "--bind", host, inside]
    # /tmp first: the execution folder may live under it (mounts apply in order).
    return [bwrap, "--perms", "1777", "--tmpfs", "/tmp", *_system_args(), *binds, "--proc", "/proc", "--dev", "/dev",
            *([] if net else ["--unshare-net"]), "--unshare-pid", "--unshare-ipc", "--unshare-uts",
            "--die-with-parent", "--new-session", "--chdir", cwd, "--", *jail(setpriv, uid), *argv]


def _parents(path: str) -> list[str]:
    """The folders above a mount point, made 0755 where bwrap has to make them: its own are
    0700 root's, which the sandbox's uid could not pass (one that exists is left as it is)."""
    out: list[str] = []
    for parent in reversed(Path(path).parents[:-1]):  # "/" excluded, outermost first
        out += ["--perms", "0755", "--dir", str(parent)]
    return out


def hand_over(root: str, uid: int) -> None:
    """Give `root` and what it holds to `uid`, walking by directory fds and never following a
    link (what the sandbox made in an earlier exec cannot redirect the chown). A file with
    other hard links is skipped: it may be a name for a file outside."""
    os.chown(root, uid, uid, follow_symlinks=False)
    for _here, dirs, files, fd in os.fwalk(root):
        for name in dirs + files:
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if st.st_uid != uid and (stat.S_ISDIR(st.st_mode) or st.st_nlink == 1):
                    os.chown(name, uid, uid, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue


def unavailable() -> str | None:
    """Why this host cannot run bubblewrap sandboxes, ending with the fix; None when it can
    (open and the preflight both ask)."""
    if shutil.which("bwrap") is None:
        return "the `bwrap` command is not on PATH; install it (apt-get install -y bubblewrap)"
    for tool in ("nsenter", "setpriv"):  # nsenter: each exec enters the sandbox's network; setpriv drops root
        if shutil.which(tool) is None:
            return f"the `{tool}` command is not on PATH; install it (apt-get install -y util-linux)"
    if os.geteuid() != 0:
        return "entering its sandboxes' proxy-only network needs root; run gyre as root"
    return None


class BubblewrapSandbox(ProcessSandbox):
    def __init__(self, spec: SandboxSpec, folder: str, holder: subprocess.Popen, child: int, tools: dict[str, str],
                 pidfd: int | None = None):
        super().__init__(spec)
        self.folder = folder  # the writable execution folder (the workspace is inside it)
        self.holder = holder  # bwrap itself, in the host's namespaces
        # bwrap's child: the init of the sandbox's PID namespace, in its network namespace
        # (`sleep` runs under it); `pidfd` refers to it, reuse-proof, for the wait in `stop`.
        self.child = child
        self.pidfd = pidfd
        self.tools = tools  # the host's bwrap, nsenter and setpriv
        self.uid = sandbox_uid(spec.labels)

    def netns_pid(self) -> int | None:
        return self.child if self.holder.poll() is None else None

    def _spared_groups(self) -> frozenset[int]:
        return frozenset({self.holder.pid})  # the holder carries the markers too; `stop` ends it

    def _argv(self, argv: list[str], cwd: str) -> list[str]:
        readable = {root: root for root in harness_roots()}
        readable.update(self.spec.mounts)
        # A run directory under a bound folder (/opt, the harness's Python) would show the
        # siblings' folders and the run's files: an empty tmpfs covers it, the folder goes over that.
        run_dir = self.spec.labels.get(LABEL_RUN_DIR) or str(Path(self.folder).parent)
        hidden = [run_dir] if within(run_dir, [*SYSTEM_RO, *readable.values()]) else []
        inner = confined_argv(argv, bwrap=self.tools["bwrap"], setpriv=self.tools["setpriv"], uid=self.uid, cwd=cwd,
                              readable=readable, hidden=hidden, writable={self.folder: self.folder}, net=True)
        return [self.tools["nsenter"], f"--net=/proc/{self.child}/ns/net", "--", *inner]

    def _hand_over(self) -> None:
        """The execution folder's sub-folders (workspace, harness state) are the sandbox uid's;
        the folder itself and gyre's files in it (harness.log, sandbox.json) stay root's."""
        mode = os.stat(self.folder).st_mode
        os.chmod(self.folder, stat.S_IMODE(mode) | 0o111)  # its uid passes through (a umask of 077 would bar it)
        with os.scandir(self.folder) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    hand_over(entry.path, self.uid)
                    os.chmod(entry.path, 0o700)  # another execution's uid could not read it even if it saw it

    async def exec(self, argv, *, env=None, cwd=None, timeout_s=None, grace_s=5.0, log=None, user=None):
        if self.netns_pid() is None:
            raise SandboxError("the sandbox's network holder has exited")
        await asyncio.to_thread(self._hand_over)
        # bwrap passes its own environment on: the host-side processes get only the allowed one too.
        full = allowed_env({**(env or {}), **markers(self.spec.labels)})
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
    isolation = ISOLATION

    async def open(self) -> None:
        why = unavailable()
        if why is not None:
            raise SandboxError(f"sandbox bubblewrap: {why}")
        self.tools = {tool: shutil.which(tool) for tool in ("bwrap", "nsenter", "setpriv")}

    async def create(self, spec: SandboxSpec) -> BubblewrapSandbox:
        if not spec.workdir:
            raise SandboxError("the bubblewrap backend needs a host workdir")
        Path(spec.workdir).mkdir(parents=True, exist_ok=True)
        folder = str(Path(spec.workdir).resolve().parent)  # executions/ID: workspace and harness state
        # The holder is jailed too: nothing in the sandbox's namespaces keeps root's capabilities.
        env = allowed_env(markers(spec.labels))
        holder = subprocess.Popen([self.tools["bwrap"], *_system_args(), "--unshare-net", "--unshare-pid",
                                   "--die-with-parent", "--", *jail(self.tools["setpriv"], sandbox_uid(spec.labels)),
                                   "sleep", "infinity"], env=env, stdin=subprocess.DEVNULL,
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
        return BubblewrapSandbox(spec, folder, holder, child, self.tools, pidfd)

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
