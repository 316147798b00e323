"""The live view: rendered from a recorded coordinator state at 80 and 160 columns, the plain
line form, and `gyre top` attaching to a status endpoint over HTTP."""

from __future__ import annotations

import asyncio
import copy
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from gyre.cli.live import plain_line, render, strip
from gyre.cli.main import app
from gyre.proxy.backend import ThreadEngineBackend
from gyre.proxy.server import ProxyServer
from tests.scripted import ScriptedEngine

STATUS = json.loads((Path(__file__).parent / "fixtures" / "status_elastic.json").read_text())


def draw(status: dict, width: int) -> str:
    console = Console(width=width, file=io.StringIO(), color_system=None, record=True)
    console.print(render(status, width))
    return console.export_text()


@pytest.mark.parametrize("width", [80, 160])
def test_render_fits_and_shows_the_run(width):
    text = draw(STATUS, width)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= width
    assert "elastic" in text and "step 2/3" in text and "version 2" in text and "pubs 2" in text
    assert "queued 0  running 16  finished 32" in text and "(d 48 p 48 f 32)" in text
    assert "reward 0.038" in text and "valid 1.00" in text and "staleness 0.00" in text
    assert "rollout 0" in text and "training 21" in text
    rows = [line for line in lines if line.lstrip().startswith(("0 ", "1 "))]
    assert len(rows) == 2 and all("rollout" in r for r in rows)
    assert "switches 29s c1->training  34s c0->rollout  34s c1->rollout" in text  # the last three


def test_the_role_strip_widens_with_the_terminal():
    def strip_of(width):
        row = next(line for line in draw(STATUS, width).splitlines() if line.lstrip().startswith("0 "))
        return row.split()[-1]

    narrow, wide = strip_of(80), strip_of(160)
    assert set(narrow) == set(wide) == {"-", "#"}
    assert len(wide) - len(narrow) == 80


def test_strip_maps_time_to_roles():
    timeline = [[0.0, "rollout"], [5.0, "training"], [8.0, "rollout"]]
    assert strip(timeline, 10.0, 10).plain == "-----###--"
    assert strip([[0.0, "training"]], 0.0, 4).plain == "####"


def test_dead_cells_show_while_running_not_at_shutdown():
    s = copy.deepcopy(STATUS)
    s["cells"][1]["alive"] = False
    assert "dead" in draw(s, 80)
    assert "cells Rx" in plain_line(s)
    s["state"] = "finishing"  # workers deregistering at the end are not deaths
    assert "dead" not in draw(s, 80)


def test_plain_line():
    line = plain_line(STATUS)
    assert line.startswith("t=40s step 2/3 version 2 queued 0 running 16 finished 32 cells RR")
    assert "\n" not in line


@pytest.fixture
async def status_server(chat_tokenizer, tmp_path):
    engine = ScriptedEngine(chat_tokenizer)
    backend = ThreadEngineBackend(engine, sampling_cls=lambda **kw: kw)
    server = ProxyServer(chat_tokenizer, backend, run_dir=tmp_path / "run")
    url = await server.start()
    yield server, url
    await server.stop()
    backend.close()


async def test_status_endpoint_and_top_once(status_server, tmp_path):
    server, url = status_server
    r = await asyncio.to_thread(CliRunner().invoke, app, ["top", url, "--once", "--no-live"])
    assert r.exit_code == 1 and "404" in r.output  # no coordinator behind this proxy
    server.status_provider = lambda: STATUS
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    (run / "coordinator.json").write_text(json.dumps({"status_url": f"{url}/gyre/status"}))
    for target in (url, str(run)):
        r = await asyncio.to_thread(CliRunner().invoke, app, ["top", target, "--once", "--no-live"])
        assert r.exit_code == 0, r.output
        assert r.output.strip() == plain_line(STATUS)


def test_top_without_a_coordinator_is_a_one_line_error(tmp_path):
    r = CliRunner().invoke(app, ["top", str(tmp_path), "--once"])
    assert r.exit_code == 1 and r.output.startswith("[error]") and "coordinator.json" in r.output


@pytest.mark.timeout(60)
async def test_top_follows_until_the_coordinator_goes(status_server):
    server, url = status_server
    server.status_provider = lambda: STATUS
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gyre.cli", "top", url, "--no-live", "--interval", "0.05",
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = await proc.stdout.readline()  # it is following
    assert first.decode().strip() == plain_line(STATUS)
    await server.stop()
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    assert "stopped answering" in out.decode()
