"""sandbox: where executions run: the interface (base.py) and one file per backend."""

from __future__ import annotations

import logging

from gyre.coordinator.sandbox.base import (
    ExecResult,
    ImageBuildError,
    Limits,
    Sandbox,
    SandboxBackend,
    SandboxError,
    SandboxSpec,
)

log = logging.getLogger("gyre.coordinator")
BACKENDS = ("process", "podman", "docker", "bubblewrap")
DOCKER_URL = "unix:///var/run/docker.sock"  # the docker backend's engine when no sandbox_url is given
# What a container backend (podman, docker) isolates; the others say it as their class's `isolation`.
CONTAINER_ISOLATION = ("isolates each harness in a container from the task's image: its own root filesystem and "
                       "namespaces, a network that reaches only the proxy (unless the task allows the internet), CPU, "
                       "memory and process limits; the agent is root inside it with the engine's default capabilities")

__all__ = ["BACKENDS", "ExecResult", "ImageBuildError", "Limits", "Sandbox", "SandboxBackend", "SandboxError",
           "SandboxSpec", "backend_class", "isolation", "make_backend"]


def backend_class(name: str) -> type[SandboxBackend]:
    """The class of backend `name` (its `needs_image`, `isolated_network`), nothing opened."""
    if name == "process":
        from gyre.coordinator.sandbox.process import ProcessBackend

        return ProcessBackend
    if name == "podman":
        from gyre.coordinator.sandbox.podman import PodmanBackend

        return PodmanBackend
    if name == "docker":
        from gyre.coordinator.sandbox.docker_api import DockerAPIBackend

        return DockerAPIBackend
    if name == "bubblewrap":
        from gyre.coordinator.sandbox.bubblewrap import BubblewrapBackend

        return BubblewrapBackend
    raise SandboxError(f"sandbox must be one of {', '.join(BACKENDS)}, got {name!r}")


def isolation(name: str) -> str:
    """What backend `name` isolates, in a line that follows its name ("process isolates nothing: ...");
    `gyre doctor` and the run's start line say it."""
    return getattr(backend_class(name), "isolation", None) or CONTAINER_ISOLATION


def make_backend(name: str, url: str | None = None) -> SandboxBackend:
    """The backend `name` (not yet opened); `url` a Docker-compatible endpoint for podman/docker.
    Called once per sandbox host as a run starts: it says there what the backend isolates."""
    cls = backend_class(name)
    log.info("sandbox %s %s", name, isolation(name))
    if name == "podman":
        return cls(url)
    if name == "docker":
        return cls("docker", url or DOCKER_URL)
    return cls()
