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
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.metadata
import logging
import os
import re
import shutil
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
    """Build `folder` as `tag` unless the engine has it already; ImageBuildError if not."""
    if await backend.io(backend.image_exists, tag):
        return
    if BASE_IMAGE in from_images(folder, dockerfile):
        await ensure_base(backend)
    log.info("%s: building %s from %s (once per content of the folder; later runs reuse it)", backend.name, tag,
             folder)
    start = time.monotonic()

    def run() -> None:
        import docker.errors

        lines: list[str] = []
        try:
            for chunk in backend.client.api.build(path=str(folder), tag=tag, dockerfile=dockerfile, rm=True,
                                                  forcerm=True, decode=True, labels={"gyre.content": tag}):
                if "stream" in chunk:
                    for line in chunk["stream"].splitlines():
                        if STEP.match(line):  # one line per step: the build's progress
                            log.info("%s: %s: %s (%.0f s)", backend.name, tag, line.strip()[:200],
                                     time.monotonic() - start)
                    lines.extend(chunk["stream"].splitlines())
                    del lines[:-50]
                if "error" in chunk or "errorDetail" in chunk:
                    detail = chunk.get("error") or chunk["errorDetail"].get("message", "")
                    raise ImageBuildError(f"building {folder}: {detail.strip()} ({_tail(lines)})")
        except docker.errors.APIError as e:
            raise ImageBuildError(f"building {folder}: {e.explanation or e}") from None
        if not backend.image_exists(tag):
            raise ImageBuildError(f"building {folder}: the engine reported no image ({_tail(lines)})")

    try:
        await asyncio.wait_for(backend.io(run), timeout_s)
    except TimeoutError:
        raise ImageBuildError(f"building {folder}: not done after {timeout_s:g}s (build_timeout_sec)") from None
    log.info("%s: built %s in %.1f s", backend.name, tag, time.monotonic() - start)


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
