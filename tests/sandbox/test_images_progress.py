"""Image builds say what they do: a task image's start, each Dockerfile step and its seconds; the
base image's start (about a minute the first time), debootstrap's stages (not every package),
the import and its seconds. The engine and debootstrap are faked at the edge (a fake
`debootstrap` on PATH, an engine object): no podman or root needed."""

from __future__ import annotations

import logging
import textwrap

from gyre.coordinator.sandbox import images


class FakeAPI:
    def __init__(self, engine):
        self.engine = engine

    def build(self, **kw):
        self.engine.built.append(kw["tag"])
        for text in ("STEP 1/3: FROM localhost/other:1\n", "STEP 2/3: RUN echo hi\nhi\n", "STEP 3/3: WORKDIR /app\n",
                     "COMMIT localhost/gyre-task-t\n"):
            yield {"stream": text}
        self.engine.images.add(kw["tag"])

    def import_image(self, **kw):
        self.engine.images.add(f"{kw['repository']}:{kw['tag']}")
        return "sha256:" + "0" * 64


class FakeEngine:
    """The backend surface images.py uses: name, io, image_exists, client.api."""

    name = "podman"

    def __init__(self):
        self.images: set[str] = set()
        self.built: list[str] = []
        self.client = type("Client", (), {})()
        self.client.api = FakeAPI(self)

    async def io(self, fn, *args, **kwargs):
        return fn(*args, **kwargs)

    def image_exists(self, image: str) -> bool:
        return image in self.images


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "gyre.coordinator" and r.levelno == logging.INFO]


async def test_a_task_build_logs_its_start_each_step_and_its_seconds(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="gyre.coordinator")
    (tmp_path / "Dockerfile").write_text("FROM localhost/other:1\nRUN echo hi\nWORKDIR /app\n")
    engine, tag = FakeEngine(), images.task_tag("t", tmp_path)
    await images.build(engine, tmp_path, tag, dockerfile=None, timeout_s=60)
    said = _messages(caplog)
    assert said[0].startswith(f"podman: building {tag} from {tmp_path}"), said
    steps = [m for m in said if "STEP" in m]
    assert [m.split(": ", 2)[2].split(" (")[0] for m in steps] == [
        "STEP 1/3: FROM localhost/other:1", "STEP 2/3: RUN echo hi", "STEP 3/3: WORKDIR /app"], said
    assert said[-1].startswith(f"podman: built {tag} in ") and said[-1].endswith(" s"), said
    caplog.clear()
    await images.build(engine, tmp_path, tag, dockerfile=None, timeout_s=60)  # present: nothing built, nothing said
    assert engine.built == [tag] and _messages(caplog) == []


FAKE_DEBOOTSTRAP = textwrap.dedent('''\
    #!/bin/sh
    root="$4"
    echo "I: Retrieving InRelease" >&2
    echo "I: Checking Release signature" >&2
    echo "I: Retrieving Packages" >&2
    echo "I: Validating Packages" >&2
    echo "I: Resolving dependencies of required packages..." >&2
    echo "I: Resolving dependencies of base packages..." >&2
    for p in adduser apt base-files bash coreutils; do
        echo "I: Retrieving $p 1.0" >&2; echo "I: Validating $p 1.0" >&2
    done
    echo "not an info line" >&2
    for p in adduser apt base-files; do echo "I: Extracting $p..." >&2; done
    echo "I: Installing core packages..." >&2
    echo "I: Configuring required packages..." >&2
    mkdir -p "$root/usr/local/share/ca-certificates" "$root/var/cache/apt/archives" "$root/var/lib/apt/lists"
    echo "I: Base system installed successfully." >&2
''')


async def test_the_base_image_build_logs_its_start_stages_and_seconds(tmp_path, monkeypatch, caplog):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "debootstrap").write_text(FAKE_DEBOOTSTRAP)
    (bin_dir / "debootstrap").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("GYRE_IMAGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("GYRE_DEBIAN_MIRROR", "http://mirror.invalid/debian")
    monkeypatch.setattr(images.os, "geteuid", lambda: 0)
    monkeypatch.setattr(images, "HOST_CA_DIR", tmp_path / "no-cas")  # no chroot into the fake root
    monkeypatch.setattr(images, "_python_packages", lambda target: target.mkdir(parents=True))
    caplog.set_level(logging.INFO, logger="gyre.coordinator")
    engine = FakeEngine()
    await images.ensure_base(engine)
    assert engine.image_exists(images.BASE_IMAGE)
    said = _messages(caplog)
    assert said[0].startswith(f"building gyre's base image {images.BASE_IMAGE}") and "about a minute" in said[0], said
    stages = [m.split("debootstrap: ", 1)[1].rsplit(" (", 1)[0] for m in said if "debootstrap: " in m]
    # One line per stage, the stage's first: five packages retrieved and validated make one line.
    assert stages == ["Retrieving InRelease", "Checking Release signature", "Retrieving Packages",
                      "Resolving dependencies of required packages...", "Retrieving adduser 1.0",
                      "Extracting adduser...", "Installing core packages...", "Configuring required packages...",
                      "Base system installed successfully."], said
    assert any("adding the Python packages openai" in m for m in said)
    assert any("packing the root into a tar" in m for m in said)
    assert any(m.startswith(f"{images.BASE_IMAGE}: root built in ") for m in said), said
    assert any(m.startswith("podman: importing ") for m in said)
    assert said[-1].startswith(f"podman: {images.BASE_IMAGE} ready in ") and said[-1].endswith(" s"), said


def test_a_failing_step_names_its_output_tail(tmp_path):
    import pytest

    from gyre.coordinator.sandbox.base import ImageBuildError

    with pytest.raises(ImageBuildError) as e:
        images._run(["sh", "-c", "echo one; echo two >&2; exit 3"], "debootstrap")
    assert "debootstrap failed (exit 3): one | two" in str(e.value)


def test_a_long_debootstrap_stage_says_where_it_is(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="gyre.coordinator")
    monkeypatch.setattr(images, "HEARTBEAT_S", 0.0)
    stages = images._Stages(0.0)
    for line in ("I: Retrieving a 1\n", "I: Validating a 1\n", "I: Retrieving b 1\n"):
        stages(line)
    said = [m.split("debootstrap: ", 1)[1] for m in _messages(caplog)]
    assert [m.rsplit(" (", 1)[0] for m in said] == ["Retrieving a 1", "Validating a 1", "Retrieving b 1"]
    assert said[-1].endswith(", line 3 of this stage)"), said
