"""timeline.py: role timelines (per cell: rollout / training / switching over time) for
simulations and real runs, as a text strip for the terminal and a standalone SVG.

The time axis fits the run: seconds, minutes or hours by its length, ticks at "nice" steps
(1, 2 or 5 x 10^k of that unit). The SVG also marks publications (weight pushes at the end
of a burst) and carries a legend. Real runs are read from metrics.jsonl `role` events (a
switch lasts its measured seconds) and `publish` events.
Pure rendering: nothing here runs or schedules anything.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple
from xml.sax.saxutils import escape

from gyre.coordinator.metrics import counted_steps, read_events
from gyre.coordinator.policies import POLICIES
from gyre.coordinator.sim import ROLLOUT, SWITCHING, TRAINING, SimResult

_CHARS = {ROLLOUT: "R", TRAINING: "T", SWITCHING: "~"}
_COLORS = {ROLLOUT: "#4c8bd6", TRAINING: "#e07b39", SWITCHING: "#9a9a9a"}
_PUBLICATION_COLOR = "#7b2cbf"
_MAX_TICKS = 10


@dataclass
class RunResult(SimResult):
    """A real run's SimResult, with the version each publication pushed (None: not logged)."""
    publication_versions: list[int | None] = field(default_factory=list)


class Axis(NamedTuple):
    """A time axis: its unit, units per hour, tick step (in the unit) and tick values."""
    unit: str
    per_hour: float
    step: float
    ticks: list[float]
    decimals: int  # of the step, for labels

    def label(self, hours: float, extra: int = 0) -> str:
        """`hours` in the axis unit, e.g. `1.5 h`, `30 s` (`extra` more decimals than a tick)."""
        return f"{_num(hours * self.per_hour, self.decimals + extra)} {self.unit}"


def _num(v: float, decimals: int) -> str:
    """v with at most `decimals` decimals, trailing zeros dropped: 2, 1.5, 0.25."""
    s = f"{v:.{decimals}f}"
    s = s.rstrip("0").rstrip(".") if "." in s else s
    return "0" if s == "-0" else s


def time_axis(hours: float) -> Axis:
    """Unit by the run's length (s below 2 min, min below 2 h, else h); the smallest nice step
    giving at most 10 ticks from 0 (so at least 4); ticks at exact multiples of the step."""
    secs = hours * 3600
    unit, per_hour = ("s", 3600.0) if secs < 120 else ("min", 60.0) if secs < 7200 else ("h", 1.0)
    span = hours * per_hour
    k = math.floor(math.log10(span / (_MAX_TICKS - 1)))
    m = next(m for m in (1, 2, 5, 10) if span / (m * 10.0 ** k) <= _MAX_TICKS - 1 + 1e-9)
    m, k = (1, k + 1) if m == 10 else (m, k)

    def tick(i: int) -> float:  # i * m * 10^k; dividing by 10^-k keeps 0.3 exact where 3 * 0.1 is not
        return float(i * m * 10 ** k) if k >= 0 else i * m / 10 ** -k
    n = math.floor(span / tick(1) + 1e-9)
    return Axis(unit, per_hour, tick(1), [tick(i) for i in range(n + 1)], max(0, -k))


def _hours(result: SimResult) -> float:
    """The span drawn: the run's length (a minute for an empty run)."""
    return result.hours if result.hours > 0 else 1 / 60


def _segments(result: SimResult) -> list[list[tuple[float, float, str]]]:
    """Per cell: (start, end, role) intervals covering [0, hours]."""
    changes: list[list[tuple[float, str]]] = [[] for _ in range(result.cells)]
    for t, c, role in result.role_timeline:  # chronological per cell
        changes[c].append((t, role))
    rows = []
    for ch in changes:
        ends = [t for t, _ in ch[1:]] + [result.hours]
        rows.append([(t, e, r) for (t, r), e in zip(ch, ends) if e > t] or [(0.0, result.hours, ch[-1][1])])
    return rows


def _header(result: SimResult, axis: Axis) -> str:
    return f"{result.policy} phi={result.phi} mu={result.mu}: {result.steps} steps in {axis.label(result.hours, 2)}"


def role_timeline_text(result: SimResult, width: int = 80) -> str:
    """One strip per cell: R rollout, T training, ~ switching (role at each column's middle)."""
    h = _hours(result)
    axis = time_axis(h)
    lines = [f"{_header(result, axis)} (R rollout, T training, ~ switching)"]
    for c, row in enumerate(_segments(result)):
        strip = []
        for col in range(width):
            mid = (col + 0.5) * h / width
            role = next((r for s, e, r in row if s <= mid < e), row[-1][2])
            strip.append(_CHARS[role])
        lines.append(f"cell {c:>2} |{''.join(strip)}|")
    left, end = f"{0:<{width // 2}}{axis.label(h / 2, 1)}", axis.label(h, 1)
    lines.append(f"        |{left:<{width - len(end)}}{end}|")
    return "\n".join(lines)


def _publications(result: SimResult, axis: Axis) -> list[tuple[float, str]]:
    """(hours, tooltip) of each publication within the drawn span."""
    versions = result.publication_versions if isinstance(result, RunResult) else []
    out = []
    for i, t in enumerate(result.publication_hours):
        v = versions[i] if i < len(versions) else None
        if 0 <= t <= _hours(result):
            out.append((t, f"publication{'' if v is None else f' v{v}'} at {axis.label(t, 1)}"))
    return out


def _legend(x0: float, y: float) -> list[str]:
    """Swatches for the three roles and the publication line, in one row from (x0, y)."""
    parts, x = ['<g class="legend">'], x0
    for role, color in _COLORS.items():
        parts.append(f'<rect x="{x:.2f}" y="{y - 9}" width="14" height="10" fill="{color}"/>'
                     f'<text x="{x + 18:.2f}" y="{y}">{escape(role)}</text>')
        x += 30 + 7 * len(role)
    parts.append(f'<line x1="{x + 7:.2f}" y1="{y - 10}" x2="{x + 7:.2f}" y2="{y + 1}" '
                 f'stroke="{_PUBLICATION_COLOR}" stroke-width="2"/><text x="{x + 18:.2f}" y="{y}">publication</text>')
    parts.append("</g>")
    return parts


def _axis_svg(axis: Axis, x, left: float, width: float, y: float) -> list[str]:
    """The time axis at height `y`: its line and labelled ticks (`x`: hours to the x pixel)."""
    parts = [f'<line x1="{left}" y1="{y}" x2="{left + width}" y2="{y}" stroke="black"/>']
    for v in axis.ticks:
        xt = x(v / axis.per_hour)
        parts.append(f'<g class="tick"><line x1="{xt:.2f}" y1="{y}" x2="{xt:.2f}" y2="{y + 5}" '
                     f'stroke="black"/><text x="{xt:.2f}" y="{y + 17}" text-anchor="middle">'
                     f'{escape(axis.label(v / axis.per_hour))}</text></g>')
    return parts


def role_timeline_svg(result: SimResult) -> str:
    """A standalone SVG: one row per cell colored by role, publications as vertical lines,
    a time axis fitted to the run's length and a legend."""
    left, top, row_h, width = 60, 20, 18, 800
    h = _hours(result)
    axis = time_axis(h)
    rows = _segments(result)
    y_axis = top + row_h * len(rows) + 4
    height = y_axis + 50

    def x(t: float) -> float:
        return left + width * t / h
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 20}" height="{height}" '
             f'font-family="sans-serif" font-size="11">',
             f'<text x="{left}" y="13">{escape(_header(result, axis))}</text>']
    for c, row in enumerate(rows):
        y = top + c * row_h
        parts.append(f'<text x="4" y="{y + 13}">cell {c}</text>')
        for s, e, role in row:
            parts.append(f'<rect x="{x(s):.2f}" y="{y}" width="{max(0.0, x(e) - x(s)):.2f}" height="{row_h - 3}" '
                         f'fill="{_COLORS[role]}"><title>{escape(role)} {_num(s * axis.per_hour, axis.decimals + 2)}-'
                         f'{escape(axis.label(e, 2))}</title></rect>')
    for t, tip in _publications(result, axis):
        parts.append(f'<line class="publication" x1="{x(t):.2f}" y1="{top - 2}" x2="{x(t):.2f}" y2="{y_axis - 4}" '
                     f'stroke="{_PUBLICATION_COLOR}" stroke-width="1.5"><title>{escape(tip)}</title></line>')
    parts += _axis_svg(axis, x, left, width, y_axis)
    parts += _legend(left, y_axis + 40)
    parts.append("</svg>")
    return "\n".join(parts)


def result_from_metrics(path: str | Path) -> RunResult:
    """A real run's role timeline (and headline figures) as a SimResult, so real runs and
    simulations draw the same text strip and SVG. Switches count from their measured time."""
    events = read_events(path, warn=True).events  # a torn line (a crash's, or a full disk's) skipped
    cfg_path = Path(path).with_name("config.json")
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    cells = int(cfg.get("cells", 1 + max((e["cell"] for e in events if e["event"] == "role"), default=0)))
    spec = POLICIES.get(cfg.get("policy", "elastic"), POLICIES["elastic"])
    initial = list(spec.initial_roles(cells, cfg.get("async_training_cells", 1)))
    timeline: list[tuple[float, int, str]] = [(0.0, c, r) for c, r in enumerate(initial)]
    for e in events:
        if e["event"] == "role":
            start = max(0.0, e["t"] - e.get("seconds", 0.0)) / 3600
            timeline += [(start, e["cell"], "switching"), (e["t"] / 3600, e["cell"], e["to"])]
    timeline.sort(key=lambda x: x[0])
    steps = counted_steps(events)  # a resume's retrained steps once, not twice
    end = max((e["t"] for e in events), default=0.0) / 3600
    staleness = [e["staleness_mean"] for e in steps]
    share = []
    for c in range(cells):
        rows = [(t, r) for t, cell, r in timeline if cell == c] + [(end, "")]
        share.append(sum(b[0] - a[0] for a, b in zip(rows, rows[1:]) if a[1] == "training") / (end or 1))
    publishes = [e for e in events if e["event"] == "publish"]
    return RunResult(hours=end, steps=len(steps), staleness_mean=sum(staleness) / len(staleness) if staleness else 0.0,
                     per_cell_training_share=share, role_timeline=timeline,
                     switches=sum(1 for e in events if e["event"] == "role"), mean_waterlevel=0.0,
                     policy=cfg.get("policy", ""), phi=cfg.get("phi", 0.0), mu=cfg.get("mu", 1),
                     step_hours=[e["t"] / 3600 for e in steps],
                     publication_hours=[e["t"] / 3600 for e in publishes],
                     publication_versions=[e.get("version") for e in publishes])


def compare_runs_svg(runs: list[tuple[str, SimResult, float]]) -> str:
    """Several runs (label, timeline, seconds per step) in one SVG: their role timelines stacked
    on one time axis (the longest run's), then a bar per run of its seconds per step."""
    left, top, row_h, gap, width = 150, 20, 10, 12, 760
    h = max(_hours(r) for _, r, _ in runs)
    axis = time_axis(h)

    def x(t: float) -> float:
        return left + width * t / h
    parts, y = [], top
    for label, result, _ in runs:
        parts.append(f'<text x="4" y="{y + 9}">{escape(label)}</text>')
        for c, row in enumerate(_segments(result)):
            for s, e, role in row:
                parts.append(f'<rect x="{x(s):.2f}" y="{y + c * row_h}" width="{max(0.0, x(e) - x(s)):.2f}" '
                             f'height="{row_h - 2}" fill="{_COLORS[role]}"><title>{escape(label)} cell {c}: '
                             f'{escape(role)}</title></rect>')
        y += row_h * result.cells + gap
    y_axis = y
    parts += _axis_svg(axis, x, left, width, y_axis)
    parts += _legend(left, y_axis + 36)
    y = y_axis + 60
    top_s = max(s for _, _, s in runs) or 1.0
    parts.append(f'<text x="4" y="{y}">seconds per step, each run</text>')
    for label, _, s in runs:
        y += 16
        parts.append(f'<text x="4" y="{y + 9}">{escape(label)}</text>'
                     f'<rect x="{left}" y="{y}" width="{width * s / top_s:.2f}" height="11" fill="#5a5a5a"/>'
                     f'<text x="{left + width * s / top_s + 4:.2f}" y="{y + 9}">{s:.2f} s</text>')
    by_policy: dict[str, list[float]] = {}
    for _, result, s in runs:
        by_policy.setdefault(result.policy, []).append(s)
    y += 30
    parts.append(f'<text x="4" y="{y}">seconds per step, each policy: the mean, and the runs\' spread</text>')
    for policy, xs in by_policy.items():
        y += 16
        mean, lo, hi = sum(xs) / len(xs), min(xs), max(xs)
        parts.append(f'<g class="policy"><text x="4" y="{y + 9}">{escape(policy)} ({len(xs)})</text>'
                     f'<rect x="{left}" y="{y}" width="{width * mean / top_s:.2f}" height="11" fill="#4c8bd6"/>'
                     f'<line class="spread" x1="{left + width * lo / top_s:.2f}" y1="{y + 5.5}" '
                     f'x2="{left + width * hi / top_s:.2f}" y2="{y + 5.5}" stroke="black" stroke-width="2"/>'
                     f'<text x="{left + width * hi / top_s + 4:.2f}" y="{y + 9}">{mean:.2f} s ({lo:.2f}-{hi:.2f})'
                     f'</text></g>')
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 60}" height="{y + 24}" '
            f'font-family="sans-serif" font-size="10">')
    return "\n".join([head, *parts, "</svg>"])
