"""config.py: the workerd's own settings (what a node is), as one frozen dataclass.

What model to load and which role to hold come from the coordinator's Welcome, so a
node's config is only about where it is and how it talks.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerConfig:
    coordinator: str  # tcp://HOST:PORT or ipc://PATH
    cell: int | None = None
    node_rank: int = 0
    node_id: str = ""
    devices: tuple[str, ...] = ("cpu",)
    engine_backend: str = "cpu"
    trainer_backend: str = "cpu"
    heartbeat_s: float = 1.0
    welcome_timeout_s: float = 60.0  # registration handshake deadline
    graceful_timeout_s: float = 10.0  # drain on SIGTERM before force exit
    parent_pid: int | None = None  # exit when this process is gone (workers a coordinator spawned)
    # With parent_pid: once it is gone, keep the backends this long for a coordinator that resumes
    # the run at the same address (it welcomes us again, and we follow its pid); 0: exit at once.
    linger_s: float = 0.0
    keys_dir: str | None = None  # CURVE key directory (keys.py); None: a plain link
    key_name: str = "worker"  # this node's key pair in keys_dir
    extra: dict = field(default_factory=dict)

    @property
    def resolved_node_id(self) -> str:
        return self.node_id or f"{socket.gethostname()}-{os.getpid()}"
