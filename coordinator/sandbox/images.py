"""images.py: task images under content-hashed tags, and gyre's base image, without a registry.

A task's environment folder (its Dockerfile and what it copies) is hashed, file names,
modes and bytes, into the tag `localhost/gyre-task-NAME:HASH`: the same content is built once
and reused (the engine's store is the cache), a changed file builds anew. A Dockerfile whose
FROM names `localhost/gyre-base:bookworm` gets that image built first when it is missing: a
Debian bookworm minbase root made with debootstrap from the host's Debian mirror (python3,
ca-certificates, the host's extra CA certificates, and the `openai` package with its
dependencies, which the demo harness needs), imported into the engine; the root's tar is
kept in the cache folder ($GYRE_IMAGE_CACHE, else $GYRE_CACHE, else ~/.cache/gyre), so a second engine or a
clone imports it in seconds. Needs root and debootstrap; elsewhere the error says so.
Builds report through the `gyre.coordinator` logger at INFO (what is built, debootstrap's
stages, each Dockerfile step, the seconds it took): a first run is not silent for minutes.
A build past its build_timeout_sec is stopped: its RUN steps run under a cgroup parent named
for that build alone, so their processes are found on the host and killed, the engine fails
the build and removes the step's container (forcerm). A task's storage_mb bounds
what its agent writes (storage.py), not its image: gyre's own example tasks run a 193 MB image
under storage_mb = 64.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from gyre.coordinator.sandbox.base import ImageBuildError

log = logging.getLogger("gyre.coordinator")

BASE_REPO, BASE_TAG = "localhost/gyre-base", "bookworm"
BASE_IMAGE = f"{BASE_REPO}:{BASE_TAG}"
BASE_PACKAGES = ("python3", "ca-certificates")
BASE_PYTHON = "3.11"  # bookworm's python3
BASE_PIP = ("openai",)  # the demo harness's one dependency, with its own
BASE_RECIPE = f"bookworm minbase {' '.join(BASE_PACKAGES)} pip:{' '.join(BASE_PIP)} v1"
_base_lock = asyncio.Lock()
HOST_CA_DIR = Path("/usr/local/share/ca-certificates")  # the host's extra CAs, trusted in the base image too
HEARTBEAT_S = 10.0  # a debootstrap stage longer than this says where it is this often
STEP = re.compile(r"^(STEP|Step) \d+/\d+\s*:")  # a build step line: podman's `STEP 2/5:`, docker's `Step 2/5 :`
STOP_BUILD_S = 30.0  # after its timeout, how long a build's RUN steps are killed for the engine to give up
KILL_ROUNDS = 50  # sweeps of /proc for a build's processes, each catching what the last one's forks made


def cache_dir() -> Path:
    """Where the base image's root tar is kept: $GYRE_IMAGE_CACHE, else $GYRE_CACHE, else ~/.cache/gyre."""
    return Path(os.environ.get("GYRE_IMAGE_CACHE") or os.environ.get("GYRE_CACHE") or Path.home() / ".cache" / "gyre")


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9_.-]+", "-", name.lower()).strip("-.")[:60] or "task"


def content_hash(folder: Path, dockerfile: str | None = None) -> str:
    h = hashlib.sha256(f"dockerfile={dockerfile or 'Dockerfile'}\n".encode())
    for path in sorted(p for p in folder.rglob("*") if p.is_file() or p.is_symlink()):
        rel = path.relative_to(folder).as_posix()
        mode = path.lstat().st_mode & 0o777
        data = os.readlink(path).encode() if path.is_symlink() else path.read_bytes()
        h.update(f"{rel}\0{mode:o}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()[:16]


def task_tag(name: str, folder: Path, dockerfile: str | None = None) -> str:
    return f"localhost/gyre-task-{_slug(name)}:{content_hash(folder, dockerfile)}"


def from_images(folder: Path, dockerfile: str | None = None) -> list[str]:
    """The images a Dockerfile's FROM lines name (stage names excluded)."""
    path = folder / (dockerfile or "Dockerfile")
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ImageBuildError(f"cannot read {path}: {e.strerror or e}") from None
    out, stages = [], set()
    for line in lines:
        words = line.split()
        if len(words) >= 2 and words[0].upper() == "FROM":
            args = [w for w in words[1:] if not w.startswith("--")]
            if args and args[0] not in stages:
                out.append(args[0])
            if len(args) >= 3 and args[1].upper() == "AS":
                stages.add(args[2])
    return out


def _tail(lines: list[str], n: int = 8) -> str:
    return " | ".join(line.strip() for line in lines[-n:] if line.strip())


async def build(backend, folder: Path, tag: str, *, dockerfile: str | None, timeout_s: float) -> None:
    """Build `folder` as `tag` unless the engine has it already; ImageBuildError if not, also
    when it takes past `timeout_s` (then the build is stopped: see `_stop_build`)."""
    if await backend.io(backend.image_exists, tag):
        return
    if BASE_IMAGE in from_images(folder, dockerfile):
        await ensure_base(backend)
    log.info("%s: building %s from %s (once per content of the folder; later runs reuse it)", backend.name, tag,
             folder)
    start = time.monotonic()
    marker = await backend.io(_cgroup_parent, backend)
    request = _BuildRequest()
    job = asyncio.ensure_future(backend.io(_run_build, backend, folder, tag, dockerfile, marker, request, start))
    try:
        await asyncio.wait_for(asyncio.shield(job), timeout_s)
    except TimeoutError:
        raise ImageBuildError(f"building {folder}: not done after {timeout_s:g}s (build_timeout_sec)") from None
    finally:
        if not job.done():  # past its deadline, or this call cancelled: nothing of it may go on
            await asyncio.shield(_stop_build(backend, job, marker, request, folder))
    log.info("%s: built %s in %.1f s", backend.name, tag, time.monotonic() - start)


class _BuildRequest:
    """The socket of a build's streamed reply: closed from the loop, it ends the reading thread."""

    def __init__(self):
        self.sock: socket.socket | None = None
        self.closed = False

    def close(self) -> None:
        self.closed = True
        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)  # wakes a recv blocked in the build's thread
            except OSError:
                pass  # closed already


def _cgroup_parent(backend) -> str | None:
    """A cgroup parent naming this build alone (its RUN steps' processes carry it in
    /proc/PID/cgroup), in the engine's cgroup manager's form; None when unknown (the build
    then runs without one, and a timeout can only stop reading it)."""
    try:
        driver = backend.client.info().get("CgroupDriver")
    except Exception as e:  # noqa: BLE001 - any engine error: build without the marker
        log.warning("%s: cgroup driver unknown (%s): a build past its timeout cannot be killed", backend.name, e)
        return None
    name = f"gyre_build_{secrets.token_hex(8)}"
    return {"cgroupfs": f"/{name}", "systemd": f"{name}.slice"}.get(driver)


def _run_build(backend, folder: Path, tag: str, dockerfile: str | None, marker: str | None,
               request: _BuildRequest, start: float) -> None:
    """The build, its stream logged a step at a time; on a thread. With a cgroup parent the
    request is made by hand (`_post_build`: the SDK's build takes none and hides its reply's
    socket); with none there is nothing to kill by, and the SDK's own build serves."""
    import docker.errors

    api = backend.client.api
    lines: list[str] = []
    try:
        if marker is None:
            for chunk in api.build(path=str(folder), tag=tag, dockerfile=dockerfile, rm=True, forcerm=True,
                                   decode=True, labels={"gyre.content": tag}):
                _build_chunk(backend, tag, folder, chunk, lines, start)
        else:
            with _post_build(api, folder, tag, dockerfile, marker, request) as response:  # closed however it ends
                for chunk in api._stream_helper(response, decode=True):
                    _build_chunk(backend, tag, folder, chunk, lines, start)
    except docker.errors.APIError as e:
        raise ImageBuildError(f"building {folder}: {e.explanation or e}") from None
    except Exception:  # noqa: BLE001 - the stream cut by its timeout: the caller says why
        if request.closed:
            raise ImageBuildError(f"building {folder}: stopped") from None
        raise
    if not backend.image_exists(tag):
        raise ImageBuildError(f"building {folder}: the engine reported no image ({_tail(lines)})")


def _post_build(api, folder: Path, tag: str, dockerfile: str | None, marker: str, request: _BuildRequest):
    """POST /build as the SDK's build makes it (.dockerignore, the client's proxy settings and
    registry auth), with `cgroupparent`; the streamed reply, its socket kept in `request`."""
    from docker import utils
    from docker.api.build import process_dockerfile

    ignore = folder / ".dockerignore"
    exclude = ([x.strip() for x in ignore.read_text().splitlines() if x.strip() and not x.strip().startswith("#")]
               if ignore.is_file() else None)
    spec = process_dockerfile(dockerfile, str(folder))
    params = {"t": tag, "rm": True, "forcerm": True, "dockerfile": spec[0], "cgroupparent": marker,
              "labels": json.dumps({"gyre.content": tag})}
    if proxies := api._proxy_configs.get_environment():
        params["buildargs"] = json.dumps(proxies)
    headers = {"Content-Type": "application/tar"}
    api._set_auth_headers(headers)
    with utils.tar(str(folder), exclude=exclude, dockerfile=spec) as context:
        response = api._post(api._url("/build"), data=context, params=params, headers=headers, stream=True,
                             timeout=None)
    try:
        raw = api._get_raw_response_socket(response)  # raises the engine's refusal (APIError)
    except BaseException:
        response.close()
        raise
    request.sock = raw if isinstance(raw, socket.socket) else getattr(raw, "_sock", None)
    if request.closed:  # stopped while the context was sent
        request.close()
    return response


def _build_chunk(backend, tag: str, folder: Path, chunk: dict, lines: list[str], start: float) -> None:
    """One decoded chunk of a build's stream: a step logged, the tail kept, an error raised."""
    if "stream" in chunk:
        for line in chunk["stream"].splitlines():
            if STEP.match(line):  # one line per step: the build's progress
                log.info("%s: %s: %s (%.0f s)", backend.name, tag, line.strip()[:200], time.monotonic() - start)
        lines.extend(chunk["stream"].splitlines())
        del lines[:-50]
    if "error" in chunk or "errorDetail" in chunk:
        detail = chunk.get("error") or chunk["errorDetail"].get("message", "")
        raise ImageBuildError(f"building {folder}: {detail.strip()} ({_tail(lines)})")


async def _stop_build(backend, job: asyncio.Future, marker: str | None, request: _BuildRequest, folder: Path) -> None:
    """Stop a build that ran out its time. Its RUN steps' processes (found by the cgroup
    parent `marker`) are killed until the engine gives the build up, which removes the step's
    container (forcerm); a build past STOP_BUILD_S, or with no marker or on another host,
    only has its reply closed, and the engine may go on with it: logged."""
    deadline = time.monotonic() + STOP_BUILD_S
    if marker is not None and getattr(backend, "local", False):
        while not job.done() and time.monotonic() < deadline:
            await asyncio.to_thread(_kill_cgroup, marker)
            await asyncio.wait({job}, timeout=0.5)  # the engine ends the build once its step is killed
    if not job.done():
        log.warning("%s: building %s: the engine did not give the build up; it may still be building", backend.name,
                    folder)
        request.close()
    await asyncio.wait({job}, timeout=STOP_BUILD_S)
    # Its outcome consumed, now or when it comes: the caller's ImageBuildError says what happened.
    job.add_done_callback(lambda f: f.cancelled() or f.exception())


def _kill_cgroup(marker: str) -> int:
    """SIGKILL every host process whose cgroup path holds `marker`, sweeping until a sweep
    finds none (a process forking as it dies is caught by the next). Returns how many."""
    killed = 0
    for _ in range(KILL_ROUNDS):
        found = 0
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/cgroup") as f:
                    if marker not in f.read():
                        continue
                with open(f"/proc/{entry}/stat") as f:
                    if f.read().rpartition(")")[2].split()[0] == "Z":
                        continue  # dead already, its parent yet to reap it
                os.kill(int(entry), signal.SIGKILL)
                found += 1
            except (OSError, ValueError):
                continue  # gone already
        if not found:
            break
        killed += found
    return killed


async def ensure_present(backend, image: str, *, timeout_s: float) -> None:
    """`image` in the engine's store, pulled when missing; ImageBuildError if it cannot be."""
    if await backend.io(backend.image_exists, image):
        return
    if image == BASE_IMAGE:
        await ensure_base(backend)
        return

    def pull() -> None:
        try:
            backend.client.images.pull(image)
        except Exception as e:  # noqa: BLE001 - any engine or network error: the image is not there
            raise ImageBuildError(f"image {image} is not present and cannot be pulled: {e}") from None

    try:
        await asyncio.wait_for(backend.io(pull), timeout_s)
    except TimeoutError:
        raise ImageBuildError(f"pulling {image}: not done after {timeout_s:g}s") from None


async def ensure_base(backend) -> None:
    async with _base_lock:
        if await backend.io(backend.image_exists, BASE_IMAGE):
            return
        start = time.monotonic()
        tar = await asyncio.to_thread(base_rootfs)
        log.info("%s: importing %s from %s", backend.name, BASE_IMAGE, tar)

        def load() -> None:
            reply = backend.client.api.import_image(src=str(tar), repository=BASE_REPO, tag=BASE_TAG,
                                                    changes=["CMD [\"/bin/bash\"]"])
            # podman's compatible API tags an import `latest` whatever tag is asked: tag it by id.
            ids = re.findall(r"sha256:[0-9a-f]{64}", str(reply))
            if ids and not backend.image_exists(BASE_IMAGE):
                image = backend.client.images.get(ids[-1])
                image.tag(BASE_REPO, BASE_TAG)
                if f"{BASE_REPO}:latest" in image.tags:  # the tag the import made, not one of the user's
                    backend.client.api.remove_image(f"{BASE_REPO}:latest", noprune=True)

        await backend.io(load)
        if not await backend.io(backend.image_exists, BASE_IMAGE):
            raise ImageBuildError(f"importing {tar} as {BASE_IMAGE}: the engine reported no image")
        log.info("%s: %s ready in %.1f s", backend.name, BASE_IMAGE, time.monotonic() - start)


def base_rootfs() -> Path:
    """The base root as a tar in the cache folder, made when missing (debootstrap, ~1 minute)."""
    digest = hashlib.sha256(BASE_RECIPE.encode()).hexdigest()[:12]
    out = cache_dir() / f"gyre-base-{BASE_TAG}-{digest}.tar"
    if out.exists():
        return out
    if os.geteuid() != 0 or shutil.which("debootstrap") is None:
        raise ImageBuildError(f"{BASE_IMAGE} is missing and cannot be built here: it needs root and debootstrap "
                              "(apt-get install debootstrap), or import your own image under that name")
    out.parent.mkdir(parents=True, exist_ok=True)
    mirror = debian_mirror()
    log.info("building gyre's base image %s (%s from %s; the first build takes about a minute, later ones reuse "
             "%s)", BASE_IMAGE, BASE_RECIPE, mirror, out)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gyre-base-", dir=out.parent) as tmp:
        root = Path(tmp, "root")
        _run(["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", BASE_TAG, str(root),
              mirror], "debootstrap", on_line=_Stages(start))
        extra = sorted(HOST_CA_DIR.glob("*.crt"))
        if extra:  # a host behind an inspecting proxy: HTTPS from builds needs its CAs
            _progress(start, f"trusting the host's {len(extra)} extra CA certificate(s)")
            for crt in extra:
                shutil.copy2(crt, root / "usr/local/share/ca-certificates" / crt.name)
            _run(["chroot", str(root), "update-ca-certificates"], "update-ca-certificates")
        _progress(start, f"adding the Python packages {' '.join(BASE_PIP)} and their dependencies")
        _python_packages(root / "usr/local/lib" / f"python{BASE_PYTHON}" / "dist-packages")
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for p in (root / junk).glob("*"):
                if p.is_file():
                    p.unlink()
        _progress(start, "packing the root into a tar")
        part = Path(tmp, "root.tar")
        _run(["tar", "-C", str(root), "--numeric-owner", "-cf", str(part), "."], "tar")
        os.replace(part, out)
    log.info("%s: root built in %.1f s: %s", BASE_IMAGE, time.monotonic() - start, out)
    return out


def _progress(start: float, what: str) -> None:
    log.info("%s: %s (%.0f s)", BASE_IMAGE, what, time.monotonic() - start)


class _Stages:
    """debootstrap's `I:` lines, one log line per stage (Retrieving, Extracting, Installing,
    Unpacking, Configuring...), not one per package; a long stage says where it is every
    HEARTBEAT_S seconds."""

    def __init__(self, start: float):
        self.start, self.stage, self.count, self.said = start, None, 0, start

    def __call__(self, line: str) -> None:
        if not line.startswith("I: "):
            return
        text = line[3:].strip()
        stage = (text.split() or [""])[0]
        stage = "Retrieving" if stage == "Validating" else stage  # they alternate, package by package
        now = time.monotonic()
        if stage != self.stage:
            self.stage, self.count = stage, 0
        elif now - self.said < HEARTBEAT_S:
            self.count += 1
            return
        self.count += 1
        self.said = now
        more = f", line {self.count} of this stage" if self.count > 1 else ""
        log.info("%s: debootstrap: %s (%.0f s%s)", BASE_IMAGE, text[:160], now - self.start, more)


def _run(argv: list[str], what: str, on_line: Callable[[str], None] | None = None) -> None:
    """`argv` to its end, its output read as it comes (to `on_line`); ImageBuildError naming
    `what` and the output's tail when it fails."""
    lines: list[str] = []
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace")
    except OSError as e:
        raise ImageBuildError(f"building {BASE_IMAGE}: {what} could not start: {e}") from None
    with proc:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            del lines[:-50]
            if on_line is not None:
                on_line(line)
    if proc.returncode != 0:
        raise ImageBuildError(f"building {BASE_IMAGE}: {what} failed (exit {proc.returncode}): {_tail(lines)}")


def debian_mirror() -> str:
    """$GYRE_DEBIAN_MIRROR, else the host's first Debian mirror, else deb.debian.org."""
    if os.environ.get("GYRE_DEBIAN_MIRROR"):
        return os.environ["GYRE_DEBIAN_MIRROR"]
    sources = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for path in sources:
        try:
            text = path.read_text()
        except OSError:
            continue
        for m in re.finditer(r"(?:^deb\s+(?:\[[^\]]*\]\s+)?|^URIs:\s*)(\S+)", text, re.M):
            uri = m.group(1)
            if uri.startswith("http") and "security" not in uri:
                return uri
    return "http://deb.debian.org/debian"


def _closure(names) -> list[importlib.metadata.Distribution]:
    from packaging.requirements import Requirement

    seen: dict[str, importlib.metadata.Distribution] = {}
    todo = list(names)
    while todo:
        name = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
        dist = importlib.metadata.distribution(name)
        seen[key] = dist
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


def _python_packages(target: Path) -> None:
    """BASE_PIP and its dependencies into the image's dist-packages: this interpreter's own
    installed copies where it is the image's Python version, else pip for that version."""
    target.mkdir(parents=True, exist_ok=True)
    if f"{sys.version_info.major}.{sys.version_info.minor}" == BASE_PYTHON:
        for dist in _closure(BASE_PIP):
            base = Path(dist.locate_file(""))
            for rel in dist.files or []:
                if rel.parts and rel.parts[0] == "..":
                    continue  # scripts outside site-packages
                src = base / rel
                if src.is_file() and "__pycache__" not in rel.parts:
                    dest = target / rel
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(src, dest)
        return
    _run([sys.executable, "-m", "pip", "install", "--quiet", "--target", str(target), "--only-binary=:all:",
          "--python-version", BASE_PYTHON, "--platform", "manylinux2014_x86_64", *BASE_PIP], "pip install")
