"""The live view: rendered from a recorded coordinator state at 80 and 160 columns, its
legend, what it says while calls wait for their first token (and n/a for what nobody
measured), the executions panel (the slowest first, counts by phase, its terms defined),
the plain line form, and `gyre top` attaching to a status endpoint over HTTP."""

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
from gyre.coordinator.routing import LinkBackend, RoutingTable
from gyre.coordinator.status import Rates, snapshot
from gyre.proxy.backend import GenParams
from gyre.proxy.server import ProxyServer
from tests.scripted import ScriptedEngine
from tests.support import ThreadEngineBackend

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


# --- the legend, and tokens/s that never reads a bare 0 for calls in prefill --------------

LEGEND_AT_80 = [  # each phrase whole, on one line
    "burst: steps since publishing, of mu per burst", "phi: batches queued ahead",
    "d p f: dispatched, launched, finished", "prefill: uncached prompt tokens", "run: calls in flight",
    "homes: executions routed here", "hit: prefix-cache hit rate", "claim: micro-steps it claimed in the batch",
    "timeline: - rollout  # training"]


def prefilling() -> dict:
    """16 calls at the engines, none with a token yet, the engines prefilling 3,712 tokens/s."""
    s = copy.deepcopy(STATUS)
    s["burst"]["phi"] = 0.5
    s["rates_window_s"] = 10.0
    s["tokens_per_s"].update(rollout=0.0, prefill=3712.4)
    s["calls"] = {"in_flight": 16, "awaiting_first_token": 16}
    return s


@pytest.mark.parametrize("width", [80, 100, 120, 160])
def test_the_legend_explains_the_terms_at_every_width(width):
    lines = draw(prefilling(), width).splitlines()
    assert max(len(line) for line in lines) <= width
    for phrase in LEGEND_AT_80:
        assert any(phrase in line for line in lines), phrase
    legend = [line for line in lines if any(phrase in line for phrase in LEGEND_AT_80)]
    assert len(legend) <= {80: 4, 100: 4, 120: 3, 160: 2}[width]  # packed, not one line per entry
    assert "phi 0.5" in lines[0]
    assert not any("phi:" in line for line in draw(STATUS, width).splitlines())  # not shown: not explained


@pytest.mark.parametrize("width", [80, 160])
def test_calls_without_a_token_yet_show_prefill_and_calls_not_a_bare_0(width):
    text = draw(prefilling(), width)
    assert max(len(line) for line in text.splitlines()) <= width
    assert "tokens/s (last 10s) rollout 0  prefill 3712  training 21" in text
    assert "calls 16 in flight: 0 generating, 16 queued or in prefill" in text
    assert plain_line(prefilling()).endswith("calls in flight 16 tokens/s generated 0 prefilled 3712")


def test_executions_between_calls_show_where_they_are_not_that_they_do_not_call():
    s = copy.deepcopy(STATUS)  # a coordinator from before phases: where they are is not known
    s["calls"] = {"in_flight": 0, "awaiting_first_token": 0}
    assert "calls 0 in flight (16 executions running, between calls)" in draw(s, 80)
    s = with_executions(s)  # the phases say it: starting, between calls (tools), scoring
    s["phases"].update({"model call": 0, "tool": 12})
    text = draw(s, 80)
    assert "calls 0 in flight\n" in text and "not calling the model" not in text
    assert "phases 1 sandbox  1 harness  12 tool  2 verifier" in text
    for cell in s["cells"]:
        cell.update(role="training", accepting=False)
    assert "calls 0 in flight (no cell takes calls now; 16 executions running)" in draw(s, 80)


def test_what_nobody_measured_reads_na_never_0():
    s = copy.deepcopy(STATUS)
    s["tokens_per_s"] = {"rollout": None, "training": None, "prefill": None}
    text = draw(s, 80)
    assert "rollout n/a  prefill n/a  training n/a" in text
    assert "generated n/a prefilled n/a" in plain_line(s)
    recorded = draw(STATUS, 80)  # a coordinator from before prefill counts and "calls"
    assert "prefill n/a" in recorded and "prefill 0" not in recorded
    assert "calls 15 in flight" in recorded  # its cells' running calls
    rows = [line for line in recorded.splitlines() if line.lstrip().startswith(("0 ", "1 "))]
    assert all(row.split()[4] == "n/a" for row in rows)  # no hit rate known yet


# --- the executions panel: one row per running execution, the slowest first --------------

# Five of 16 running executions as snapshot lists them (slowest first), and the counts by phase.
ROWS = [("g00004-03", "sort-csv", "verifier", 4.2, 6, 212.5, 0.5),
        ("g00004-05", "sort-csv", "model call", 1.3, 5, 201.0, 0.5),
        ("g00005-00", "fix-the-flaky-test-in-the-parser", "tool", 12.8, 9, 180.2, None),
        ("g00005-02", "fix-the-flaky-test-in-the-parser", "harness", 3.0, 0, 2.1, None),
        ("eval001-000-00", "hello-world", "sandbox", 0.4, 0, None, 1.0)]
EXECUTION_LEGEND = ["B: groups per step", "N: executions per group", "harness: no model call yet",
                    "model call: one at the proxy", "tool: between calls", "verifier: scoring", "in phase: time in it",
                    "reward: the task's last valid"]


def with_executions(status: dict) -> dict:
    s = copy.deepcopy(status)
    s["groups"] = {"per_step": 2, "size": 8}
    s["executions"] = [{"id": i, "task": t, "eval": i.startswith("eval"), "phase": p, "phase_s": ps, "calls": c,
                        "calls_in_flight": int(p == "model call"), "elapsed_s": e, "last_reward": r}
                       for i, t, p, ps, c, e, r in ROWS]
    s["phases"] = {"queued": 4, "image": 0, "sandbox": 1, "harness": 1, "model call": 3, "tool": 9, "verifier": 2,
                   "cleanup": 0}
    return s


@pytest.mark.parametrize("width", [80, 160])
def test_the_executions_panel_lists_the_slowest_first_under_counts_by_phase(width):
    lines = draw(with_executions(STATUS), width).splitlines()
    assert max(len(line) for line in lines) <= width
    assert "executions 16 running  queued 4  B 2  N 8" in lines
    assert "phases 1 sandbox  1 harness  3 model call  9 tool  2 verifier" in lines
    top = lines.index(next(line for line in lines if line.startswith("execution ")))
    assert lines[top].split() == ["execution", "task", "phase", "in", "phase", "calls", "elapsed", "reward"]
    rows = lines[top + 1: top + 6]
    assert [r.split()[0] for r in rows] == [r[0] for r in ROWS]  # as snapshot ordered them: the slowest first
    assert rows[0].split()[2:] == ["verifier", "4s", "6", "3m32s", "0.500"]
    assert rows[1].split()[2:] == ["model", "call", "1s", "5", "3m21s", "0.500"]
    assert rows[2].split()[-4:] == ["12s", "9", "3m00s", "n/a"]  # no valid reward of its task yet: n/a, not 0
    assert rows[4].split()[-3:] == ["0", "n/a", "1.000"]  # not started yet: no elapsed
    assert ("fix-the-flaky-test-in-the-parser" in rows[2]) == (width == 160)  # cut to fit at 80
    assert lines[top + 6] == "... and 11 more running (in the phases above)"
    for phrase in EXECUTION_LEGEND:  # its terms, defined on screen
        assert any(phrase in line for line in lines), phrase


@pytest.mark.parametrize("width", [170, 240])
def test_a_wide_terminal_draws_the_executions_beside_the_cells(width):
    lines = draw(with_executions(STATUS), width).splitlines()
    assert max(len(line) for line in lines) <= width
    header = next(line for line in lines if line.lstrip().startswith("cell "))
    assert header.split()[:2] == ["cell", "role"] and "executions 16 running  queued 4" in header  # one row
    beside = lines[lines.index(header) + 1]
    assert "phases 1 sandbox  1 harness  3 model call  9 tool  2 verifier" in beside
    top = next(line for line in lines if "execution " in line and "task" in line)
    assert top.split()[-8:] == ["execution", "task", "phase", "in", "phase", "calls", "elapsed", "reward"]
    assert any(line.rstrip().endswith("... and 11 more running (in the phases above)") for line in lines)
    assert not any(line.startswith("executions ") for line in lines)  # not drawn again under the cells
    for phrase in EXECUTION_LEGEND:
        assert any(phrase in line for line in lines), phrase


def test_without_executions_the_panel_and_its_terms_are_not_drawn():
    text = draw(STATUS, 80)  # a coordinator from before the panel (gyre top on an older run)
    assert "\nexecutions " not in text and "\nphases " not in text
    assert not any(phrase in text for phrase in EXECUTION_LEGEND)
    s = with_executions(STATUS)
    s["executions"], s["phases"] = [], dict.fromkeys(s["phases"], 0)
    text = draw(s, 80)
    assert "executions 0 running  queued 0  B 2  N 8\nphases none running\n" in text
    assert "execution " not in text  # no table header over no rows


def test_the_plain_line_counts_executions_by_phase():
    assert plain_line(with_executions(STATUS)).endswith(
        "prefilled n/a executions now 1 sandbox, 1 harness, 3 model call, 9 tool, 2 verifier")
    assert "executions now" not in plain_line(STATUS)


async def test_execution_rows_are_the_slowest_first_with_their_phases_and_none_for_unknown():
    from gyre.coordinator.buffer import Execution
    from gyre.coordinator.status import execution_rows
    from gyre.coordinator.tasks import Task
    from gyre.coordinator.waterlevel import Tracked
    from gyre.proxy.budget import Budgets

    wall, budgets, runs = 1000.0, Budgets(), []
    for i, (phase, started) in enumerate([("verifier", 900.0), ("harness", 990.0), ("sandbox", 999.0),
                                          ("harness", 950.0), ("queued", None)]):
        run = Execution(f"g00000-{i:02d}", 0, i, Task(id=f"t{i % 2}", prompt="p"), Tracked(), 0)
        run.t_start = started
        if started is not None:
            run.phase, run.phase_t = phase, started + 2.0
        runs.append(run)
    await budgets.admit(runs[3].id)  # its harness has a model call at the proxy now
    rows, phases = execution_rows(runs, budgets=budgets, last_reward={"t0": 0.25}, queued=4, wall=wall, keep=3)
    assert [(r["id"][-2:], r["phase"], r["elapsed_s"], r["phase_s"]) for r in rows] == [
        ("00", "verifier", 100.0, 98.0), ("03", "model call", 50.0, 48.0), ("01", "harness", 10.0, 8.0)]
    assert [r["last_reward"] for r in rows] == [0.25, None, None]  # t1 has no valid outcome yet
    assert [r["calls_in_flight"] for r in rows] == [0, 1, 0] and [r["calls"] for r in rows] == [0, 0, 0]
    # one launched that has not started yet counts as queued (with the 4 waiting for a slot)
    assert phases == {"queued": 5, "image": 0, "sandbox": 1, "harness": 1, "model call": 1, "tool": 0,
                      "verifier": 1, "cleanup": 0}
    budgets.release(runs[3].id)
    rows, _ = execution_rows(runs, budgets=None, last_reward={}, queued=0, wall=wall)
    assert len(rows) == 5 and rows[-1]["elapsed_s"] is None and rows[-1]["phase_s"] is None
    assert rows[1]["phase"] == "harness" and rows[1]["calls_in_flight"] is None  # no proxy: not known
    json.dumps(rows)


def test_rates_prefill_is_unknown_until_the_tick_passes_its_count():
    rates = Rates(window_s=10.0)
    assert rates.per_second() == (None, None) and rates.prefill_per_second() is None
    rates.sample(0.0, 0, 0)
    rates.sample(2.0, 10, 0)
    assert rates.per_second() == (5.0, 0.0) and rates.prefill_per_second() is None
    rates = Rates(window_s=10.0)
    for t, prefilled in ((0.0, 0), (5.0, 1851), (10.0, 3702), (15.0, 3702)):
        rates.sample(t, 0, 0, prefill_tokens=prefilled)
    assert rates.per_second() == (0.0, 0.0)
    assert rates.prefill_per_second() == pytest.approx(1851 / 10)  # the last 10 s: 5.0 to 15.0


class ScriptedLink:
    """The coordinator's link to workerds, as LinkBackend uses it: each node's chunks are
    what the test puts on that node's queue."""

    def __init__(self, nodes):
        self.chunks = {n: asyncio.Queue() for n in nodes}
        self.sent = asyncio.Queue()

    async def generate(self, node, msg, frames, on_frames=None):
        await self.sent.put(node)
        while True:
            chunk = await self.chunks[node].get()
            yield chunk
            if chunk.finished:
                return


def chunk(tokens, *, cached=None, finished=False, reason=None):
    from gyre.workerd import wire

    return wire.GenerateChunk(req_id=0, rid="r", token_ids=tokens, logprobs=[0.0] * len(tokens), version=0,
                              finished=finished, finish_reason=reason, cached_tokens=cached)


class Run:
    """The owners status.snapshot reads a run's state from, around a real RoutingTable and Rates."""

    def __init__(self, table: RoutingTable):
        from types import SimpleNamespace as NS

        from gyre.coordinator.waterlevel import Counters

        self.c = NS(policy="elastic", run_dir="runs/x", steps=3, mu=1, phi=0.0, groups_per_step=2, group_size=8)
        self.wl = NS(c=Counters(d=16, p=16, f=0))
        self.metrics, self.rates, self.table = NS(now=lambda: 40.0), Rates(), table
        self.link = self.proxy = self.launcher = None
        self.cells = NS(roles=["rollout", "rollout"], nodes=["a", "b"], switches=[], settled=lambda cell: True,
                        history=[[(0.0, "rollout")], [(0.0, "rollout")]])
        self.steps = NS(reports=[], steps_done=0, version=0, trainer_version=0, steps_in_burst=0, publications=0,
                        in_flight=lambda: None)
        self.executions, self.should_exit = NS(status_counts={}, active={}, last_reward={}), False
        self.buffer, self.probe, self.gc = NS(ready_count=0), NS(samples=[]), NS(status=lambda: {})

    def snapshot(self) -> dict:
        return snapshot(self.c, metrics=self.metrics, steps=self.steps, cells=self.cells, wl=self.wl,
                        buffer=self.buffer, executions=self.executions, rates=self.rates, probe=self.probe,
                        gc=self.gc, table=self.table, link=self.link, proxy=self.proxy, launcher=self.launcher,
                        stopping=self.should_exit)


async def test_a_call_in_prefill_is_in_flight_awaiting_and_counts_its_prefill_at_its_first_token():
    table = RoutingTable()
    table.set_nodes(["a", "b"])
    link = ScriptedLink(["a", "b"])
    backend = LinkBackend(link, table)
    coord = Run(table)
    a, b = table.routes["a"], table.routes["b"]

    async def call():
        return [c async for c in backend.generate("r", list(range(1851)), GenParams(max_new_tokens=3), "e0")]

    task = asyncio.create_task(call())
    assert await link.sent.get() == "a"
    status = coord.snapshot()  # in prefill: nothing generated, and no engine has said what it reused
    assert (a.inflight, a.awaiting, a.tokens) == (1, 1, 0)
    assert status["calls"] == {"in_flight": 1, "awaiting_first_token": 1}
    assert status["tokens_per_s"]["prefill"] is None and status["cells"][0]["awaiting_first_token"] == 1
    assert "calls 1 in flight: 0 generating, 1 queued or in prefill" in draw(status, 80)

    await link.chunks["a"].put(chunk([5], cached=1800))  # the prefill is over: 51 tokens computed
    await asyncio.sleep(0.01)
    assert (a.awaiting, a.tokens, a.prefilled, a.prefill_reports) == (0, 1, 51, 1)
    assert coord.snapshot()["calls"] == {"in_flight": 1, "awaiting_first_token": 0}
    await link.chunks["a"].put(chunk([6, 7], cached=1800, finished=True, reason="length"))
    assert [c.token_ids for c in await task] == [[5], [6, 7]]
    assert (a.inflight, a.awaiting, a.tokens, a.prefilled) == (0, 0, 3, 51)

    # Handed back before its first token: it leaves a's counts, waits on b, whose engine
    # does not say what it reused (so nothing is added to `prefilled`).
    task = asyncio.create_task(call())
    assert await link.sent.get() == "a"
    await link.chunks["a"].put(chunk([], cached=0, finished=True, reason="abort"))
    assert await link.sent.get() == "b"
    assert (a.inflight, a.awaiting, b.inflight, b.awaiting) == (0, 0, 1, 1)
    await link.chunks["b"].put(chunk([8, 9, 10], finished=True, reason="length"))
    await task
    assert (b.inflight, b.awaiting, b.prefilled, b.prefill_reports, b.tokens) == (0, 0, 0, 0, 3)

    # Sampled by the tick with the routes' counts, prefill has a rate.
    coord.rates.sample(0.0, 0, 0, prefill_tokens=0)
    coord.rates.sample(2.0, 6, 0, prefill_tokens=sum(r.prefilled for r in table.routes.values()))
    assert coord.snapshot()["tokens_per_s"] == {"rollout": 3.0, "training": 0.0, "prefill": 25.5}


def test_the_snapshot_carries_the_running_executions_and_b_and_n():
    import time

    from gyre.coordinator.buffer import Execution
    from gyre.coordinator.tasks import Task
    from gyre.coordinator.waterlevel import Tracked

    table = RoutingTable()
    table.set_nodes(["a", "b"])
    coord = Run(table)
    run = Execution("g00001-00", 1, 0, Task(id="sort-csv", prompt="p"), Tracked(), 0)
    run.t_start = time.time()
    run.enter("sandbox")
    coord.executions.active[run.id] = run
    coord.executions.last_reward["sort-csv"] = 0.75
    status = json.loads(json.dumps(coord.snapshot()))  # JSON-able, as GET /gyre/status serves it
    assert status["groups"] == {"per_step": 2, "size": 8}
    assert status["phases"]["sandbox"] == 1 and status["phases"]["queued"] == 0
    (row,) = status["executions"]
    assert (row["id"], row["task"], row["phase"], row["calls"], row["last_reward"]) == (
        "g00001-00", "sort-csv", "sandbox", 0, 0.75)
    assert row["calls_in_flight"] is None  # no proxy here: not known, not 0
    assert "g00001-00 sort-csv" in draw(status, 80)


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


# --- the live view's console: logs and prints above the view, the cursor back on every exit ----

SHOW, HIDE = "\x1b[?25h", "\x1b[?25l"
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@pytest.fixture
def stderr_logging():
    """Installs (on call, in the test body: pytest swaps sys.stderr between setup and call) a
    root handler on sys.stderr, as `gyre`'s root callback does (logging.basicConfig); the test
    reads what reaches that stream with capsys. Removed at teardown."""
    import logging

    root, added = logging.getLogger(), []

    def install() -> logging.Handler:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(FORMAT))
        root.addHandler(handler)
        added.append(handler)
        return handler

    yield install
    for handler in added:
        root.removeHandler(handler)


def terminal() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=True, width=100, color_system=None), out


def talking_get(calls: list, fail_after: int | None = None, on_talked=None, talk_on: int = 2):
    """A `get()` that, on its `talk_on`th call (the view is up by then, a frame drawn after
    the first), logs and prints a marker."""
    import logging

    async def get() -> dict:
        calls.append(list(logging.getLogger().handlers))
        if len(calls) == talk_on:
            logging.getLogger("gyre.coordinator").warning("marker from the log, shutting down")
            print("step marker 1/3")
            if on_talked is not None:
                on_talked()
        if fail_after is not None and len(calls) > fail_after:
            raise RuntimeError("status failed")
        return STATUS
    return get


def assert_clean_exit(out: str, capsys, before: list, calls: list, handler) -> None:
    import logging

    assert out.count("WARNING gyre.coordinator: marker from the log, shutting down") == 1
    assert out.count("step marker 1/3") == 1
    assert out.index("step marker 1/3") > out.index("marker from the log")  # in the order they came
    captured = capsys.readouterr()
    assert "marker" not in captured.err and "marker" not in captured.out  # not around the view
    after = logging.getLogger().handlers
    assert len(after) == len(before) and all(a is b for a, b in zip(after, before))
    assert all(handler not in during for during in calls)  # stood in for while live
    assert HIDE in out and out.endswith(SHOW) and out.rindex(SHOW) > out.rindex(HIDE)
    assert "step 2/3" in out  # a frame was drawn (and stays: not transient)


async def test_follow_live_prints_logs_and_prints_above_the_view(stderr_logging, capsys):
    import logging

    from gyre.cli.live import follow

    handler = stderr_logging()
    console, out = terminal()
    before, calls = list(logging.getLogger().handlers), []
    await follow(talking_get(calls), interval_s=0, live=True, console=console, until=lambda: len(calls) >= 3)
    text = out.getvalue()
    assert_clean_exit(text, capsys, before, calls, handler)
    # the marker lines are printed above a redrawn view, not drawn over by it
    assert text.rindex("step 2/3") > text.index("step marker 1/3")
    assert sys.stdout is not None and not type(sys.stdout).__name__ == "FileProxy"


async def test_follow_live_restores_all_when_get_raises(stderr_logging, capsys):
    import logging

    from gyre.cli.live import follow

    handler = stderr_logging()
    console, out = terminal()
    before, calls = list(logging.getLogger().handlers), []
    with pytest.raises(RuntimeError, match="status failed"):
        await follow(talking_get(calls, fail_after=2), interval_s=0, live=True, console=console)
    assert len(calls) == 3
    assert_clean_exit(out.getvalue(), capsys, before, calls, handler)


async def test_follow_live_restores_all_when_cancelled(stderr_logging, capsys):
    import logging

    from gyre.cli.live import follow

    handler = stderr_logging()
    console, out = terminal()
    before, calls = list(logging.getLogger().handlers), []
    talked = asyncio.Event()
    task = asyncio.ensure_future(follow(talking_get(calls, on_talked=talked.set, talk_on=1), interval_s=3600, live=True,
                                        console=console))
    await talked.wait()  # the view is up; it draws, then sleeps out its (long) interval
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert_clean_exit(out.getvalue(), capsys, before, calls, handler)


def test_follow_live_restores_all_on_keyboard_interrupt(stderr_logging, capsys):
    import logging

    from gyre.cli.live import follow

    handler = stderr_logging()
    console, out = terminal()
    before, calls = list(logging.getLogger().handlers), []
    inner = talking_get(calls)

    async def get() -> dict:
        status = await inner()
        if len(calls) == 3:
            raise KeyboardInterrupt
        return status

    with pytest.raises(KeyboardInterrupt):
        asyncio.run(follow(get, interval_s=0, live=True, console=console))
    assert_clean_exit(out.getvalue(), capsys, before, calls, handler)


def test_follow_not_live_is_plain_lines(stderr_logging, capsys):
    import logging

    from gyre.cli.live import follow

    handler = stderr_logging()
    console, out = terminal()
    calls = []
    asyncio.run(follow(talking_get(calls), interval_s=0, live=False, console=console,
                       until=lambda: len(calls) >= 2))
    assert out.getvalue().splitlines() == [plain_line(STATUS)] * 2
    captured = capsys.readouterr()  # the log and the print go where they always go
    assert "WARNING gyre.coordinator: marker from the log" in captured.err and "step marker 1/3" in captured.out
    assert HIDE not in out.getvalue()
    assert logging.getLogger().handlers[-1] is handler


async def test_up_view_shows_the_final_state_and_restores(stderr_logging, capsys):
    """`gyre up`'s view: step lines and logs from the run above it, its last frame the run's end."""
    import logging

    from gyre.cli.up import _run_with_view

    class Coord:
        def __init__(self):
            self.drawn = asyncio.Event()
            self.state = copy.deepcopy(STATUS)

        def status(self) -> dict:
            self.drawn.set()
            return self.state

        async def run(self):
            await self.drawn.wait()  # the view is up
            logging.getLogger("gyre.coordinator").warning("signal 2: shutting down (again to force)")
            print("step 3/3  version 3", flush=True)
            self.state = copy.deepcopy(STATUS)
            self.state["steps"]["done"] = 3
            return ["report"]

    stderr_logging()
    console, out = terminal()
    before = list(logging.getLogger().handlers)
    assert await _run_with_view(Coord(), live=True, console=console) == ["report"]
    text = out.getvalue()
    assert text.count("WARNING gyre.coordinator: signal 2: shutting down (again to force)") == 1
    assert text.count("step 3/3  version 3") == 1
    assert "step 3/3" in text[text.rindex("step 3/3  version 3") + 20:]  # the final frame, drawn after
    assert text.endswith(SHOW) and text.rindex(SHOW) > text.rindex(HIDE)
    assert all(a is b for a, b in zip(logging.getLogger().handlers, before))
    assert "signal 2" not in capsys.readouterr().err


async def test_up_view_closes_at_once_when_the_run_fails(stderr_logging):
    from gyre.cli.up import _run_with_view

    class Coord:
        def status(self) -> dict:
            return STATUS

        async def run(self):
            raise RuntimeError("the run failed")

    console, out = terminal()
    with pytest.raises(RuntimeError, match="the run failed"):
        await _run_with_view(Coord(), live=True, console=console)
    assert out.getvalue().endswith(SHOW)
