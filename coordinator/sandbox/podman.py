"""podman.py: a `podman system service` of gyre's own, pointed at gyre's own containers.conf.

Nothing under /etc changes: the service runs with CONTAINERS_CONF naming a file gyre writes
(SANDBOX-NOTES.md: rootful podman here needs explicit default ulimits, since root lacks
CAP_SYS_RESOURCE, and runc, since crun refuses the hybrid cgroup layout; runc is named only
where it is installed). Two more settings keep a host's leftovers small: a container's log
file is capped, and an exec's `conmon` is let go 30 s after the exec, not podman's 300 s.
The service listens on a unix socket in a private folder and lives as long as the backend;
the containers it starts do not depend on it (conmon keeps them).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from gyre.coordinator.sandbox.base import SandboxError
from gyre.coordinator.sandbox.docker_api import DockerAPIBackend
from gyre.coordinator.sandbox.images import cache_dir

log = logging.getLogger("gyre.coordinator")
START_TIMEOUT_S = 30.0
LOG_SIZE_MAX = 64 << 20  # bytes of a container's own output kept on disk
EXEC_EXIT_DELAY_S = 30  # seconds an exec's monitor (conmon) stays after the exec ended (podman's default: 300)


def containers_conf() -> str:
    # log_size_max: a verifier's output goes through its container's log file (docker_api.py's
    # run_fresh), which must not fill the disk for a test that prints forever.
    lines = ["[containers]", 'default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]',
             f"log_size_max = {LOG_SIZE_MAX}"]
    # exit_command_delay: how long each exec's conmon outlives the exec (podman's default, 300 s,
    # mimics Docker's keeping of exit codes for clients; gyre reads the code as the exec ends).
    lines += ["", "[engine]", f"exit_command_delay = {EXEC_EXIT_DELAY_S}"]
    if shutil.which("runc"):
        lines += ['runtime = "runc"']
    return "\n".join(lines) + "\n"


def conf_path() -> Path:
    """gyre's containers.conf ($GYRE_CONTAINERS_CONF to use another), written when missing."""
    given = os.environ.get("GYRE_CONTAINERS_CONF")
    if given:
        return Path(given)
    path = cache_dir() / "podman" / "containers.conf"
    text = containers_conf()
    if not path.exists() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return path


def podman_env() -> dict[str, str]:
    """The environment for podman commands that should see what gyre's service sees."""
    return {**os.environ, "CONTAINERS_CONF": str(conf_path())}


def unavailable() -> str | None:
    """Why gyre cannot start its own podman service here, ending with the fix; None when it can."""
    if shutil.which("podman") is None:
        return "the `podman` command is not on PATH; install it (apt-get install -y podman runc)"
    return None


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the coordinator dies, however it dies (Linux)."""
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class PodmanBackend(DockerAPIBackend):
    """podman through a service gyre starts (or an existing one's `url`)."""

    def __init__(self, url: str | None = None, *, cache: Path | None = None):
        super().__init__("podman", url or "", local=True, cache_dir=cache)
        self._given = url
        self._proc: subprocess.Popen | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None

    async def open(self) -> None:
        if self._given is None:
            await self._start_service()
        await super().open()

    async def _start_service(self) -> None:
        why = unavailable()
        if why is not None:
            raise SandboxError(f"sandbox podman: {why}")
        exe = shutil.which("podman")
        self._tmp = tempfile.TemporaryDirectory(prefix="gyre-podman-")  # short: unix socket paths are limited
        sock = Path(self._tmp.name) / "podman.sock"
        self.base_url = f"unix://{sock}"
        logf = open(Path(self._tmp.name) / "service.log", "wb")
        # Its own working directory: conmon leaves a file named `oom` in it when a container is
        # OOM-killed (seen here: in the user's working directory otherwise).
        self._proc = subprocess.Popen([exe, "system", "service", "--time=0", self.base_url], env=podman_env(),
                                      stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, start_new_session=True,
                                      preexec_fn=_die_with_parent, cwd=self._tmp.name)
        logf.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + START_TIMEOUT_S
        while not sock.exists():  # the service creates its socket once it listens
            if self._proc.poll() is not None or loop.time() > deadline:
                err = (Path(self._tmp.name) / "service.log").read_text(errors="replace")[-500:]
                await self.close()
                raise SandboxError(f"podman system service did not start: {err.strip() or 'no output'}")
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        await super().close()
        if self._proc is not None:
            self._proc.terminate()
            try:
                await asyncio.to_thread(self._proc.wait, 10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
            self._proc = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
