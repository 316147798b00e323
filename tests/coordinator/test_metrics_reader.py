"""coordinator/metrics.py's read_events, the one reader of metrics.jsonl: what Metrics writes
reads back equal; a torn last line, a bad line mid-file, blank lines, an empty or missing
file; the cheap tail `gyre top` and resume's state read."""

from __future__ import annotations

import logging

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre.coordinator.metrics import Metrics, read_events

EVENT = st.fixed_dictionaries(
    {"event": st.sampled_from(["dispatch", "execution", "step", "role", "publish", "summary"])},
    optional={"group": st.integers(0, 10**6), "id": st.text(max_size=12), "ok": st.booleans(),
              "reward": st.floats(allow_nan=False, allow_infinity=False),
              "runs": st.lists(st.text(max_size=6), max_size=4), "note": st.text(max_size=40)})
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def written(tmp_path, events: list[dict]):
    m = Metrics(tmp_path / "metrics.jsonl", t0=0.0)
    got = [m.emit(e["event"], **{k: v for k, v in e.items() if k != "event"}) for e in events]
    m.close()
    return m.path, got


@SETTINGS
@given(events=st.lists(EVENT, max_size=20))
def test_what_metrics_writes_reads_back_equal(tmp_path_factory, events):
    path, got = written(tmp_path_factory.mktemp("m"), events)
    j = read_events(path)
    assert j.events == got and j.bad == () and j.lines == len(events) and not j.torn_last


@SETTINGS
@given(events=st.lists(EVENT, min_size=1, max_size=12), data=st.data())
def test_a_torn_last_line_loses_only_that_event(tmp_path_factory, events, data):
    path, got = written(tmp_path_factory.mktemp("m"), events)
    raw = path.read_bytes()
    last = raw[:-1].rfind(b"\n") + 1  # where the last line starts
    # A crash mid-write: the last line cut before its newline. Drawn independently of the file's
    # length, which varies with Metrics' clock, so hypothesis replays the same draws.
    cut = last + 1 + data.draw(st.integers(0, 10**4), label="cut") % (len(raw) - 2 - last)
    path.write_bytes(raw[:cut])
    j = read_events(path)
    assert j.events == got[:-1] and j.bad == (len(events),) and j.torn_last and j.mid == ()
    assert read_events(path, tail=len(raw)).events == got[:-1]


@SETTINGS
@given(events=st.lists(EVENT, min_size=1, max_size=12), data=st.data())
def test_the_tail_holds_the_whole_lines_in_its_bytes(tmp_path_factory, events, data):
    """A line the window starts inside is dropped (not counted bad); one it starts at is kept."""
    path, got = written(tmp_path_factory.mktemp("m"), events)
    raw = path.read_bytes()
    tail = data.draw(st.integers(0, 10**4), label="tail") % (len(raw) + 6)  # as cut above
    starts = [0] + [i + 1 for i, b in enumerate(raw[:-1]) if b == ord("\n")]
    whole = [e for s, e in zip(starts, got) if s >= len(raw) - tail]
    j = read_events(path, tail=tail)
    assert j.events == whole and j.bad == () and j.lines == len(whole)


def test_a_bad_line_mid_file_and_blank_lines(tmp_path, caplog):
    """What an older gyre's resume left (a torn line, then a newline and more events), blank
    lines and a line that is JSON but no object: each bad line named by its number; blank
    lines skipped, counted as lines; with warn, one warning per skipped line."""
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"event": "dispatch", "t": 0.1}\n\n{"event": "execution", "sta\n[1, 2]\n'
                     b'{"event": "resume", "t": 7.0}\n  \n{"event": "step", "t": 9.0, "step": 1}\n')
    j = read_events(path)
    assert [e["event"] for e in j.events] == ["dispatch", "resume", "step"]
    assert j.bad == (3, 4) and j.mid == (3, 4) and not j.torn_last and j.lines == 7
    assert not caplog.records  # quiet unless asked
    with caplog.at_level(logging.WARNING):
        read_events(path, warn=True)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "line 3" in said[0] and "torn mid-file" in said[0]
    assert "line 4" in said[1] and "not an event object" in said[1]
    path.write_bytes(path.read_bytes() + b'{"event": "step", "t": 10.0, "st\n\n')  # torn last, a blank after it
    j = read_events(path)
    assert j.bad == (3, 4, 8) and j.torn_last and j.mid == (3, 4) and j.lines == 9


def test_an_empty_or_missing_file_has_no_events(tmp_path):
    path = tmp_path / "metrics.jsonl"
    for j in (read_events(path), read_events(path, tail=10)):
        assert j.events == [] and j.bad == () and j.lines == 0 and not j.torn_last
    path.write_bytes(b"")
    assert read_events(path) == read_events(path, tail=0) == read_events(tmp_path / "none")
    path.write_bytes(b"\n\n")
    j = read_events(path)
    assert j.events == [] and j.bad == () and j.lines == 2


def test_the_tail_reads_only_its_bytes(tmp_path):
    """A window inside one long line holds no line at all; the lines after it are numbered from 1."""
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(orjson.dumps({"event": "step", "pad": "x" * 1000}) + b"\n" + b'{"event": "summary"}\n')
    assert read_events(path, tail=100).events == [{"event": "summary"}]
    path.write_bytes(path.read_bytes() + b'{"event": "st')
    j = read_events(path, tail=40)
    assert j.events == [{"event": "summary"}] and j.bad == (2,) and j.torn_last
    assert read_events(path, tail=10).events == [] and read_events(path, tail=10).bad == ()
