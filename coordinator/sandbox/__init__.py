"""sandbox: where executions run: the interface (base.py) and one file per backend."""

from __future__ import annotations

from gyre.coordinator.sandbox.base import (
    ExecResult,
    ImageBuildError,
    Limits,
    Sandbox,
    SandboxBackend,
    SandboxError,
    SandboxSpec,
)

BACKENDS = ("process", "podman", "docker", "bubblewrap")
DOCKER_URL = "unix:///var/run/docker.sock"  # the docker backend's engine when no sandbox_url is given

__all__ = ["BACKENDS", "ExecResult", "ImageBuildError", "Limits", "Sandbox", "SandboxBackend", "SandboxError",
           "SandboxSpec", "backend_class", "make_backend"]


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


def make_backend(name: str, url: str | None = None) -> SandboxBackend:
    """The backend `name` (not yet opened); `url` a Docker-compatible endpoint for podman/docker."""
    cls = backend_class(name)
    if name == "podman":
        return cls(url)
    if name == "docker":
        return cls("docker", url or DOCKER_URL)
    return cls()
