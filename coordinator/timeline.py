"""timeline.py: role timelines (per cell: rollout / training / switching over time) for
simulations and real runs, as a text strip for the terminal and a standalone SVG.

Real runs are read from metrics.jsonl `role` events (a switch lasts its measured seconds).
Pure rendering: nothing here runs or schedules anything.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from gyre.coordinator.sim import ROLLOUT, SWITCHING, TRAINING, SimResult

_CHARS = {ROLLOUT: "R", TRAINING: "T", SWITCHING: "~"}
_COLORS = {ROLLOUT: "#4c8bd6", TRAINING: "#e07b39", SWITCHING: "#9a9a9a"}


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


def role_timeline_text(result: SimResult, width: int = 80) -> str:
    """One strip per cell: R rollout, T training, ~ switching (role at each column's middle)."""
    h = result.hours or 1.0
    lines = [f"{result.policy} phi={result.phi} mu={result.mu}: {result.steps} steps in {result.hours:.2f} h "
             f"(R rollout, T training, ~ switching)"]
    for c, row in enumerate(_segments(result)):
        strip = []
        for col in range(width):
            mid = (col + 0.5) * h / width
            role = next((r for s, e, r in row if s <= mid < e), row[-1][2])
            strip.append(_CHARS[role])
        lines.append(f"cell {c:>2} |{''.join(strip)}|")
    axis = f"{0:<{width // 2}}{h / 2:.1f} h"
    lines.append(f"        |{axis:<{width - len(f'{h:.1f} h')}}{h:.1f} h|")
    return "\n".join(lines)


def role_timeline_svg(result: SimResult) -> str:
    """A standalone SVG: one row per cell, colored by role, time axis in hours."""
    left, top, row_h, width = 60, 20, 18, 800
    h = result.hours or 1.0
    rows = _segments(result)
    height = top + row_h * len(rows) + 40

    def x(t: float) -> float:
        return left + width * t / h
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 20}" height="{height}" '
             f'font-family="sans-serif" font-size="11">',
             f'<text x="{left}" y="13">{result.policy} phi={result.phi} mu={result.mu}: {result.steps} steps, '
             f'{result.hours:.2f} h</text>']
    for c, row in enumerate(rows):
        y = top + c * row_h
        parts.append(f'<text x="4" y="{y + 13}">cell {c}</text>')
        for s, e, role in row:
            parts.append(f'<rect x="{x(s):.2f}" y="{y}" width="{max(0.0, x(e) - x(s)):.2f}" height="{row_h - 3}" '
                         f'fill="{_COLORS[role]}"><title>{role} {s:.3f}-{e:.3f} h</title></rect>')
    y_axis = top + row_h * len(rows) + 4
    ticks = max(1, math.ceil(h))
    step = max(1, ticks // 10)
    for i in range(0, ticks + 1, step):
        if i <= h:
            parts.append(f'<line x1="{x(i):.2f}" y1="{y_axis}" x2="{x(i):.2f}" y2="{y_axis + 5}" stroke="black"/>'
                         f'<text x="{x(i):.2f}" y="{y_axis + 17}" text-anchor="middle">{i} h</text>')
    parts.append("</svg>")
    return "\n".join(parts)




def result_from_metrics(path: str | Path) -> SimResult:
    """A real run's role timeline (and headline figures) as a SimResult, so real runs and
    simulations draw the same text strip and SVG. Switches count from their measured time."""
    events = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
    cfg_path = Path(path).with_name("config.json")
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    cells = int(cfg.get("cells", 1 + max((e["cell"] for e in events if e["event"] == "role"), default=0)))
    initial = ["training" if cfg.get("policy") == "async" and c < cfg.get("async_training_cells", 1) else "rollout"
               for c in range(cells)]
    timeline: list[tuple[float, int, str]] = [(0.0, c, r) for c, r in enumerate(initial)]
    for e in events:
        if e["event"] == "role":
            start = max(0.0, e["t"] - e.get("seconds", 0.0)) / 3600
            timeline += [(start, e["cell"], "switching"), (e["t"] / 3600, e["cell"], e["to"])]
    timeline.sort(key=lambda x: x[0])
    steps = [e for e in events if e["event"] == "step"]
    end = max((e["t"] for e in events), default=0.0) / 3600
    staleness = [e["staleness_mean"] for e in steps]
    share = []
    for c in range(cells):
        rows = [(t, r) for t, cell, r in timeline if cell == c] + [(end, "")]
        share.append(sum(b[0] - a[0] for a, b in zip(rows, rows[1:]) if a[1] == "training") / (end or 1))
    return SimResult(hours=end, steps=len(steps), staleness_mean=sum(staleness) / len(staleness) if staleness else 0.0,
                     per_cell_training_share=share, role_timeline=timeline,
                     switches=sum(1 for e in events if e["event"] == "role"), mean_waterlevel=0.0,
                     policy=cfg.get("policy", ""), phi=cfg.get("phi", 0.0), mu=cfg.get("mu", 1),
                     step_hours=[e["t"] / 3600 for e in steps])
