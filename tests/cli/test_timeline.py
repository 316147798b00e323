"""The role timeline SVG: an axis fitted to the run's length, a legend, publications marked."""

from __future__ import annotations

import json
import math
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from gyre.cli.timeline import result_from_metrics, role_timeline_svg, role_timeline_text, time_axis
from gyre.coordinator.sim import PRESETS, SimResult, simulate

NS = "{http://www.w3.org/2000/svg}"
LEFT, WIDTH = 60, 800  # the plot area of role_timeline_svg


def _write_run(tmp_path: Path) -> Path:
    """A 3-minute real run of 2 cells: cell 0 trains from 40 s to 100 s, publications at 60 s and 150 s."""
    lines = [{"event": "role", "t": 40.0, "cell": 0, "from": "rollout", "to": "training", "seconds": 1.5},
             {"event": "step", "t": 55.0, "step": 1, "seconds": 10.0, "groups": 2, "cells_training": 1,
              "staleness_mean": 0.0},
             {"event": "publish", "t": 60.0, "version": 1, "seconds": 2.0, "bytes": 10},
             {"event": "role", "t": 100.0, "cell": 0, "from": "training", "to": "rollout", "seconds": 0.5},
             {"event": "step", "t": 140.0, "step": 2, "seconds": 10.0, "groups": 2, "cells_training": 1,
              "staleness_mean": 0.0},
             {"event": "publish", "t": 150.0, "version": 2, "seconds": 2.0, "bytes": 10},
             {"event": "step", "t": 180.0, "step": 3, "seconds": 10.0, "groups": 2, "cells_training": 1,
              "staleness_mean": 0.0}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    (tmp_path / "config.json").write_text(json.dumps({"cells": 2, "policy": "elastic", "phi": 0.5, "mu": 1}))
    return path


def _ticks(root: ET.Element) -> list[tuple[float, float, str]]:
    """(x, value, unit) of each axis tick."""
    out = []
    for g in root.iter(f"{NS}g"):
        if g.get("class") == "tick":
            value, unit = g.find(f"{NS}text").text.split()
            out.append((float(g.find(f"{NS}line").get("x1")), float(value), unit))
    return out


def _publications(root: ET.Element) -> list[ET.Element]:
    return [line for line in root.iter(f"{NS}line") if line.get("class") == "publication"]


def _legend_text(root: ET.Element) -> list[str]:
    legend = next(g for g in root.iter(f"{NS}g") if g.get("class") == "legend")
    return [t.text for t in legend.iter(f"{NS}text")]


@pytest.mark.parametrize("hours, unit, step", [(30 / 3600, "s", 5), (3 / 60, "min", 0.5), (0.5, "min", 5),
                                               (5.3, "h", 1), (40.0, "h", 5)])
def test_time_axis_fits_the_run(hours, unit, step):
    a = time_axis(hours)
    assert (a.unit, a.step) == (unit, step)
    assert 4 <= len(a.ticks) <= 10 and a.ticks[0] == 0 and a.ticks[-1] <= hours * a.per_hour + 1e-9
    assert all(v == pytest.approx(i * step) for i, v in enumerate(a.ticks))


def test_a_three_minute_run_has_a_minute_axis_publications_and_a_legend(tmp_path):
    r = result_from_metrics(_write_run(tmp_path))
    assert r.hours == pytest.approx(180 / 3600)
    assert r.publication_hours == [pytest.approx(60 / 3600), pytest.approx(150 / 3600)]
    root = ET.fromstring(role_timeline_svg(r))
    ticks = _ticks(root)
    assert len(ticks) > 1 and {u for _, _, u in ticks} <= {"s", "min"}
    step = ticks[1][1] - ticks[0][1]
    assert step > 0
    for x, v, unit in ticks:
        assert math.isclose(v / step, round(v / step), abs_tol=1e-9)  # at multiples of the step
        seconds = v * (60 if unit == "min" else 1)
        assert x == pytest.approx(LEFT + WIDTH * seconds / 180, abs=0.01)
    pubs = _publications(root)
    assert len(pubs) == 2
    assert [float(p.get("x1")) for p in pubs] == [pytest.approx(LEFT + WIDTH * t / 180, abs=0.01) for t in (60, 150)]
    assert [p.find(f"{NS}title").text for p in pubs] == ["publication v1 at 1 min", "publication v2 at 2.5 min"]
    legend = _legend_text(root)
    assert {"rollout", "training", "switching", "publication"} <= set(legend)
    texts = [t.text for t in root.iter(f"{NS}text")]
    assert "cell 0" in texts and "cell 1" in texts
    fills = {rect.get("fill") for rect in root.iter(f"{NS}rect") if rect.find(f"{NS}title") is not None}
    assert {"#4c8bd6", "#e07b39", "#9a9a9a"} <= fills


def test_a_simulated_multi_hour_run_has_an_hour_axis():
    r = simulate(PRESETS["nl2repo"], policy="elastic", phi=0.5, mu=3, steps=3, seed=0)
    assert r.hours > 2
    root = ET.fromstring(role_timeline_svg(r))
    ticks = _ticks(root)
    assert 4 <= len(ticks) <= 10 and {u for _, _, u in ticks} == {"h"}
    step = ticks[1][1]
    for i, (x, v, _) in enumerate(ticks):
        assert v == pytest.approx(i * step) and x == pytest.approx(LEFT + WIDTH * v / r.hours, abs=0.01)
    assert {"rollout", "training", "switching", "publication"} <= set(_legend_text(root))
    assert not _publications(root)  # its one publication completes after the last update


def test_simulated_publications_are_marked():
    r = simulate(PRESETS["nl2repo"], policy="elastic", phi=0.5, mu=3, steps=7, seed=0)
    assert len(r.publication_hours) == 2  # after steps 3 and 6 (the one after step 7 lies past the end)
    for t, after in zip(r.publication_hours, (r.step_hours[2], r.step_hours[5])):
        assert after < t < after + 0.1
    pubs = _publications(ET.fromstring(role_timeline_svg(r)))
    assert [float(p.get("x1")) for p in pubs] == [pytest.approx(LEFT + WIDTH * t / r.hours, abs=0.01)
                                                  for t in r.publication_hours]
    assert all(re.fullmatch(r"publication at [\d.]+ h", p.find(f"{NS}title").text) for p in pubs)


def test_text_strip_axis_uses_the_fitted_unit(tmp_path):
    text = role_timeline_text(result_from_metrics(_write_run(tmp_path)), width=60)
    rows = [line for line in text.splitlines() if line.startswith("cell")]
    assert len(rows) == 2 and all(re.fullmatch(r"cell  \d \|[RT~]{60}\|", line) for line in rows)
    axis = text.splitlines()[-1]
    assert axis.endswith("3 min|") and "1.5 min" in axis


def test_inserted_text_is_escaped():
    r = SimResult(hours=1.0, steps=1, staleness_mean=0.0, per_cell_training_share=[0.0],
                  role_timeline=[(0.0, 0, "rollout")], switches=0, mean_waterlevel=0.0, policy="a<b&c",
                  publication_hours=[0.5])
    root = ET.fromstring(role_timeline_svg(r))
    assert any(t.text.startswith("a<b&c ") for t in root.iter(f"{NS}text"))
    assert len(_publications(root)) == 1
