"""The sandbox preflight: a backend that cannot work here (its command missing, an engine that
does not answer, tasks it would refuse) is named in one line with its fix, in about the ping's
timeout, before anything is made; a backend that can work passes. Nothing here needs podman or
bwrap: PATH, the uid and the engine are faked at the edge."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gyre.coordinator.harnesses import resolve
from gyre.coordinator.launcher import Launcher, LaunchSpec
from gyre.coordinator.sandbox import SandboxError, make_backend
from gyre.coordinator.sandbox.preflight import check_sandbox
from gyre.coordinator.tasks import Environment, Task


@pytest.fixture
def bare_path(tmp_path, monkeypatch):
    """No command on PATH; caches and home pointed at folders that must stay unmade."""
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    for var in ("GYRE_CACHE", "GYRE_IMAGE_CACHE", "HOME"):
        monkeypatch.setenv(var, str(tmp_path / "unmade" / var))
    monkeypatch.delenv("GYRE_CONTAINERS_CONF", raising=False)
    yield
    assert not (tmp_path / "unmade").exists()  # the preflight made no directory


@pytest.fixture
def fake_engine():
    """A Docker-compatible engine that answers /version and /_ping, on a thread."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            body = json.dumps({"ApiVersion": "1.41"}).encode() if self.path.endswith("/version") else b"OK"
            self.send_response(200)
            self.send_header("Content-Type", "application/json" if body != b"OK" else "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"tcp://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(5)


@pytest.fixture
def silent_engine():
    """A port that accepts connections and never answers (a hung engine)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    yield f"tcp://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _refused(backend: str, **kw) -> str:
    with pytest.raises(SandboxError) as e:
        check_sandbox(backend, **kw)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_a_missing_backend_command_is_named_with_its_fix(bare_path):
    msg = _refused("podman")
    assert msg.startswith("sandbox podman: the `podman` command is not on PATH") and "apt-get install -y podman runc" \
        in msg and "choose another sandbox" in msg, msg
    msg = _refused("bubblewrap")
    assert msg.startswith("sandbox bubblewrap: the `bwrap` command is not on PATH") and \
        "apt-get install -y bubblewrap" in msg, msg
    check_sandbox("process")  # needs nothing


def test_bubblewrap_needs_root_and_nsenter(monkeypatch):
    import gyre.coordinator.sandbox.bubblewrap as bw

    have = {"bwrap": "/usr/bin/bwrap", "nsenter": "/usr/bin/nsenter", "setpriv": "/usr/bin/setpriv"}
    monkeypatch.setattr(bw.shutil, "which", lambda name: have.get(name))
    monkeypatch.setattr(bw.os, "geteuid", lambda: 0)
    check_sandbox("bubblewrap")
    monkeypatch.setattr(bw.os, "geteuid", lambda: 1000)
    assert "needs root" in _refused("bubblewrap")
    del have["setpriv"]  # it drops root inside the sandbox
    assert "`setpriv` command is not on PATH" in _refused("bubblewrap")
    del have["nsenter"]
    assert "`nsenter` command is not on PATH" in _refused("bubblewrap")


def test_an_engine_that_does_not_answer_is_named_within_the_timeout(bare_path, silent_engine, tmp_path):
    t = time.monotonic()
    msg = _refused("docker", url=silent_engine, timeout_s=0.5)
    assert time.monotonic() - t < 5
    assert f"no engine answers at {silent_engine} within 0.5 s (timed out)" in msg, msg
    msg = _refused("podman", url=f"tcp://127.0.0.1:{_closed_port()}", timeout_s=0.5)
    assert "(connection refused)" in msg and "podman system service" in msg, msg
    msg = _refused("docker", url=f"unix://{tmp_path / 'no.sock'}")
    assert f"no engine socket at {tmp_path / 'no.sock'}" in msg, msg


def test_an_engine_that_answers_passes_and_a_pool_needs_one_host_up(bare_path, fake_engine, silent_engine):
    check_sandbox("docker", url=fake_engine)
    check_sandbox("podman", url=fake_engine)  # an existing service: the podman command is not needed
    down = {"name": "down", "url": silent_engine}
    check_sandbox("podman", hosts=({"name": "up", "url": fake_engine}, down), timeout_s=0.5)
    msg = _refused("podman", hosts=(down, {"name": "gone", "url": f"tcp://127.0.0.1:{_closed_port()}"}),
                   timeout_s=0.5)
    assert msg.startswith("sandbox podman: no sandbox host answers (down: ") and "gone: " in msg, msg


def _image_task(tmp_path) -> Task:
    return Task(id="in-image", prompt="p", environment=Environment(build_dir=str(tmp_path)))


@pytest.mark.parametrize("backend", ["process", "bubblewrap"])
def test_tasks_the_run_would_refuse_are_refused_first_with_the_launchers_words(backend, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # even with bwrap missing, the tasks are what to fix first
    tasks = [Task(id="plain", prompt="p"), _image_task(tmp_path),
             Task(id="verified", prompt="p", verifier={"type": "harbor"})]
    msg = _refused(backend, tasks=tasks)
    launcher = Launcher(None, tmp_path, LaunchSpec(preset=resolve("demo", {}), timeout_s=1, eval_attempts=1,
                                                   eval_budget_s=1), backend=make_backend(backend))
    with pytest.raises(SandboxError) as e:
        launcher.images.check(tasks[1])
    assert msg == f"{e.value} (and 1 more task(s))"
    assert "runs no images (use sandbox = \"podman\" or \"docker\")" in msg
    check_sandbox("process", tasks=tasks[:1])


def test_a_task_asking_for_the_internet_needs_sandbox_internet(fake_engine, tmp_path):
    task = Task(id="online", prompt="p", environment=Environment(image="img", allow_internet=True))
    assert "set sandbox_internet = true" in _refused("docker", url=fake_engine, tasks=[task])
    check_sandbox("docker", url=fake_engine, tasks=[task], internet=True)
    check_sandbox("docker", url=fake_engine, tasks=[_image_task(tmp_path)])


def test_the_preflight_is_fast_and_leaves_no_thread(bare_path):
    before = threading.active_count()
    t = time.monotonic()
    for backend in ("process", "podman", "bubblewrap"):
        try:
            check_sandbox(backend)
        except SandboxError:
            pass
    assert time.monotonic() - t < 1.0 and threading.active_count() == before
