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

__all__ = ["BACKENDS", "ExecResult", "ImageBuildError", "Limits", "Sandbox", "SandboxBackend", "SandboxError",
           "SandboxSpec", "make_backend"]


def make_backend(name: str, url: str | None = None) -> SandboxBackend:
    """The backend `name` (not yet opened); `url` a Docker-compatible endpoint for podman/docker."""
    if name == "process":
        from gyre.coordinator.sandbox.process import ProcessBackend

        return ProcessBackend()
    if name == "podman":
        from gyre.coordinator.sandbox.podman import PodmanBackend

        return PodmanBackend(url)
    if name == "docker":
        from gyre.coordinator.sandbox.docker_api import DockerAPIBackend

        return DockerAPIBackend("docker", url or "unix:///var/run/docker.sock")
    if name == "bubblewrap":
        from gyre.coordinator.sandbox.bubblewrap import BubblewrapBackend

        return BubblewrapBackend()
    raise SandboxError(f"sandbox must be one of {', '.join(BACKENDS)}, got {name!r}")
