"""execs.py: commands run in a container so that they outlive whoever started them.

Each exec runs `detached_script`'s wrapper: the command in the background inside the
container under `timeout -k GRACE T` (the deadline is enforced inside: killing the host-side
client would leave the process running), its output to PID_DIR/TOKEN.out, its pid to
PID_DIR/TOKEN (what a cancel signals: the command's process group inside), its exit code to
PID_DIR/TOKEN.exit. The exec's stream carries nothing but its end, so the command runs on
when the coordinator (and the podman service with it) dies, and a new coordinator finds its
end by the exec's id, or by the exit file once the engine has let the exec go (`wait`). Files
are read by the archive endpoint, which starts no process. `DetachedExecs` is one container's
(docker_api.ContainerSandbox's `execs`); not the container's lifecycle (docker_api.py).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any, BinaryIO

from gyre.coordinator.sandbox.base import ExecResult, SandboxError, keep_output
from gyre.coordinator.sandbox.engineio import api_error, follow, own_thread, released
from gyre.coordinator.sandbox.files import first_file

log = logging.getLogger("gyre.coordinator")

PID_DIR = "/tmp/.gyre-exec"  # inside: one file per running exec, holding its wrapper's pid
KILL_WAIT_S = 10.0  # a cancelled exec's group gets this long after SIGTERM before SIGKILL
HOST_SLACK_S = 60.0  # the host-side wait past an exec's deadline + grace before it gives up on the engine
DETACHED_POLL_S = 1.0  # how often an exec found again after a restart is asked whether it still runs
OUTPUT_READ_BYTES = 64 << 20  # of a command's output file, copied out (harness.log caps what it keeps)


def detached_script(token: str) -> str:
    """The wrapper every exec runs: the command (`$@`) in the background with its output to
    PID_DIR/TOKEN.out, its pid to PID_DIR/TOKEN (what `kill` signals), its exit code to
    PID_DIR/TOKEN.exit (whole: written beside, then renamed) and as the wrapper's own. Nothing
    of it goes through the exec's stream, so it outlives the stream (a coordinator that died)."""
    at = f"{PID_DIR}/{token}"
    return (f'mkdir -p {PID_DIR} || exit 125; "$@" > {at}.out 2>&1 & p=$!; echo $p > {at}; '
            f'wait $p; c=$?; echo $c > {at}.exit.new; mv -f {at}.exit.new {at}.exit; exit $c')


class DetachedExecs:
    """One container's execs: run, found again, killed, their output read."""

    def __init__(self, backend: Any, container: Any):
        self.backend = backend  # docker_api.DockerAPIBackend: its client and its worker threads
        self.container = container
        self.tokens: set[str] = set()  # execs whose wrapper may still run
        self.detached = False  # handed off: an exec awaited and cancelled runs on, unkilled

    async def run(self, argv, *, env=None, cwd: str, timeout_s=None, grace_s=5.0, log=None, user=None,
                  on_start: Callable[[dict], None] | None = None) -> ExecResult:
        """`argv` under `timeout -k GRACE T` inside the wrapper, to its end; `on_start` gets
        {exec, token} once the engine made the exec (what finds it again after a restart)."""
        token = secrets.token_hex(6)
        # `timeout` leads its own process group and forwards a signal it gets to all of it; 0: no deadline.
        limit = "0" if timeout_s is None else f"{max(timeout_s, 0.001):.3f}"
        wrapped = ["sh", "-c", detached_script(token), "sh", "timeout", "-k", f"{grace_s:g}", limit, *argv]
        self.tokens.add(token)
        start = time.monotonic()
        host_wait = None if timeout_s is None else timeout_s + grace_s + HOST_SLACK_S
        tail = bytearray()
        started = None
        if on_start is not None:
            loop, told = asyncio.get_running_loop(), on_start
            started = lambda exec_id: loop.call_soon_threadsafe(told, {"exec": exec_id, "token": token})  # noqa: E731
        job = own_thread(self._run, wrapped, dict(env or {}), cwd, user, log, tail, started)
        try:
            code = await asyncio.wait_for(asyncio.shield(job), host_wait)
        except TimeoutError:
            await self.kill(token)
            code = None
        except asyncio.CancelledError:
            if not self.detached:
                await asyncio.shield(self.kill(token))
            raise
        finally:
            self.tokens.discard(token)
        if code is None:
            keep_output(b"gyre: the engine did not end the exec after its deadline\n", log, tail)
        else:
            await self._output(token, log, tail)
        elapsed = time.monotonic() - start
        timed_out = timeout_s is not None and code in (124, 137) and elapsed >= timeout_s * 0.99
        return ExecResult(code, timed_out or code is None, bytes(tail))

    def _run(self, argv, env, cwd, user, log: BinaryIO | None, tail: bytearray, started) -> int | None:
        """Start the exec and follow its stream to its end (the wrapper's own words only: its
        command's go to a file): its exit code."""
        api = self.backend.client.api
        try:
            ex = api.exec_create(self.container.id, argv, environment=env, workdir=cwd, user=user or "")
            if started is not None:
                started(ex["Id"])
            stream = api.exec_start(ex["Id"], stream=True)
            try:
                follow(stream, log, tail)
            finally:
                # The upgraded connection never returns to the pool: shut its socket and close
                # the response's file on it too, or the socket outlives both (ResourceWarning).
                stream.close()
                stream._response.close()
            code = api.exec_inspect(ex["Id"]).get("ExitCode")
        except api_error() as e:
            released(e)
            raise SandboxError(f"exec in {self.container.short_id}: {e}") from None
        return code

    async def wait(self, exec_id: str, token: str, *, log: BinaryIO | None = None,
                            poll_s: float = DETACHED_POLL_S) -> int | None:
        """The end of an exec this process did not start (found again after a restart): its
        exit code from TOKEN.exit inside once it is there, else from the engine; None when
        neither says (the container was stopped, or the wrapper killed). Its output then goes
        to `log`."""
        import docker.errors

        def state() -> tuple[bool, int | None]:
            try:
                info = self.backend.client.api.exec_inspect(exec_id)
            except docker.errors.APIError as e:  # podman answers an exec it let go 404 or 500 "no such exec"
                if e.status_code == 404 or "no such exec" in str(e).lower():
                    return False, None
                raise
            return bool(info.get("Running")), info.get("ExitCode")

        self.tokens.add(token)
        told = None
        try:
            while True:
                try:
                    running, code = await self.backend.io(state)
                except api_error() as e:
                    released(e)
                    raise SandboxError(f"exec {exec_id[:12]} in {self.container.short_id}: {e}") from None
                # The wrapper's exit file says first: podman may call an exec it let go (its
                # service restarted with the coordinator) running for half a minute after it ended.
                told = await self.read(f"{PID_DIR}/{token}.exit", 64) if running else None
                if not running or (told is not None and told.strip().isdigit()):
                    break
                await asyncio.sleep(poll_s)
        except asyncio.CancelledError:
            if not self.detached:
                await asyncio.shield(self.kill(token))
            raise
        finally:
            self.tokens.discard(token)
        if code is None or told is not None:
            told = told if told is not None else await self.read(f"{PID_DIR}/{token}.exit", 64)
            code = int(told) if told is not None and told.strip().isdigit() else None
        await self._output(token, log, bytearray())
        return code

    async def _output(self, token: str, log: BinaryIO | None, tail: bytearray) -> None:
        """The command's output file, into `log` (or `tail`), at most OUTPUT_READ_BYTES of it."""
        data = await self.read(f"{PID_DIR}/{token}.out", OUTPUT_READ_BYTES)
        if data:
            keep_output(data, log, tail)

    async def read(self, path: str, limit: int) -> bytes | None:
        """A file's first `limit` bytes from inside, by the archive endpoint (no exec); None
        when it is not there or cannot be read."""
        def pull() -> bytes | None:
            api = self.backend.client.api
            res = api._get(api._url("/containers/{0}/archive", self.container.id), params={"path": path},
                           stream=True)
            try:
                return first_file(res.iter_content(1 << 16, False), limit) if res.status_code == 200 else None
            finally:
                res.close()

        try:
            return await self.backend.io(pull)
        except api_error() as e:
            released(e)
            log.warning("sandbox %s: could not read %s: %s", self.container.short_id, path, e)
            return None

    async def kill(self, token: str) -> None:
        """SIGTERM the exec's group inside (timeout forwards it, then SIGKILLs after the grace)."""
        if token not in self.tokens:  # the container's `cancel` killed it with the container (its pid file is stale)
            return
        # `timeout` passes the TERM to its group and SIGKILLs it after the grace; should the
        # group outlive that (timeout itself killed), the whole group is SIGKILLed here.
        script = (f'p=$(cat {PID_DIR}/{token} 2>/dev/null); [ -n "$p" ] || exit 0; kill -TERM "$p" 2>/dev/null; '
                  f'i=0; while kill -0 -"$p" 2>/dev/null && [ $i -lt {int(KILL_WAIT_S * 10)} ]; do sleep 0.1; '
                  f'i=$((i+1)); done; kill -KILL -"$p" 2>/dev/null; rm -f {PID_DIR}/{token}; true')
        try:
            await self.backend.io(self.container.exec_run, ["sh", "-c", script])
        except api_error() as e:
            released(e)
            log.warning("sandbox %s: could not kill exec %s inside: %s", self.container.short_id, token, e)
