"""live.py: the live terminal view of a run, drawn from a status dict (coordinator/status.py).

`render(status, width)` is a pure function of the data, so `gyre up` (in-process) and `gyre
top` (over HTTP) draw the same thing, and tests render recorded states at any width. It
stays readable at 80 columns: the role strip takes what the fixed columns leave, the
executions panel under the cells lists the slowest running executions (task, phase, time in
it, calls, elapsed, the task's last reward) under their counts by phase, and the legend under
it all packs its entries into as few lines as the width allows. What was not
measured reads n/a, never 0. `plain_line` is the one-line form for logs and non-terminals.
`follow` draws it until told to stop; while the view is up, `print` and the root logger's
terminal output go through the view's console (printed above the view, which is redrawn
below), and every way out of it shows the cursor again and leaves the last frame on screen.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import urllib.error
import urllib.request
from pathlib import Path

from rich.console import Group
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

ROLE_STYLE = {"rollout": ("-", "cyan"), "training": ("#", "magenta")}
SIDE_BY_SIDE = 170  # from this width the executions panel is drawn beside the cells, not under them
PANEL_WIDTH = 86  # its width there (its task column takes what the other columns leave)
FIXED_COLUMNS = 64  # cell, role, running, homes, hit, claimed, in-role and the table's borders
# The view's abbreviations, in the order they appear; an entry is never split across lines.
LEGEND = (
    ("burst", "steps since publishing, of mu per burst"),
    ("phi", "batches queued ahead"),
    ("d p f", "dispatched, launched, finished"),
    ("prefill", "uncached prompt tokens"),
    ("run", "calls in flight"),
    ("homes", "executions routed here"),
    ("hit", "prefix-cache hit rate"),
    ("claim", "micro-steps it claimed in the batch"),
    ("timeline", "- rollout  # training"),
    ("B", "groups per step"),
    ("N", "executions per group"),
    ("harness", "no model call yet"),
    ("model call", "one at the proxy"),
    ("tool", "between calls"),
    ("verifier", "scoring"),
    ("in phase", "time in it"),
    ("reward", "the task's last valid"),
)
EXECUTION_TERMS = ("B", "N", "harness", "model call", "tool", "verifier", "in phase", "reward")
PHASE_STYLE = {"model call": "cyan", "tool": "green", "harness": "yellow", "verifier": "magenta",
               "image": "blue", "sandbox": "blue", "cleanup": "dim", "queued": "dim"}


def _num(v, fmt: str = "{:.3f}", none: str = "n/a") -> str:
    return none if v is None else fmt.format(v)


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600:d}:{s % 3600 // 60:02d}:{s % 60:02d}"


def strip(timeline: list, now: float, width: int) -> Text:
    """A cell's roles over [0, now] as `width` characters (- rollout, # training)."""
    out = Text()
    if width <= 0:
        return out
    if now <= 0 or not timeline:
        char, style = ROLE_STYLE.get(timeline[-1][1] if timeline else "", ("?", "dim"))
        return Text(char * width, style=style)
    j = 0
    for k in range(width):
        t = (k + 0.5) * now / width
        while j + 1 < len(timeline) and timeline[j + 1][0] <= t:
            j += 1
        char, style = ROLE_STYLE.get(timeline[j][1], ("?", "dim"))
        out.append(char, style=style)
    return out


def legend(width: int, skip: tuple[str, ...] = ()) -> Text:
    """LEGEND (less the keys in `skip`: not shown) as dim lines of at most `width`
    characters, each entry whole."""
    out, used = Text(style="dim"), 0
    for key, meaning in LEGEND:
        if key in skip:
            continue
        n = len(key) + 2 + len(meaning)
        if used and used + 2 + n > width:
            out.append("\n")
            used = 0
        elif used:
            out.append("  ")
            used += 2
        out.append(key, style="bold")
        out.append(f": {meaning}")
        used += n
    return out


def _speed(s: dict) -> Text:
    """Tokens/s over the coordinator's window: generated, prefilled and trained."""
    tps, window = s["tokens_per_s"], s.get("rates_window_s")
    label = "tokens/s " if window is None else f"tokens/s (last {window:.0f}s) "
    return Text.assemble((label, "dim"), "rollout ", _num(tps["rollout"], "{:.0f}"),
                         "  prefill ", _num(tps.get("prefill"), "{:.0f}"),
                         "  training ", _num(tps["training"], "{:.0f}"))


def _in_flight(s: dict) -> int:
    """Model calls at the engines now (a status from before "calls": its cells' sum)."""
    return s["calls"]["in_flight"] if s.get("calls") else sum(c["running"] for c in s["cells"])


def _calls(s: dict) -> Text:
    """Model calls at the engines now: why generated tokens/s may truly be 0 (where the
    running executions are instead: the executions panel's counts by phase)."""
    calls, running, in_flight = s.get("calls"), s["waterlevel"]["running"], _in_flight(s)
    out = Text.assemble(("calls ", "dim"), f"{in_flight} in flight")
    if calls is not None and in_flight:
        waiting = calls["awaiting_first_token"]
        out.append(f": {in_flight - waiting} generating, {waiting} queued or in prefill")
    elif not in_flight and running:
        # With no cell accepting, calls wait in the proxy for one to come back to rollout.
        accepting = any(c.get("accepting", True) and c["role"] == "rollout" for c in s["cells"])
        if not accepting:
            out.append(f" (no cell takes calls now; {running} executions running)", style="dim")
        elif s.get("phases") is None:  # a coordinator from before phases: where they are is unknown
            out.append(f" ({running} executions running, between calls)", style="dim")
    return out


def _dur(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    s = int(seconds)
    return f"{s}s" if s < 60 else f"{s // 60}m{s % 60:02d}s" if s < 3600 else f"{s // 3600}h{s % 3600 // 60:02d}m"


def phase_counts(phases: dict) -> str:
    """The phases some execution is in, with their counts: `3 model call  10 tool`."""
    return "  ".join(f"{n} {phase}" for phase, n in phases.items() if n and phase != "queued") or "none running"


def executions_panel(s: dict, width: int) -> Group:
    """The running executions' counts by phase, then the slowest of them (longest elapsed first)."""
    phases, groups = s["phases"], s.get("groups") or {}
    running = sum(n for phase, n in phases.items() if phase != "queued")
    head = Text.assemble(("executions ", "dim"), f"{running} running  ", ("queued ", "dim"),
                         f"{phases.get('queued', 0)}  ", ("B ", "dim"), f"{groups.get('per_step', 'n/a')}  ",
                         ("N ", "dim"), f"{groups.get('size', 'n/a')}")
    now = Text.assemble(("phases ", "dim"), phase_counts(phases))
    table = Table(box=None, pad_edge=False, expand=False, header_style="dim", padding=(0, 1, 0, 0))
    for name, justify in (("execution", "left"), ("task", "left"), ("phase", "left"), ("in phase", "right"),
                          ("calls", "right"), ("elapsed", "right"), ("reward", "right")):
        table.add_column(name, justify=justify, no_wrap=True, overflow="ellipsis",
                         max_width=max(8, width - 58) if name == "task" else None)
    for r in s["executions"]:
        name = Text.assemble(r["id"], ("*", "cyan") if r.get("adopted") else "")
        table.add_row(name, r["task"], Text(r["phase"], style=PHASE_STYLE.get(r["phase"], "")),
                      _dur(r["phase_s"]), _num(r["calls"], "{:d}"), _dur(r["elapsed_s"]), _num(r["last_reward"]))
    more = running - len(s["executions"])
    rows = [head, now, table] if s["executions"] else [head, now]
    if any(r.get("adopted") for r in s["executions"]):
        rows.append(Text("* adopted: its harness ran on through the coordinator's restart", style="dim"))
    return Group(*rows, *([Text(f"... and {more} more running (in the phases above)", style="dim")]
                          if more > 0 else []))


def restart_line(r: dict) -> Text:
    """A resumed session's restart: its downtime and what it took back."""
    down = "unknown" if r.get("down_s") is None else _dur(r["down_s"])
    return Text.assemble(("resumed ", "dim"), f"at step {r['step']}  ", ("down ", "dim"), f"{down}  ",
                         ("adopted ", "dim"), f"{r['adopted']} running  ", ("restored ", "dim"),
                         f"{r['restored']} closed  ", ("run again ", "dim"), f"{r['redispatched']}")


def render(status: dict, width: int = 80) -> Group:
    s = status
    steps, wl, burst = s["steps"], s["waterlevel"], s["burst"]
    phi = () if burst.get("phi") is None else (("phi ", "dim"), f"{burst['phi']:g}  ")
    head = Text.assemble(
        ("gyre ", "bold"), f"{s['policy']}  ", ("step ", "dim"), f"{steps['done']}/{steps['target']}  ",
        ("version ", "dim"), f"{s['version']}  ", ("burst ", "dim"), f"{burst['steps']}/{burst['mu']}  ", *phi,
        ("pubs ", "dim"), f"{burst['publications']}  ", ("up ", "dim"), _clock(s["t"]))
    bar = ProgressBar(total=max(1, steps["target"]), completed=steps["done"], width=max(10, width - 12))
    progress = Table.grid(padding=(0, 1))
    progress.add_row(bar, Text(f"{steps['done']}/{steps['target']}"))
    water = Text.assemble(("waterlevel ", "dim"), f"queued {wl['queued']}  running {wl['running']}  "
                          f"finished {wl['finished']}  ", ("(d ", "dim"), f"{wl['d']} ", ("p ", "dim"),
                          f"{wl['p']} ", ("f ", "dim"), f"{wl['f']}", (")  ", "dim"),
                          ("ready ", "dim"), f"{s['ready_groups']}")
    last = s["last_step"] or {}
    quality = Text.assemble(
        ("reward ", "dim"), _num(last.get("reward_mean")), ("  valid ", "dim"),
        _num(last.get("reward_valid_frac"), "{:.2f}"), ("  staleness ", "dim"),
        _num(last.get("staleness_mean"), "{:.2f}"), ("  loss ", "dim"), _num(last.get("loss"), "{:.4g}"),
        ("  tokens trained ", "dim"), _num(last.get("tokens_trained"), "{:d}"))
    if last.get("note"):  # why the last step trained little or nothing (coordinator/diagnosis.py)
        quality.append(f"\n{last['note']}", style="yellow" if last.get("trained", True) else "bold yellow")
    cells = Table(box=None, pad_edge=False, expand=False, header_style="dim")
    for name, justify in (("cell", "right"), ("role", "left"), ("run", "right"), ("homes", "right"),
                          ("hit", "right"), ("claim", "right"), ("in role", "right"), ("timeline", "left")):
        cells.add_column(name, justify=justify, no_wrap=True)
    beside = s.get("phases") is not None and width >= SIDE_BY_SIDE
    cells_width = width - PANEL_WIDTH - 2 if beside else width
    strip_width = max(8, cells_width - FIXED_COLUMNS)
    for cell in s["cells"]:
        dead = cell.get("alive") is False and s.get("state") == "running"  # not the shutdown's deregistration
        label = f"-> {cell['role']}" if cell.get("switching") else cell["role"]
        role = Text("dead", style="bold red") if dead else Text(label, style=ROLE_STYLE.get(
            cell["role"], ("", ""))[1])
        hit = cell.get("hit_rate")  # the engine's prefix-cache hit rate over its calls so far
        cells.add_row(str(cell["cell"]), role, str(cell["running"]), str(cell.get("homes", 0)),
                      "n/a" if hit is None else f"{hit:.0%}", str(cell["claimed"]),
                      f"{cell['in_role_s']:.0f}s", strip(cell["timeline"], s["t"], strip_width))
    hosts = None
    if s.get("sandbox_hosts"):
        hosts = Table(box=None, pad_edge=False, expand=False, header_style="dim")
        for name, justify in (("sandbox host", "left"), ("state", "left"), ("running", "right"),
                              ("building", "right"), ("failed", "right"), ("cap", "right")):
            hosts.add_column(name, justify=justify, no_wrap=True)
        for h in s["sandbox_hosts"]:
            state = Text(h["state"], style="bold red" if h["state"] == "down" else "green")
            hosts.add_row(h["host"], state, str(h["running"]), str(h["building"]), str(h["failed"]),
                          "-" if h["max_concurrent"] is None else str(h["max_concurrent"]))
    switches = Text("switches ", style="dim")
    recent = s["role_switches"][-3:]
    switches.append("  ".join(f"{x['t']:.0f}s c{x['cell']}->{x['to']}" for x in recent) if recent else "none yet")
    panel = [executions_panel(s, PANEL_WIDTH if beside else width)] if s.get("phases") is not None else []
    if beside:  # a wide terminal: the agents beside the cells they run on
        grid = Table.grid(padding=(0, 2, 0, 0))
        grid.add_column(width=cells_width, no_wrap=True)
        grid.add_column(width=PANEL_WIDTH)
        grid.add_row(cells, panel.pop())
        cells = grid
    parts = [head, progress, water, quality, _speed(s), _calls(s), cells] + ([hosts] if hosts is not None else [])
    if s.get("restart"):  # this session resumed a run whose coordinator stopped
        parts.insert(3, restart_line(s["restart"]))
    skip = (() if phi else ("phi",)) + (() if s.get("phases") is not None else EXECUTION_TERMS)
    return Group(*parts, *panel, switches, legend(width, skip=skip))


def plain_line(status: dict) -> str:
    """The state as one log line (for --no-live and non-terminals). Cells: R rollout,
    T training, x dead; `running` counts executions, `calls in flight` model calls, and
    `executions now` how many are in each phase (model call, tool, verifier, ...)."""
    s, wl, tps = status, status["waterlevel"], status["tokens_per_s"]
    last = s["last_step"] or {}
    roles = "".join("x" if c.get("alive") is False else "T" if c["role"] == "training" else "R" for c in s["cells"])
    return (f"t={s['t']:.0f}s step {s['steps']['done']}/{s['steps']['target']} version {s['version']} "
            f"queued {wl['queued']} running {wl['running']} finished {wl['finished']} cells {roles} "
            f"reward {_num(last.get('reward_mean'))} staleness {_num(last.get('staleness_mean'), '{:.2f}')} "
            f"calls in flight {_in_flight(s)} tokens/s generated {_num(tps['rollout'], '{:.0f}')} "
            f"prefilled {_num(tps.get('prefill'), '{:.0f}')}"
            + ("" if s.get("phases") is None else f" executions now {phase_counts(s['phases']).replace('  ', ', ')}"))


# --- gyre top -----------------------------------------------------------------------------


def status_url(target: str) -> str:
    """A run directory (its coordinator.json names the URL) or a URL (http://HOST:PORT)."""
    if target.startswith(("http://", "https://")):
        return target.rstrip("/") + ("" if target.rstrip("/").endswith("/gyre/status") else "/gyre/status")
    info = Path(target) / "coordinator.json"
    if not info.exists():
        raise FileNotFoundError(f"{info} does not exist: is a coordinator running with this run directory?")
    return json.loads(info.read_text())["status_url"]


def fetch(url: str, timeout: float = 5.0) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - a URL the user gave
            return json.loads(r.read())
    except (urllib.error.URLError, OSError) as e:
        if isinstance(e, urllib.error.HTTPError):
            e.close()  # its response's socket, now, not whenever the collector finds it
        raise ConnectionError(f"no coordinator answering at {url}: {e}") from None


class _ConsoleLogHandler(logging.Handler):
    """Stands in for a root StreamHandler while the live view is up: the same level, filters
    and format, the line printed through the view's console (as is: no markup, no highlighting,
    no wrapping) so that it lands above the view instead of across it."""

    def __init__(self, console, replaces: logging.Handler) -> None:
        super().__init__(replaces.level)
        self.console = console
        self.replaces = replaces
        self.setFormatter(replaces.formatter)
        self.filters = list(replaces.filters)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.console.print(Text(self.format(record)), soft_wrap=True, highlight=False)
        except RecursionError:
            raise
        except Exception:
            self.handleError(record)


def _fileno(stream) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):  # io.StringIO, closed, detached
        return None


def _terminal_streams(console) -> tuple[list, set[int]]:
    """The stream objects a handler may hold to write where the view draws, and their fds."""
    streams = [getattr(s, "rich_proxied_file", s)
               for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__, console.file) if s is not None]
    fds = {fd for fd in map(_fileno, streams) if fd is not None} | {1, 2}
    return streams, fds


@contextlib.contextmanager
def _logs_through(console):
    """Route the root logger's StreamHandlers on stdout/stderr (or the console's own file)
    through `console` for the duration; put the very same handlers back afterwards."""
    root = logging.getLogger()
    streams, fds = _terminal_streams(console)
    swapped: list[tuple[logging.Handler, logging.Handler]] = []
    for i, h in enumerate(list(root.handlers)):
        if not isinstance(h, logging.StreamHandler) or isinstance(h, logging.FileHandler):
            continue
        stream = getattr(h.stream, "rich_proxied_file", h.stream)
        if any(stream is t for t in streams) or _fileno(stream) in fds:
            stand_in = _ConsoleLogHandler(console, h)
            root.handlers[i] = stand_in  # in place: a record logged meanwhile goes to one or the other
            swapped.append((h, stand_in))
    try:
        yield
    finally:
        for original, stand_in in swapped:
            for i, h in enumerate(root.handlers):
                if h is stand_in:
                    root.handlers[i] = original
                    break


def _flush_redirected() -> None:
    """A partial line `print`ed into the Live's stdout/stderr proxy, out before the proxy goes."""
    from rich.file_proxy import FileProxy

    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, FileProxy):
            with contextlib.suppress(Exception):
                stream.flush()


async def follow(get, *, interval_s: float, live: bool, console, until=None) -> None:
    """Redraw (live) or print one plain line per interval from `get()` until `until()`.

    Live: each round draws `get()` and then checks `until()`, so the state that ends it is the
    frame left on screen. Whatever way it ends (until, an exception from `get`, cancellation,
    KeyboardInterrupt) the Live context exits: the last frame stays, the cursor is shown again,
    sys.stdout/sys.stderr and the root logger's handlers are put back."""
    from rich.live import Live

    if not live:
        while until is None or not until():
            console.print(plain_line(await get()), highlight=False, soft_wrap=True)
            await asyncio.sleep(interval_s)
        return
    with _logs_through(console), Live(console=console, auto_refresh=False, transient=False,
                                      redirect_stdout=True, redirect_stderr=True) as view:
        try:
            while True:
                view.update(render(await get(), console.width), refresh=True)
                if until is not None and until():
                    break
                await asyncio.sleep(interval_s)
        finally:
            _flush_redirected()
