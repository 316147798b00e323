"""preflight.py: can this run's sandbox backend work here? Asked before the run directory exists.

`default_sandbox` is the rule every command applies when no sandbox is named (no --sandbox,
no `sandbox` in the run config): process unless a task runs in a container image, then
podman where its command is on PATH, else docker where an engine answers. `check_sandbox`
looks and starts nothing: the backend's command on PATH (podman, bwrap),
root where bubblewrap needs it, one short ping of each engine URL given (or docker's socket),
and whether a task is one the run would refuse anyway (`task_refusal`, the launcher's own
check). It raises SandboxError with one line saying what is missing and how to fix it. It
starts no podman service, makes no directory and builds no image: the backends' `open` and
`prepare` still check everything else once the run starts (the engine's service, images).
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Iterable
from urllib.parse import urlsplit

from gyre.coordinator.sandbox import BACKENDS, DOCKER_URL, backend_class
from gyre.coordinator.sandbox.base import SandboxError

PING_TIMEOUT_S = 3.0  # an engine that does not answer this fast is reported, not waited for
ELSEWHERE = "or choose another sandbox (e.g. process)"


def needs_container(task) -> bool:
    """Whether `task` runs only in a container: it names an image or a Dockerfile, or its
    tests run inside its sandbox (task_refusal's reasons for a backend without images)."""
    env = task.environment
    return bool(env is not None and (env.image or env.build_dir)) or bool(task.verifier)


def default_sandbox(tasks: Iterable, *, source: str, url: str | None = None,
                    url_flag: str = "--sandbox-url URL") -> str:
    """The sandbox for `tasks` when none is named: process unless one needs a container
    (needs_container); then podman where its command is on PATH, else docker where an engine
    answers at `url` (else docker's socket). Neither: SandboxError, one line naming `source`
    (the task source as the user gave it) and the flags. Looks only (one short ping at most)."""
    tasks = list(tasks)
    contained = sum(needs_container(t) for t in tasks)
    if not contained:
        return "process"
    from gyre.coordinator.sandbox.podman import unavailable

    if unavailable() is None:
        return "podman"
    if ping_engine(url or DOCKER_URL) is None:
        return "docker"
    raise SandboxError(f"{source} needs a container image ({contained} of {len(tasks)} task(s) run in one) and "
                       f"neither podman nor a docker engine is here: install podman (apt-get install -y podman runc), "
                       f"start docker, or pass --sandbox docker with {url_flag}")


def task_refusal(task, *, backend: str, needs_image: bool, internet: bool) -> str | None:
    """Why a run on `backend` refuses `task` (None: it runs it). `internet`: may sandboxes
    have the internet (sandbox_internet). Shared by TaskImages.check and the preflight."""
    env = task.environment
    if env is not None and env.allow_internet and not internet:
        return (f"task {task.id!r} asks allow_internet = true; set sandbox_internet = true in the run config to "
                "give sandboxes the internet")
    if env is not None and (env.image or env.build_dir) and not needs_image:
        return (f"task {task.id!r} runs in its own image; sandbox {backend!r} runs no images (use sandbox = "
                "\"podman\" or \"docker\")")
    if task.verifier and not needs_image:
        return f"task {task.id!r} is verified inside its sandbox; sandbox {backend!r} has none"
    if task.verifier.get("environment") == "agent":  # its trusted shell: refused at start, not at every score
        from gyre.coordinator.evaluator import EvaluatorError
        from gyre.coordinator.verifier import trusted_busybox

        try:
            trusted_busybox()
        except EvaluatorError as e:
            return f"task {task.id!r}: {e}"
    return None


def check_sandbox(backend: str, *, url: str | None = None, hosts: Iterable = (), tasks: Iterable = (),
                  internet: bool = False, timeout_s: float = PING_TIMEOUT_S) -> None:
    """SandboxError (one line: what is missing, how to fix it) unless a run of `tasks` on
    `backend` can start here. `url`, `hosts`: the run config's sandbox_url and sandbox_hosts;
    `internet`: its sandbox_internet. Blocks for at most about `timeout_s` (the pings)."""
    if backend not in BACKENDS:
        raise SandboxError(f"sandbox must be one of {', '.join(BACKENDS)}, got {backend!r}")
    # 1) The tasks first: when they cannot run on this backend, installing it would not help.
    needs_image = backend_class(backend).needs_image
    refused = [why for t in tasks if (why := task_refusal(t, backend=backend, needs_image=needs_image,
                                                           internet=internet)) is not None]
    if refused:
        more = f" (and {len(refused) - 1} more task(s))" if len(refused) > 1 else ""
        raise SandboxError(f"{refused[0]}{more}")  # each names the sandbox
    # 2) The backend's own needs.
    if backend == "bubblewrap":
        from gyre.coordinator.sandbox.bubblewrap import unavailable

        why = unavailable()
        if why is not None:
            raise SandboxError(f"sandbox bubblewrap: {why} {ELSEWHERE}")
    elif backend in ("podman", "docker"):
        _check_engines(backend, url, list(hosts), timeout_s)


def _check_engines(backend: str, url: str | None, hosts: list, timeout_s: float) -> None:
    from gyre.coordinator.sandbox.hosts import host_specs

    specs = host_specs(hosts)
    if specs:  # a pool runs while one host answers (the others start down)
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(specs), 16)) as pool:
            errors = list(pool.map(lambda s: ping_engine(s["url"], timeout_s), specs))
        if all(errors):
            detail = "; ".join(f"{s['name']}: {e}" for s, e in zip(specs, errors, strict=True))
            raise SandboxError(f"sandbox {backend}: no sandbox host answers ({detail}); start their engines or "
                               "fix sandbox_hosts")
        return
    if backend == "podman" and url is None:  # gyre starts its own service: the command must be there
        from gyre.coordinator.sandbox.podman import unavailable

        why = unavailable()
        if why is not None:
            raise SandboxError(f"sandbox podman: {why} {ELSEWHERE}")
        return
    target = url or DOCKER_URL
    error = ping_engine(target, timeout_s)
    if error is None:
        return
    if url is None:  # docker's default socket
        fix = "start dockerd (apt-get install -y docker.io; systemctl start docker), set sandbox_url"
    elif backend == "podman":
        fix = "start `podman system service` there, fix sandbox_url, leave it unset for gyre's own service"
    else:
        fix = "start the engine there, fix sandbox_url"
    raise SandboxError(f"sandbox {backend}: {error}; {fix} {ELSEWHERE}")


def ping_engine(url: str, timeout_s: float = PING_TIMEOUT_S) -> str | None:
    """None when a Docker-compatible engine answers a ping at `url` within `timeout_s`, else
    why not (one short phrase). A unix socket that is not there is not connected to."""
    import docker

    from gyre.coordinator.sandbox.engineio import api_error, released

    parts = urlsplit(url)
    if parts.scheme in ("unix", "http+unix") and not os.path.exists(parts.path):
        return f"no engine socket at {parts.path}"
    client = None
    try:
        client = docker.APIClient(base_url=url, timeout=timeout_s)
        client.ping()
    except api_error() as e:
        released(e)
        return f"no engine answers at {url} within {timeout_s:g} s ({_reason(e)})"
    finally:
        if client is not None:
            client.close()
    return None


def _reason(e: BaseException) -> str:
    """The gist of a docker SDK / requests error (theirs run to several hundred characters)."""
    text = str(e)
    for needle, gist in (("Connection refused", "connection refused"), ("timed out", "timed out"),
                         ("Name or service not known", "unknown host"), ("Permission denied", "permission denied"),
                         ("No such file", "no such socket")):
        if needle in text:
            return gist
    return text.splitlines()[0][-160:] if text else type(e).__name__
