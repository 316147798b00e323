"""keys.py: CURVE key pairs for the coordinator <-> workerd link.

A key directory holds the coordinator's pair, one pair per worker name under `workers/`,
and `authorized/`: the public keys the coordinator accepts (ZeroMQ's ZAP handler checks
every connecting worker against it; one without an authorised key never completes the
handshake, so it cannot even register). Secret files are written 0600. Layout:

    DIR/coordinator.key  DIR/coordinator.key_secret
    DIR/workers/NAME.key DIR/workers/NAME.key_secret
    DIR/authorized/NAME.key

Copy DIR/coordinator.key and DIR/workers/NAME.key_secret (with NAME.key) to a worker's
node; keep DIR/coordinator.key_secret on the coordinator only. Here in workerd/, beside the
daemon's server.py that reads its `client_keys`: the coordinator (its link, `gyre keys`) may
import it, a light module (standard library at import, zmq.auth only to make keys; no
torch; tests/test_layering.py). `on_loopback` says which bind addresses need no keys. Not
the link: link.py and server.py apply these to their sockets.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
from pathlib import Path

from gyre.workerd.wire import GyreError

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class KeyFileError(GyreError):
    """A key directory or key that cannot be used: the message names the file."""


def _create(folder: Path, name: str) -> None:
    import zmq.auth

    folder.mkdir(parents=True, exist_ok=True)
    old = os.umask(0o077)  # the secret is never readable by others, not even for a moment
    try:
        public, secret = zmq.auth.create_certificates(str(folder), name)
    finally:
        os.umask(old)
    os.chmod(secret, 0o600)
    os.chmod(public, 0o644)


def init_keys(root: Path, workers: tuple[str, ...] = ("worker",)) -> list[Path]:
    """A new key directory: the coordinator's pair and one pair per worker name."""
    root = Path(root)
    if (root / "coordinator.key_secret").exists():
        raise KeyFileError(f"{root} already holds a coordinator key; use `gyre keys add` for more workers")
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    _create(root, "coordinator")
    for name in workers:
        add_worker(root, name)
    return sorted(p for p in root.rglob("*") if p.is_file())


def add_worker(root: Path, name: str) -> Path:
    """A new worker pair, authorised. Returns the worker's secret file."""
    root = Path(root)
    if not _NAME.match(name):
        raise KeyFileError(f"worker key name {name!r}: letters, digits, _ . - only")
    if not (root / "coordinator.key").exists():
        raise KeyFileError(f"{root} is not a key directory (no coordinator.key): run `gyre keys init {root}` first")
    if (root / "workers" / f"{name}.key").exists():
        raise KeyFileError(f"worker key {name!r} already exists in {root / 'workers'}")
    _create(root / "workers", name)
    (root / "authorized").mkdir(exist_ok=True)
    shutil.copy(root / "workers" / f"{name}.key", root / "authorized" / f"{name}.key")
    return root / "workers" / f"{name}.key_secret"


def _load(path: Path, secret: bool) -> tuple[bytes, bytes | None]:
    import zmq.auth

    if not path.exists():
        raise KeyFileError(f"missing key file {path}")
    try:
        public, sec = zmq.auth.load_certificate(str(path))
    except (ValueError, OSError) as e:
        raise KeyFileError(f"unreadable key file {path}: {e}") from None
    if secret and sec is None:
        raise KeyFileError(f"{path} holds no secret key")
    return public, sec


def server_keys(root: Path) -> tuple[bytes, bytes, Path]:
    """(public, secret, authorized dir) for the coordinator's socket."""
    root = Path(root)
    public, secret = _load(root / "coordinator.key_secret", secret=True)
    authorized = root / "authorized"
    if not authorized.is_dir() or not any(authorized.glob("*.key")):
        raise KeyFileError(f"{authorized} has no authorised worker keys: add one with `gyre keys add {root} NAME`")
    return public, secret, authorized


def client_keys(root: Path, name: str) -> tuple[bytes, bytes, bytes]:
    """(public, secret, coordinator public) for worker `name`'s socket. The worker's files
    may sit in root/workers/ (a full key directory) or in root itself (a copied subset)."""
    root = Path(root)
    where = root / "workers" if (root / "workers" / f"{name}.key_secret").exists() else root
    public, secret = _load(where / f"{name}.key_secret", secret=True)
    server_public, _ = _load(root / "coordinator.key", secret=False)
    return public, secret, server_public


def on_loopback(address: str) -> bool:
    """Whether a ZeroMQ bind address is reachable from this host only: tcp:// on a loopback
    address (127.0.0.0/8, ::1, localhost, the `lo` interface), ipc:// or inproc://. Without
    CURVE keys the worker link binds nothing else unless the run config opts in."""
    scheme, _, rest = address.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    host = rest.rpartition(":")[0].strip("[]")
    if host in ("localhost", "lo"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # *, an interface name, a host name: not provably loopback
        return False
