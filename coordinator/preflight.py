"""preflight.py: what the machine must offer a run, checked before anything starts.

`preflight(config)` is `gyre up`'s one check of a run's config against the machine (fresh
or resumed): the fixed ports free, the trackers importable, the task source readable, the
sandbox backend there for those tasks (sandbox/preflight.py). `gyre serve` checks its
port with `check_port`. Each runs before a worker starts or a run directory is made, so
a port in use is one line naming the port and the field that set it, not a traceback
after the workers came up. They only look (a bind that is closed at once); they start
nothing. Not the binds themselves: the proxy (proxy/server.py) and the link (link.py)
still own those.
"""

from __future__ import annotations

import errno
import socket

from gyre.workerd.wire import GyreError


class PortInUse(GyreError):
    """A fixed port the run needs is taken; the message names it and the field."""


def check_port(host: str, port: int, what: str) -> None:
    """Refuse `host:port` if a listener holds it (0: any free port, nothing to check)."""
    if not port:
        return
    bind_host = "" if host in ("*", "0.0.0.0") else host
    try:
        infos = socket.getaddrinfo(bind_host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise PortInUse(f"{what}: cannot resolve host {host!r}: {e.strerror}") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp and ZeroMQ bind
        try:
            s.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise PortInUse(f"{what}: port {port} on {host} is in use by another process; stop it or choose "
                                "another port (0 picks a free one)") from None
            raise PortInUse(f"{what}: cannot bind {host}:{port}: {e.strerror or e}") from None


def zmq_port(address: str) -> tuple[str, int] | None:
    """(host, port) of a tcp:// ZeroMQ address with a fixed port, else None."""
    if not address.startswith("tcp://"):
        return None
    host, _, port = address[len("tcp://"):].rpartition(":")
    try:
        return host.strip("[]"), int(port)
    except ValueError:
        return None


def check_ports(config) -> None:
    """The run's fixed ports on this host: the proxy's and the workers' link."""
    check_port(config.proxy_host, config.proxy_port, "proxy_port (the harnesses' HTTP proxy)")
    fixed = zmq_port(config.address)
    if fixed is not None:
        check_port(*fixed, what=f"address {config.address} (where worker daemons connect)")


def preflight(config) -> None:
    """What the machine must offer the run of `config` (a CoordinatorConfig), checked before
    a worker starts or a directory is made; the first that fails raises its one-line error."""
    from gyre.coordinator.sandbox.preflight import check_sandbox
    from gyre.coordinator.taskformats import load_task_source

    check_ports(config)
    if config.trackers:
        from gyre.coordinator.trackers import check as check_trackers

        check_trackers(config.trackers)
    tasks = load_task_source(config.tasks_path) if config.tasks_path else []
    check_sandbox(config.sandbox, url=config.sandbox_url, hosts=config.sandbox_hosts, tasks=tasks,
                  internet=config.sandbox_internet)


async def start_proxy(proxy) -> str:
    """`proxy.start()`, a bind that fails (the port taken since the check) one named line."""
    try:
        return await proxy.start()
    except OSError as e:
        raise PortInUse(f"the proxy cannot listen on {proxy.config.host}:{proxy.config.port}: "
                        f"{e.strerror or e}; choose another port (0 picks a free one)") from None
