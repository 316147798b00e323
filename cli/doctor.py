"""doctor.py: `gyre doctor [RUN_DIR]`: can this machine run gyre, and what state is a run in?

One line per check: ok / warn / fail, what was checked and, for warn and fail, the fix. The
installation (Python, torch, gyre's packages and extras, sandbox tools, harness binaries,
disk, the open-file limit, loopback), here; given RUN_DIR, the run directory's checks
(runchecks.py: config, model, state, lock, journal, checkpoint, records, containers), both
built of checks.py's Check, probe and guarded.
Every probe is bounded (PROBE_S per subprocess, no podman service started) and nothing is
written: the fixes are for the user to run. Not `gyre inspect` (what a run did), not the
preflight `gyre up` runs (sandbox/preflight.py, whose checks are reused here).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata as md
import importlib.util
import json
import os
import resource
import shlex
import shutil
import socket
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer

from gyre.cli.checks import FAIL, OK, PROBE_S, WARN, Check, free_disk, guarded, probe, split_fix

DOCKER_PING_S = 1.0
FDS_WARN = 4096  # every execution holds sockets, pipes and log files; a default 1024 runs out
# Import names that differ from the distribution's (the rest: the name with - as _).
MODULES = {"pyzmq": "zmq", "pyyaml": "yaml", "megatron-core": "megatron.core",
           "mooncake-transfer-engine": "mooncake", "mooncake-transfer-engine-non-cuda": "mooncake"}
EXTRAS = (("models", "gyre init-model smollm2"),
          ("gpu", "engine_backend = sglang, trainer_backend = megatron, weight_transfer = mooncake"),
          ("tensorboard", "the tensorboard tracker"), ("wandb", "the wandb tracker"))

DoctorRunDirArg = Annotated[Path | None, typer.Argument(
    help="A run directory to check too: config, model, state, lock, metrics, checkpoint, records, sandboxes.")]
DoctorJsonOpt = Annotated[bool, typer.Option("--json", help="Print a JSON list of {check, status, detail, fix}.")]


def doctor(run_dir: DoctorRunDirArg = None, as_json: DoctorJsonOpt = False) -> None:
    """Check the installation (and RUN_DIR, when given): one line per check with the fix;
    exit status 1 when any check fails."""
    from gyre.cli.runchecks import run_directory

    checks = installation() + (run_directory(run_dir) if run_dir is not None else [])
    if as_json:
        typer.echo(json.dumps([asdict(c) for c in checks], indent=2))
    else:
        for c in checks:
            typer.echo(c.line())
    raise typer.Exit(1 if any(c.status == FAIL for c in checks) else 0)


# --- the installation --------------------------------------------------------------------


def installation() -> list[Check]:
    out: list[Check] = []
    for fn in (_python, _gyre, _torch, _core, _extras, _podman, _bubblewrap, _isolation, _base_image, _docker,
               _harnesses, _disks, _fds, _loopback):
        out += guarded(fn)
    return out


def _python() -> Check:
    from packaging.specifiers import SpecifierSet

    v = ".".join(map(str, sys.version_info[:3]))
    dist = _dist()
    want = SpecifierSet((dist.metadata["Requires-Python"] if dist else None) or ">=3.11")
    if v not in want:
        return Check("python", FAIL, f"{v} ({sys.executable}); gyre needs {want}",
                     "python3.11 -m venv .venv && . .venv/bin/activate && pip install -e .")
    return Check("python", OK, f"{v} ({sys.executable})")


def _dist() -> md.Distribution | None:
    """gyre's installed distribution: the one pip installed (a checkout's gyre.egg-info, first on
    sys.path when run from the checkout, is a build leftover)."""
    found = list(md.distributions(name="gyre"))
    return next((d for d in found if d.read_text("direct_url.json")), found[0] if found else None)


def _editable(dist: md.Distribution | None) -> Path | None:
    info = json.loads((dist.read_text("direct_url.json") if dist else None) or "{}")
    if not info.get("dir_info", {}).get("editable"):
        return None
    return Path(info["url"].removeprefix("file://"))


def _pip(extra: str = "") -> str:
    where, tail = _editable(_dist()), f"[{extra}]" if extra else ""
    if where is None:
        return f"pip install 'gyre{tail}'"
    here = "." if Path.cwd() == where else shlex.quote(str(where))
    return f"pip install -e '{here}{tail}'" if tail else f"pip install -e {here}"


def _requires(extra: str):
    """gyre's requirements for `extra` ("" : the core), from its installed metadata."""
    from packaging.requirements import Requirement

    dist = _dist()
    out = []
    for r in map(Requirement, (dist.requires or []) if dist else []):
        if extra == "" and (r.marker is None or r.marker.evaluate({"extra": ""})):
            out.append(r)
        elif extra and r.marker is not None and r.marker.evaluate({"extra": extra}) \
                and not r.marker.evaluate({"extra": ""}):
            out.append(r)
    return out


def _gyre() -> Check:
    dist = _dist()
    if dist is None:
        return Check("gyre", FAIL, "not installed (no distribution metadata)", _pip())
    where = _editable(dist)
    detail = f"{dist.version}" + (f" (editable, {where})" if where else "")
    stale = _stale(dist, where)
    if stale:
        return Check("gyre", WARN, f"{detail}: pyproject.toml's requirements changed since the install ({stale})",
                     f"{_pip()} again (it refreshes the installed requirements)")
    return Check("gyre", OK, detail)


def _stale(dist: md.Distribution, where: Path | None) -> str:
    """What an editable install's pyproject.toml requires that its installed metadata does not."""
    import tomllib

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    if where is None or not (where / "pyproject.toml").exists():
        return ""
    project = tomllib.loads((where / "pyproject.toml").read_text()).get("project", {})
    wanted = {("", r) for r in project.get("dependencies", [])}
    wanted |= {(e, r) for e, reqs in project.get("optional-dependencies", {}).items() for r in reqs}
    have = set()
    for e in ("", *(dist.metadata.get_all("Provides-Extra") or [])):
        have |= {(e, canonicalize_name(r.name), str(r.specifier)) for r in _requires(e)}
    new = []
    for e, text in sorted(wanted):
        r = Requirement(text)
        if (r.marker is None or r.marker.evaluate({"extra": e})) and \
                (e, canonicalize_name(r.name), str(r.specifier)) not in have:
            new.append(f"{text} [{e}]" if e else text)
    return ", ".join(new)


def _torch() -> Check:
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken wheel's OSError
        return Check("torch", FAIL, f"does not import ({type(e).__name__}: {e})", "pip install torch==2.13.0")
    want = next((r for r in _requires("") if r.name == "torch"), None)
    if want is not None and not want.specifier.contains(torch.__version__.split("+")[0], prereleases=True):
        return Check("torch", FAIL, f"{torch.__version__}; gyre needs torch{want.specifier}",
                     "pip install torch==2.13.0")
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        where = f"cuda {torch.version.cuda}, {n} GPU{'s' if n > 1 else ''}: {torch.cuda.get_device_name(0)}"
    elif torch.version.cuda:
        where = f"cpu: a CUDA {torch.version.cuda} build, no GPU visible"
    else:
        where = "cpu"
    return Check("torch", OK, f"{torch.__version__} ({where})")


def _version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def _core() -> Check:
    reqs = [r for r in _requires("") if r.name != "torch"]
    if not reqs:
        return Check("core packages", FAIL, "gyre's requirements are unknown (gyre is not installed)", _pip())
    found, bad = [], []
    for r in reqs:
        try:  # imported, not only found: a wheel with a missing shared library fails here
            importlib.import_module(MODULES.get(r.name, r.name.replace("-", "_")))
        except Exception as e:  # noqa: BLE001 - ImportError, OSError of a broken extension
            bad.append(f"{r.name} does not import ({type(e).__name__}: {e})")
            continue
        v = _version(r.name)
        if v is None or not r.specifier.contains(v, prereleases=True):
            bad.append(f"{r.name} {v or 'without metadata'} (gyre needs {r.name}{r.specifier})")
        else:
            found.append(f"{r.name} {v}")
    if bad:
        return Check("core packages", FAIL, "; ".join(bad), _pip())
    return Check("core packages", OK, ", ".join(found))


def _extras() -> list[Check]:
    dist = _dist()
    provided = set(dist.metadata.get_all("Provides-Extra") or []) if dist else set()
    return [_extra(name, why, name in provided) for name, why in EXTRAS]


def _extra(extra: str, why: str, provided: bool) -> Check:
    """An optional extra's packages: found (not imported: sglang and megatron take seconds)."""
    from packaging.requirements import Requirement

    reqs = _requires(extra) if provided else [Requirement(extra)]
    fix = _pip(extra) if provided else f"pip install {extra} (gyre has no [{extra}] extra yet)"
    found, missing = [], []
    for r in reqs:
        v, module = _version(r.name), MODULES.get(r.name, r.name.replace("-", "_"))
        if v is not None and r.specifier.contains(v, prereleases=True):
            found.append(f"{r.name} {v}")
        elif v is not None:
            missing.append(f"{r.name} {v} (wants {r.specifier})")
        elif importlib.util.find_spec(module.split(".")[0]) is not None:  # another distribution's build
            others = md.packages_distributions().get(module.split(".")[0], ["?"])
            found.append(f"{r.name} not installed, {module} from {', '.join(others)}")
        else:
            missing.append(f"{r.name} not installed")
    name = f"extra {extra}"
    if missing:
        return Check(name, WARN, f"for {why}: {'; '.join(missing + found)}", fix)
    return Check(name, OK, ", ".join(found))


def _podman() -> Check:
    from gyre.coordinator.sandbox.podman import unavailable

    why = unavailable()
    if why is not None:
        what, fix = split_fix(why)
        return Check("podman", WARN, f"{what} (sandbox = podman needs it)", f"{fix}, as root")
    notes = [(probe(["podman", "--version"]) or "podman (no answer to --version)").strip()]
    fixes = []
    if shutil.which("runc") is not None:
        notes.append("runc")
    else:  # SANDBOX-NOTES.md: crun refuses hosts with a hybrid cgroup layout
        notes.append("no runc")
        fixes.append("apt-get install -y runc (gyre's containers.conf names it where installed)")
    if os.geteuid() != 0:
        notes.append("not root")
        fixes.append("run gyre as root: its podman is rootful (gyre's base image and tests need root)")
    else:  # root without CAP_SYS_RESOURCE cannot raise ulimits: gyre's containers.conf sets them
        notes.append("root" + ("" if _cap(24) else ", no CAP_SYS_RESOURCE (gyre's containers.conf sets ulimits)"))
    conf = os.environ.get("GYRE_CONTAINERS_CONF")
    if conf and not Path(conf).is_file():
        fixes.append(f"GYRE_CONTAINERS_CONF names {conf}, which does not exist: unset it or write that file")
    return Check("podman", WARN if fixes else OK, ", ".join(notes), "; ".join(fixes))


def _cap(bit: int) -> bool:
    """Whether this process has capability `bit` in its effective set (24: CAP_SYS_RESOURCE)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> bit & 1)
    return False


def _bubblewrap() -> Check:
    from gyre.coordinator.sandbox.bubblewrap import unavailable

    why = unavailable()
    if why is not None:
        what, fix = split_fix(why)
        return Check("bubblewrap", WARN, f"{what} (sandbox = bubblewrap needs it)", fix)
    version = (probe(["bwrap", "--version"]) or "bwrap").strip()
    return Check("bubblewrap", OK, f"{version}, nsenter, setpriv, root")


def _isolation() -> list[Check]:
    """What each sandbox backend isolates, the process backend's nothing included: a fact of the
    backend, not a fault of this host (its availability is the podman and bubblewrap lines)."""
    from gyre.coordinator.sandbox import BACKENDS, isolation

    return [Check(f"sandbox {name}", OK, isolation(name)) for name in BACKENDS]


def _base_image() -> Check:
    from gyre.coordinator.sandbox.images import BASE_IMAGE, BASE_RECIPE, BASE_TAG, cache_dir

    root = os.geteuid() == 0
    if root and shutil.which("podman") and probe(["podman", "image", "exists", BASE_IMAGE]) is not None:
        return Check("base image", OK, f"{BASE_IMAGE} is in podman's image store")
    # The file name images.base_rootfs() gives the root's tar (it builds when asked for the path).
    tar = cache_dir() / f"gyre-base-{BASE_TAG}-{hashlib.sha256(BASE_RECIPE.encode()).hexdigest()[:12]}.tar"
    if tar.exists():
        return Check("base image", OK, f"{BASE_IMAGE}: its root is cached ({tar}), imported on first use")
    if root and shutil.which("debootstrap"):
        return Check("base image", OK, f"{BASE_IMAGE}: built with debootstrap on first use (about a minute)")
    return Check("base image", WARN, f"{BASE_IMAGE} is not built and cannot be here: it needs root and debootstrap",
                 "apt-get install -y debootstrap and run as root (or import your own image under that name)")


def _docker() -> Check:
    from gyre.coordinator.sandbox import DOCKER_URL
    from gyre.coordinator.sandbox.preflight import ping_engine

    error = ping_engine(DOCKER_URL, DOCKER_PING_S)
    if error is None:
        return Check("docker", OK, f"an engine answers at {DOCKER_URL}")
    return Check("docker", WARN, f"{error} (sandbox = docker without a sandbox_url needs it)",
                 "apt-get install -y docker.io; systemctl start docker (or point sandbox_url at an engine)")


def _harnesses() -> list[Check]:
    from gyre.coordinator.harnesses import BUILTIN, CODEX_VERSION, HarnessError, presets

    npm = shutil.which("npm")
    out = [Check("npm", OK, npm) if npm else Check(
        "npm", WARN, "not on PATH (the claude-code and codex presets install with it)", "apt-get install -y npm")]
    for name, p in presets().items():
        check = f"harness {name}"
        if isinstance(p, HarnessError):
            template = BUILTIN[name]() if name in BUILTIN else None
            if template is not None and not template.command:  # a template the run config completes
                out.append(Check(check, OK, f"a template: {template.install}"))
            else:
                out.append(Check(check, WARN, str(p), "fix the preset"))
        elif (exe := p.executable()) is None:
            out.append(Check(check, WARN, f"{p.command[0]!r} is not on PATH", p.install))
        elif name == "codex" and CODEX_VERSION not in (probe([exe, "--version"]) or ""):
            out.append(Check(check, WARN, f"{exe} is not codex {CODEX_VERSION}, the version the preset is tested with",
                             p.install))
        else:
            out.append(Check(check, OK, exe))
    return out


def _cache() -> Path:
    return Path(os.environ.get("GYRE_CACHE") or Path.home() / ".cache" / "gyre")


def _disks() -> list[Check]:
    return [free_disk("disk (runs)", Path.cwd(), "free space there, or give --run-dir on a roomier filesystem"),
            free_disk("disk (cache)", _cache(), "free space there, or point GYRE_CACHE at a roomier filesystem")]


def _fds() -> Check:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    unlimited = resource.RLIM_INFINITY
    shown = "unlimited" if hard == unlimited else str(hard)
    if soft == unlimited or soft >= FDS_WARN:
        return Check("open files", OK, f"limit {soft} (hard {shown})")
    if hard == unlimited or hard >= FDS_WARN:
        fix = f"ulimit -n {65536 if hard == unlimited else min(hard, 65536)} in the shell that starts gyre"
    else:
        fix = "raise the hard limit: nofile in /etc/security/limits.conf, or LimitNOFILE= in the systemd unit"
    return Check("open files", WARN, f"limit {soft} (hard {shown}): runs with many executions need more "
                 "(each holds sockets, pipes and log files)", fix)


def _loopback() -> Check:
    try:
        with socket.create_server(("127.0.0.1", 0)) as server:
            server.settimeout(PROBE_S)
            port = server.getsockname()[1]
            with socket.create_connection(("127.0.0.1", port), timeout=PROBE_S):
                server.accept()[0].close()
    except OSError as e:
        return Check("loopback", FAIL, f"127.0.0.1: {e.strerror or e}",
                     "bring the loopback interface up (ip link set lo up): the proxy, workers and harnesses use it")
    return Check("loopback", OK, f"127.0.0.1 binds and connects (port {port})")
