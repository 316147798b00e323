"""The unit files in systemd/ pass `systemd-analyze verify` (where the tool exists)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

UNITS = sorted((Path(__file__).parents[2] / "systemd").glob("*.service"))


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed here")
@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_unit_verifies(unit, tmp_path):
    name = unit.name.replace("@.service", "@0.service")  # a template is verified as an instance
    shutil.copy(unit, tmp_path / unit.name)
    if name != unit.name:
        (tmp_path / name).symlink_to(tmp_path / unit.name)
    r = subprocess.run(["systemd-analyze", "verify", str(tmp_path / name)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_there_are_units():
    assert {p.name for p in UNITS} >= {"gyre-workerd@.service", "gyre-coordinator.service"}


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed here")
def test_verify_catches_a_broken_unit(tmp_path):
    bad = tmp_path / "bad.service"
    bad.write_text("[Service]\nExecStart=relative/gyre\n")
    r = subprocess.run(["systemd-analyze", "verify", str(bad)], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
