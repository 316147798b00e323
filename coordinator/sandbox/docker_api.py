"""docker_api.py: the `podman` and `docker` backends, through the Docker-compatible HTTP API.

One implementation for both engines, with the `docker` Python SDK (it drives dockerd and
`podman system service` alike); podman.py starts that service against gyre's own
containers.conf. A sandbox is a container started `--init --network none ... sleep
infinity` from the task's image, with the image's working directory and files as the agent's
workspace; `exec` runs a command in it that outlives this process (execs.py: its deadline
enforced inside, its output and exit code to files there, found again by `wait_detached`
after a restart, a cancelled one's process group killed inside). `cancel` SIGKILLs the
container's init, which takes every process of its PID namespace with it (a daemon the agent
left, whatever group it is in); the files stay for copying out, and the container never runs
again (a restart would run `sleep` from the agent's files). `run_fresh` is the verifier's: a
new container from the same image whose own command is the verifier's (under `timeout` from
the image), its files put in before it starts, its output followed through the logs
endpoint. `run_in_copy` (a task verified in the agent's environment) commits the killed
container to a temporary image and runs the command once in a new container from it, its
command the host's static busybox mounted read-only (never the agent's files), an empty
/etc/ld.so.preload mounted over the agent's; `changes` is `podman diff`. Execs are few on
purpose: podman keeps each exec's `conmon` alive about 5 minutes after it ends, so an
execution makes one (the harness's); files move as tar streams
(put_archive / get_archive, which start no process), a download extracted entry by entry,
never through a link and under a cap. Images are built from a task's environment folder
under a content-hashed tag, once per content (images.py). The SDK blocks: every call runs
in a worker thread.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import dataclasses
import functools
import json
import logging
import secrets
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

from gyre.coordinator.sandbox import images
from gyre.coordinator.sandbox.base import (
    COPY_LIMIT_BYTES,
    LABEL_EXECUTION,
    LABEL_OWNER,
    PRELOAD_LIST,
    TRUSTED_BUSYBOX,
    CopyReport,
    ExecResult,
    ImageBuildError,
    Sandbox,
    SandboxBackend,
    SandboxError,
    SandboxSpec,
)
from gyre.coordinator.sandbox.engineio import api_error, follow, own_thread, released, tar_into
from gyre.coordinator.sandbox.execs import DETACHED_POLL_S, HOST_SLACK_S, KILL_WAIT_S, DetachedExecs
from gyre.coordinator.sandbox.files import untar_capped

log = logging.getLogger("gyre.coordinator")
VERIFY_IMAGE_PREFIX = "localhost/gyre-verify-"  # the agent environment's temporary images (committed containers)
OPEN_PING_S = 10.0  # an engine that does not answer a ping this fast at open is refused
PUT_ATTEMPTS = 3  # an archive put the engine failed (a 5xx) is made again: it replaces what it wrote
SLEEP = ["sleep", "infinity"]  # an agent's container's own command: the harness runs by exec



class ContainerSandbox(Sandbox):
    def __init__(self, backend: DockerAPIBackend, container: Any, spec: SandboxSpec, workdir: str, pid: int | None):
        self.backend = backend
        self.container = container
        self.spec = spec
        self.workdir = workdir or "/"
        self._pid = pid
        self.execs = DetachedExecs(backend, container)  # its commands, which outlive this process
        self._removed = False
        self._cancelled = False  # once `cancel` has killed it, nothing runs in it again

    def detach(self) -> None:
        """A stop for a restart: from now on this process neither kills its execs (an exec
        awaited and cancelled runs on) nor stops or removes it; the next coordinator adopts it."""
        self.execs.detached = True

    @property
    def id(self) -> str:
        return self.container.id

    def netns_pid(self) -> int | None:
        return self._pid if self.backend.local else None

    def engine_pid(self) -> int | None:
        return self._pid

    async def exec(self, argv, *, env=None, cwd=None, timeout_s=None, grace_s=5.0, log=None, user=None):
        if self._cancelled or self._removed:
            raise SandboxError(f"sandbox {self.container.short_id} was stopped: nothing runs in it again")
        return await self.execs.run(argv, env=env, cwd=cwd or self.workdir, timeout_s=timeout_s, grace_s=grace_s,
                                    log=log, user=user, on_start=self.on_start)

    async def wait_detached(self, exec_id: str, token: str, *, log: BinaryIO | None = None,
                            poll_s: float = DETACHED_POLL_S) -> int | None:
        """The end of an exec this process did not start (found again after a restart): its
        exit code, or None when nothing says (execs.DetachedExecs.wait)."""
        return await self.execs.wait(exec_id, token, log=log, poll_s=poll_s)

    async def upload(self, src: Path, dest: str, owners: Mapping[str, tuple[int, int]] | None = None) -> None:
        """An archive put, no exec (each would leave a monitor): podman makes the missing
        folders above `dest`; docker refuses, and then only the missing ones are sent along
        (an entry for a folder that exists would reset its mode and owner)."""
        import docker.errors

        src = Path(src)
        parent, name = (dest, "") if src.is_dir() else (str(PurePosixPath(dest).parent), PurePosixPath(dest).name)

        def put(at: str, under: Sequence[str] = ()) -> bool:
            with tempfile.TemporaryFile(prefix="gyre-put-") as f:  # on disk: a workspace may be large
                tar_into(f, src, name, owners, under)
                f.seek(0)
                return self.container.put_archive(at, f)

        def upload() -> bool:
            for attempt in range(PUT_ATTEMPTS):
                try:
                    return put(parent)
                except docker.errors.NotFound:
                    at, missing = self._nearest(parent)
                    return put(at, missing)
                except docker.errors.APIError as e:  # podman's copier, seen losing its pipe under load
                    if not e.is_server_error() or attempt == PUT_ATTEMPTS - 1:
                        raise
                    log.info("sandbox %s: upload to %s failed (%s); again", self.container.short_id, dest, e)
            return False

        try:
            ok = await self.backend.io(upload)
        except api_error() as e:
            released(e)
            raise SandboxError(f"upload to {dest} in {self.container.short_id}: {e}") from None
        if not ok:
            raise SandboxError(f"upload to {dest} in {self.container.short_id} refused")

    def _nearest(self, path: str) -> tuple[str, list[str]]:
        """The nearest folder at or above `path` that exists inside, and the names below it
        down to `path` (asked of the archive endpoint: HEAD, no exec)."""
        api = self.backend.client.api
        here, missing = PurePosixPath(path), []
        while str(here) != "/":
            res = api.head(api._url("/containers/{0}/archive", self.container.id), params={"path": str(here)},
                           timeout=60)
            res.close()
            if res.status_code == 200:
                break
            missing.insert(0, here.name)
            here = here.parent
        return str(here), missing

    async def download(self, src: str, dest: Path, *, limit_bytes: int = COPY_LIMIT_BYTES) -> CopyReport:
        import docker.errors

        def pull() -> CopyReport:
            # The archive endpoint by hand (the SDK's get_archive hides its response): a copy
            # that stops at its cap closes the response here instead of leaving its socket open.
            api = self.backend.client.api
            try:
                res = api._get(api._url("/containers/{0}/archive", self.container.id), params={"path": src},
                               stream=True)
                api._raise_for_status(res)
            except docker.errors.NotFound:
                raise FileNotFoundError(src) from None
            try:
                stat = json.loads(base64.b64decode(res.headers.get("X-Docker-Container-Path-Stat") or "e30="))
                is_dir = (stat.get("mode", 0) & (1 << 31)) != 0  # Go's os.ModeDir
                return untar_capped(res.iter_content(1 << 16, False), Path(dest), is_dir, limit_bytes)
            finally:
                res.close()

        try:
            return await self.backend.io(pull)
        except FileNotFoundError:
            raise
        except api_error() as e:
            released(e)
            raise SandboxError(f"download of {src} from {self.container.short_id}: {e}") from None

    async def cancel(self) -> None:
        """SIGKILL the container's init: the kernel ends its whole PID namespace, so nothing
        an exec left behind survives (a group kill would miss a `setsid` daemon)."""
        import docker.errors

        if self.execs.detached:
            return

        def halt() -> None:
            try:
                self.container.kill(signal="SIGKILL")
            except docker.errors.APIError:
                self.container.reload()
                if self.container.status == "running":
                    raise
            self.container.wait(condition="not-running", timeout=KILL_WAIT_S)  # every process gone

        if self._removed:
            return
        try:
            await self.backend.io(halt)
        except api_error() as e:
            released(e)
            raise SandboxError(f"could not stop what runs in {self.container.short_id}: {e}") from None
        self._cancelled, self._pid = True, None
        self.execs.tokens.clear()

    async def run_fresh(self, argv, *, puts=(), env=None, timeout_s=None, grace_s=5.0, log=None, read=()):
        limit = "0" if timeout_s is None else f"{max(timeout_s, 0.001):.3f}"
        spec = dataclasses.replace(self.spec, mounts={})  # the harness's mounts stay with the harness
        fresh = await self.backend.container(spec, ["timeout", "-k", f"{grace_s:g}", limit, *argv], env=env,
                                             start=False, role="verify")
        try:
            for put in puts:
                await fresh.upload(put.src, put.dest, put.owners)
            result = await fresh._run_once(timeout_s, grace_s, log)
            got = {path: await fresh.read_file(path) for path in read}
        finally:
            await asyncio.shield(fresh.stop())
        return result, got

    async def run_in_copy(self, argv, *, busybox, mounts=None, env=None, timeout_s=None, grace_s=5.0, log=None,
                          read=()):
        """The agent's container committed to a temporary image (its files, never its
        processes: it was killed and is not started again) and `argv` run once in a new
        container from it, under the host's busybox; container and image removed after."""
        if not self._cancelled:
            raise SandboxError(f"sandbox {self.container.short_id} still runs: cancel it before copying it")
        if not self.backend.local:
            raise SandboxError(f"{self.backend.name}: verifying in the agent's container needs a local engine "
                               "(the trusted busybox is mounted from this host)")
        limit = "0" if timeout_s is None else f"{max(timeout_s, 0.001):.3f}"
        with tempfile.TemporaryDirectory(prefix="gyre-copy-") as tmp:
            empty = Path(tmp, "ld.so.preload")
            empty.write_bytes(b"")
            image = await self.backend.commit(self, f"{VERIFY_IMAGE_PREFIX[len('localhost/'):]}"
                                                    f"{self.spec.execution}-{secrets.token_hex(3)}")
            try:
                spec = dataclasses.replace(self.spec, image=image, mounts={
                    **dict(mounts or {}), str(busybox): TRUSTED_BUSYBOX, str(empty): PRELOAD_LIST})
                fresh = await self.backend.container(
                    spec, [TRUSTED_BUSYBOX, "timeout", "-k", f"{grace_s:g}", limit, *argv], env=env, start=False,
                    role="verify")
                try:
                    # busybox's timeout ends the command with its signal's status: 143 (TERM), 137 (KILL)
                    result = await fresh._run_once(timeout_s, grace_s, log, codes=(124, 137, 143))
                    got = {path: await fresh.read_file(path) for path in read}
                finally:
                    await asyncio.shield(fresh.stop())
            finally:
                await asyncio.shield(self.backend.remove_image(image))
        return result, got

    async def changes(self) -> list[dict]:
        kinds = {0: "changed", 1: "added", 2: "deleted"}
        try:
            got = await self.backend.io(self.container.diff)
        except api_error() as e:
            released(e)
            raise SandboxError(f"changes of {self.container.short_id}: {e}") from None
        return [{"path": c.get("Path"), "kind": kinds.get(c.get("Kind"), str(c.get("Kind")))} for c in got or []]

    async def _run_once(self, timeout_s: float | None, grace_s: float, log: BinaryIO | None,
                        codes: tuple[int, ...] = (124, 137)) -> ExecResult:
        """Start the container, its own command to its end, its output followed: the exec
        verb's contract, without an exec. `codes`: the exit statuses its timeout ends it with."""
        start = time.monotonic()
        host_wait = None if timeout_s is None else timeout_s + grace_s + HOST_SLACK_S
        job = own_thread(self._start_and_follow, log)
        try:
            code, output = await asyncio.wait_for(asyncio.shield(job), host_wait)
        except TimeoutError:
            await self.cancel()
            code, output = None, b"gyre: the engine did not end the command after its deadline\n"
        except asyncio.CancelledError:
            await asyncio.shield(self.cancel())
            raise
        elapsed = time.monotonic() - start
        timed_out = timeout_s is not None and code in codes and elapsed >= timeout_s * 0.99
        return ExecResult(code, timed_out or code is None, output)

    def _start_and_follow(self, log: BinaryIO | None) -> tuple[int | None, bytes]:
        api = self.backend.client.api
        try:
            api.start(self.container.id)
            tail = bytearray()
            stream = api.logs(self.container.id, stdout=True, stderr=True, stream=True, follow=True)
            try:
                follow(stream, log, tail)
            finally:
                stream.close()
            code = api.wait(self.container.id).get("StatusCode")
        except api_error() as e:
            released(e)
            raise SandboxError(f"run in {self.container.short_id}: {e}") from None
        return code, bytes(tail)

    async def storage_used(self) -> int | None:
        def size() -> int | None:
            api = self.backend.client.api  # inspect with ?size=1: the SDK's inspect does not ask for it
            res = api._get(api._url("/containers/{0}/json", self.container.id), params={"size": 1})
            return api._result(res, True).get("SizeRw")

        try:
            return await self.backend.io(size)
        except api_error() as e:
            released(e)
            raise SandboxError(f"size of {self.container.short_id}: {e}") from None

    async def stop(self) -> None:
        if self._removed or self.execs.detached:
            return
        self._removed = True
        try:
            await self.backend.io(self.container.remove, force=True)
        except api_error() as e:
            released(e)
            import docker.errors

            if not isinstance(e, docker.errors.NotFound):
                log.warning("sandbox %s: remove failed: %s", self.container.short_id, e)


class DockerAPIBackend(SandboxBackend):
    """A Docker-compatible engine at `base_url` (unix:///run/podman/podman.sock, tcp://host:2375)."""

    isolated_network = True
    needs_image = True
    enforces = frozenset({"cpus", "memory_mb", "pids"})

    def __init__(self, name: str, base_url: str, *, local: bool = True, cache_dir: Path | None = None):
        self.name = name
        self.base_url = base_url
        self.local = local  # the engine runs on this host: its container pids are ours to setns into
        self.cache_dir = cache_dir
        self.client: Any = None
        self._ping_client: Any = None
        # Engine calls on threads of this host's own: calls to a hung engine wait out the
        # client's timeout there, not in the loop's default executor every host shares.
        self._io_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._build_locks: dict[str, asyncio.Lock] = {}
        self._lock = threading.Lock()

    async def open(self) -> None:
        import docker

        def connect():
            client = docker.DockerClient(base_url=self.base_url, timeout=600)
            client.ping()
            return client

        await self.ping(OPEN_PING_S)  # an engine that hangs is refused in seconds, not the client's 600
        try:
            self.client = await self.io(connect)
        except api_error() as e:
            released(e)
            raise SandboxError(f"{self.name}: no engine answers at {self.base_url}: {e}") from None

    async def io(self, fn, *args, **kwargs):
        """`fn(*args, **kwargs)` on this host's engine-call threads."""
        if self._io_pool is None:
            self._io_pool = concurrent.futures.ThreadPoolExecutor(max_workers=32,
                                                                  thread_name_prefix=f"gyre-{self.name}")
        return await asyncio.get_running_loop().run_in_executor(self._io_pool, functools.partial(fn, *args, **kwargs))

    async def close(self) -> None:
        if self._io_pool is not None:
            self._io_pool.shutdown(wait=False)
            self._io_pool = None
        if self.client is not None:
            self.client.close()
            self.client = None
        if self._ping_client is not None:
            self._ping_client.close()
            self._ping_client = None

    async def ping(self, timeout_s: float = 5.0) -> None:
        """SandboxError unless the engine answers within `timeout_s` (its own short-timeout
        client: a hung engine must not hold a thread for the main client's 600 s)."""
        import docker

        def ping() -> None:
            if self._ping_client is None:
                self._ping_client = docker.APIClient(base_url=self.base_url, timeout=timeout_s)
            self._ping_client.ping()

        try:
            await self.io(ping)
        except api_error() as e:
            released(e)
            raise SandboxError(f"{self.name}: no engine answers at {self.base_url}: {e}") from None

    async def prepare(self, build_dir, *, image, dockerfile=None, timeout_s=600.0, name="task"):
        if build_dir is None:
            if image is None:
                raise ImageBuildError("the task names neither an image nor a Dockerfile")
            await images.ensure_present(self, image, timeout_s=timeout_s)
            return image
        tag = images.task_tag(name, Path(build_dir), dockerfile)
        lock = self._build_locks.setdefault(tag, asyncio.Lock())
        async with lock:  # concurrent executions of one task build it once
            await images.build(self, Path(build_dir), tag, dockerfile=dockerfile, timeout_s=timeout_s)
        return tag

    async def create(self, spec: SandboxSpec) -> Sandbox:
        return await self.container(spec, SLEEP)

    async def adopt(self, container_id: str, spec: SandboxSpec) -> ContainerSandbox | None:
        """A sandbox an earlier coordinator made, found again by its id while it still runs
        (its execs with it: `wait_detached`); None when it is gone or stopped."""
        import docker.errors

        def find():
            try:
                container = self.client.containers.get(container_id)
            except docker.errors.NotFound:
                return None
            return container if container.status == "running" else None

        try:
            container = await self.io(find)
        except api_error() as e:
            released(e)
            raise SandboxError(f"{self.name}: cannot look up sandbox {container_id[:12]}: {e}") from None
        if container is None:
            return None
        workdir = container.attrs.get("Config", {}).get("WorkingDir") or "/"
        return ContainerSandbox(self, container, spec, workdir, container.attrs.get("State", {}).get("Pid") or None)

    async def container(self, spec: SandboxSpec, command: list[str], *, env: Mapping[str, str] | None = None,
                        start: bool = True, role: str = "") -> ContainerSandbox:
        """A container from `spec` running `command` (started, or only created: files can be
        put in before it runs)."""
        if spec.image is None:
            raise SandboxError(f"{self.name}: a container sandbox needs an image")
        kwargs: dict[str, Any] = dict(
            init=True, labels=dict(spec.labels), network_mode=None if spec.internet else "none",
            volumes={host: {"bind": inside, "mode": "ro"} for host, inside in spec.mounts.items()},
            environment=dict(env or {}), name=f"gyre-{spec.execution}-{role}{secrets.token_hex(3)}")
        lim = spec.limits
        if lim.memory_mb is not None:
            kwargs["mem_limit"] = kwargs["memswap_limit"] = f"{lim.memory_mb}m"
        if lim.cpus is not None:
            kwargs["nano_cpus"] = int(lim.cpus * 1e9)
        if lim.pids is not None:
            kwargs["pids_limit"] = lim.pids
        if spec.workdir:
            kwargs["working_dir"] = spec.workdir

        def make():
            container = self.client.containers.create(spec.image, command, **kwargs)
            if start:
                container.start()
            container.reload()
            return container

        try:
            container = await self.io(make)
        except api_error() as e:
            released(e)
            raise SandboxError(f"{self.name}: cannot start a container from {spec.image}: {e}") from None
        state = container.attrs.get("State", {})
        workdir = container.attrs.get("Config", {}).get("WorkingDir") or "/"
        return ContainerSandbox(self, container, spec, workdir, state.get("Pid") or None)

    async def commit(self, sandbox: ContainerSandbox, name: str) -> str:
        """The (stopped) container's files as a new local image, its id; `remove_image` after."""
        def commit() -> str:
            return sandbox.container.commit(repository=f"localhost/{name}", tag="latest", pause=False).id

        try:
            return await self.io(commit)
        except api_error() as e:
            released(e)
            raise SandboxError(f"{self.name}: cannot commit {sandbox.container.short_id} to an image: {e}") from None

    async def remove_image(self, image: str) -> None:
        """Remove an image gyre made (logged, never raised: a leftover is disk, not a fault)."""
        try:
            await self.io(self.client.images.remove, image, force=True)
        except api_error() as e:
            released(e)
            log.warning("%s: could not remove image %s: %s", self.name, image[:19], e)

    async def reap(self, alive) -> int:
        def sweep() -> int:
            import docker.errors

            removed = 0
            # The list call alone (labels are in it): the SDK's containers.list inspects each
            # one after, and fails when another process removes one in between.
            for c in self.client.api.containers(all=True, filters={"label": LABEL_OWNER}):
                labels, short = c.get("Labels") or {}, c["Id"][:12]
                if alive(labels):
                    continue
                log.info("%s: removing orphan sandbox %s (execution %s)", self.name, short,
                         labels.get(LABEL_EXECUTION))
                try:
                    self.client.api.remove_container(c["Id"], force=True)
                    removed += 1
                except docker.errors.NotFound:
                    pass  # gone already
                except api_error() as e:
                    released(e)
                    log.warning("%s: could not remove orphan %s: %s", self.name, short, e)
            return removed + self._sweep_verify_images(alive)

        try:
            return await self.io(sweep)
        except api_error() as e:
            released(e)
            raise SandboxError(f"{self.name}: listing sandboxes failed: {e}") from None

    def _sweep_verify_images(self, alive) -> int:
        """The temporary images the agent environment commits (gyre-verify-*, carrying the agent
        container's labels) that a crash left: those of runs no longer alive are removed."""
        import docker.errors

        removed = 0
        for img in self.client.api.images(filters={"label": LABEL_OWNER}):
            tags = img.get("RepoTags") or []
            if not any(t.startswith(VERIFY_IMAGE_PREFIX) for t in tags) or alive(img.get("Labels") or {}):
                continue
            log.info("%s: removing orphan verifier image %s", self.name, tags[0])
            try:
                self.client.api.remove_image(img["Id"], force=True)
                removed += 1
            except docker.errors.NotFound:
                pass
            except api_error() as e:
                released(e)
                log.warning("%s: could not remove orphan image %s: %s", self.name, tags[0], e)
        return removed

    def image_exists(self, image: str) -> bool:
        import docker.errors

        try:
            self.client.images.get(image)
            return True
        except docker.errors.ImageNotFound:
            return False
