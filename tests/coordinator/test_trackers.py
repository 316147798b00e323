"""Experiment trackers: a real run's metrics.jsonl events (trimmed from `gyre up --steps 2`, plus
one eval event in the shape coordinator/heldout.py gives) go through `Trackers`, and what TensorBoard's
event files and W&B's offline run file hold is read back and compared value by value."""

from __future__ import annotations

import json
import logging
import os
import struct
import sys
import threading
import time
from pathlib import Path

import orjson
import pytest

from gyre.coordinator.trackers import STEP_METRIC, WANDB_ID_FILE, TrackerError, Trackers, check, scalars, validate

FIXTURE = Path(__file__).parent.parent / "fixtures" / "trackers" / "metrics.jsonl"
CONFIG = {"steps": 2, "policy": "elastic", "run_dir": "/tmp/x", "trackers": ["tensorboard", "wandb"]}


def events() -> list[dict]:
    return [orjson.loads(line) for line in FIXTURE.read_text().splitlines()]


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """W&B offline, silent, no git/code/stats probing, its own config dir: nothing leaves the machine."""
    for key in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(key, raising=False)
    for key, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true",
                       "WANDB_DISABLE_CODE": "true", "WANDB_X_DISABLE_STATS": "true",
                       "WANDB_X_DISABLE_META": "true", "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
                       "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
                       "WANDB_DATA_DIR": str(tmp_path / "wandb-data")}.items():
        monkeypatch.setenv(key, value)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    return run_dir


# --- readers ---------------------------------------------------------------------------------

def tb_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})  # 0: keep every event
    acc.Reload()
    return {tag: [(s.step, s.value) for s in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def wandb_records(path: Path):
    """A .wandb file's records: W&B's LevelDB-style log (7-byte file header, 32 KiB blocks of
    chunks with a 7-byte crc/length/type header; full=1, first=2, middle=3, last=4), each
    record a wandb_internal_pb2.Record."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", data[:7]
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the block's tail is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += block - pos % block
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(parts)
            yield record


def wandb_runs(run_dir: Path) -> list[dict]:
    """Each offline run under run_dir/wandb, oldest first: its id, config and history rows."""
    out = []
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"), key=lambda p: p.parent.name):
        run = {"id": None, "config": {}, "rows": []}
        for r in wandb_records(path):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                run["id"] = r.run.run_id
                run["config"].update({u.key: json.loads(u.value_json) for u in r.run.config.update})
            elif kind == "config":
                run["config"].update({u.key: json.loads(u.value_json) for u in r.config.update})
            elif kind == "history":
                run["rows"].append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item})
        out.append(run)
    return out


def expected_points(evs: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """(step, value) per metric as the events say: a step event's own step, eval's own step,
    anything else the last step event's."""
    points: dict[str, list[tuple[int, float]]] = {}
    step = 0
    for ev in evs:
        step = ev["step"] if ev["event"] in ("step", "resume") else step
        at = ev["step"] if ev["event"] == "eval" else step
        for metric, value in scalars(ev).items():
            points.setdefault(metric, []).append((at, value))
    return points


# --- the mapping -----------------------------------------------------------------------------

def test_scalars_of_a_real_step_event_by_name():
    step1 = next(e for e in events() if e["event"] == "step")
    assert scalars(step1) == {
        "rollout/reward_mean": 0.09022470498807439, "rollout/valid_frac": 1.0, "rollout/staleness_mean": 0.0,
        "rollout/groups": 2, "rollout/executions": 16, "rollout/equal_reward_groups": 0, "rollout/waterlevel": 0,
        "rollout/status/completed": 16,
        "train/loss": -6.556510925292969e-07, "train/tokens": 242, "train/cells": 2, "train/version": 1,
        "mismatch_kl": -3.940802813550054e-09,
        "perf/forward_tokens": 29562, "perf/unique_admitted_tokens": 29562, "perf/expanded_tokens": 29562,
        "perf/prefill_tokens": 3736, "perf/cached_tokens": 25584, "perf/cache_hit_rate": 0.8726,
        "perf/loop_lag_ms_p50": 0.535, "perf/loop_lag_ms_p99": 77.987, "perf/loop_lag_ms_max": 132.226,
        "timing_s/step": 26.161, "timing_s/trainer": 50.3821,
    }


def test_scalars_of_the_other_events():
    by_kind = {}
    for ev in events():
        by_kind.setdefault(ev["event"], ev)
    assert scalars(by_kind["publish"]) == {"timing_s/publish": 0.0487, "perf/publish_bytes": 6050304}
    assert scalars(by_kind["role"]) == {"timing_s/role_switch": 0.0229, "timing_s/role_switch_worker": 0.003}
    assert scalars(by_kind["eval"]) == {"eval/pass@4": 0.25, "eval/pass@1": 0.125, "eval/reward_mean": 0.31,
                                        "eval/tasks": 2, "eval/scored_tasks": 2, "eval/executions": 8,
                                        "timing_s/eval": 41.2}
    assert scalars(by_kind["checkpoint"]) == {"timing_s/checkpoint": 0.069}
    assert scalars(by_kind["summary"]) == {"timing_s/run": 84.8742, "train/tokens_total": 474,
                                           "rollout/tokens_total": 474}
    assert scalars(by_kind["execution"]) == {} and scalars(by_kind["dispatch"]) == {}


def test_unknowns_are_skipped_never_zero():
    """A step with no valid reward, no engine cache report and no probe samples: those
    metrics are absent, not 0 (a 0 would read as a measured zero reward or hit rate)."""
    step = dict(next(e for e in events() if e["event"] == "step"), reward_mean=None, reward_valid_frac=None,
                cache_hit_rate=None, prefill_tokens=None, cached_tokens=None, mismatch=None, loop_lag_ms=None)
    out = scalars(step)
    for gone in ("rollout/reward_mean", "rollout/valid_frac", "perf/cache_hit_rate", "perf/prefill_tokens",
                 "perf/cached_tokens", "mismatch_kl", "perf/loop_lag_ms_p99"):
        assert gone not in out
    assert out["train/tokens"] == 242
    assert scalars({"event": "eval", "t": 1.0, "step": 3, "k": 4, "pass_at_k": None}) == {}


# --- both trackers, read back ----------------------------------------------------------------

def test_events_read_back_from_tensorboard_and_wandb(offline):
    evs = events()
    trk = Trackers(["tensorboard", "wandb"], {"wandb": {"project": "gyre-test"}}, offline, CONFIG)
    assert "WANDB_SERVICE" not in os.environ  # no harness the run starts attaches to the run's W&B service
    for ev in evs:
        trk.log(ev)
    trk.close()
    assert trk.failures == {}
    want = expected_points(evs)
    # Spot checks against the fixture's own numbers, independent of the mapping table.
    assert want["rollout/reward_mean"] == [(1, 0.09022470498807439), (2, 0.10185311764259133)]
    assert want["timing_s/publish"] == [(1, 0.0487), (2, 0.0233)]
    assert want["timing_s/role_switch"] == [(0, 0.0229), (0, 0.012), (1, 0.0008), (1, 0.0009), (1, 0.0477),
                                            (1, 0.0082), (2, 0.0008), (2, 0.0008)]
    assert want["eval/pass@4"] == [(1, 0.25)]  # its round's step (dispatched then), not the step done when it ended
    assert want["perf/loop_lag_ms_p99"] == [(1, 77.987), (2, 78.466)]

    # TensorBoard: every tag, its steps and its values (float32 in the event file).
    tb = tb_scalars(offline / "tensorboard")
    assert sorted(tb) == sorted(want)
    for tag, points in want.items():
        assert [s for s, _ in tb[tag]] == [s for s, _ in points], tag
        assert [v for _, v in tb[tag]] == pytest.approx([v for _, v in points], rel=1e-6), tag
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(offline / "tensorboard"))
    acc.Reload()
    text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert json.loads(text.removeprefix("```json\n").removesuffix("\n```")) == CONFIG

    # W&B: one offline run, the id kept in the run directory, the config, every row.
    (run,) = wandb_runs(offline)
    assert run["id"] == (offline / WANDB_ID_FILE).read_text().strip()
    assert {k: run["config"][k] for k in CONFIG} == CONFIG
    got: dict[str, list[tuple[int, float]]] = {}
    for row in run["rows"]:
        for key, value in row.items():
            if not key.startswith("_") and key != STEP_METRIC:
                got.setdefault(key, []).append((row[STEP_METRIC], value))
    assert got == {tag: [(s, pytest.approx(v)) for s, v in points] for tag, points in want.items()}


def test_resume_continues_the_wandb_run_and_tensorboard_hides_the_lost_stretch(offline):
    """A run stopped after step 3 resumes from its step-2 checkpoint and redoes step 3: W&B
    gets the same run id; TensorBoard shows steps 1-3 once, step 3 the redone one's."""
    def step(n: int, reward: float) -> dict:
        return {"event": "step", "t": float(n), "step": n, "version": n, "reward_mean": reward, "loss": 0.5}

    first = Trackers(["tensorboard", "wandb"], {}, offline, CONFIG)
    for n, reward in ((1, 0.1), (2, 0.2), (3, 0.3)):
        first.log(step(n, reward))
    first.close()
    again = Trackers(["tensorboard", "wandb"], {}, offline, CONFIG)
    again.log({"event": "resume", "t": 3.5, "step": 2, "version": 2, "checkpoint": "RUN/checkpoints/step-000002",
               "executions_restored": 16, "executions_redispatched": 0, "groups": 2, "groups_held": 0})
    again.log({"event": "role", "t": 3.6, "cell": 0, "from": "rollout", "to": "training", "seconds": 0.5,
               "worker_seconds": 0.1})
    again.log(step(3, 0.35))
    again.close()

    tb = tb_scalars(offline / "tensorboard")
    assert tb["rollout/reward_mean"] == [(1, pytest.approx(0.1)), (2, pytest.approx(0.2)), (3, pytest.approx(0.35))]
    assert tb["timing_s/role_switch"] == [(2, 0.5)]  # after the resume: the checkpoint's step
    runs = wandb_runs(offline)
    run_id = (offline / WANDB_ID_FILE).read_text().strip()
    assert [r["id"] for r in runs] == [run_id, run_id]
    assert [(row[STEP_METRIC], row["rollout/reward_mean"]) for row in runs[1]["rows"]
            if "rollout/reward_mean" in row] == [(3, 0.35)]


# --- failures --------------------------------------------------------------------------------

def test_a_failing_tracker_warns_once_and_the_others_go_on(offline, caplog):
    trk = Trackers(["tensorboard", "wandb"], {}, offline, CONFIG)
    wandb_sink = next(s for s in trk.sinks if s.name == "wandb")

    def down(*args, **kwargs):
        raise ConnectionError("api.wandb.ai unreachable")

    wandb_sink._run.log = down
    steps = [e for e in events() if e["event"] == "step"]
    with caplog.at_level(logging.WARNING, logger="gyre.coordinator"):
        for ev in steps:
            trk.log(ev)
        trk.close()
    warned = [r.getMessage() for r in caplog.records if "tracker wandb" in r.getMessage()]
    assert len(warned) == 2  # the first failure, then the count at close
    assert "ConnectionError: api.wandb.ai unreachable" in warned[0] and "2 call(s) failed" in warned[1]
    assert trk.failures == {"wandb": 2}
    assert [s for s, _ in tb_scalars(offline / "tensorboard")["rollout/reward_mean"]] == [1, 2]


def test_log_only_queues_and_close_has_a_deadline(tmp_path, caplog):
    """The event loop never waits on a tracker: with TensorBoard's writes held up, every
    `log` returns at once; close waits its deadline, then leaves the writer to finish."""
    trk = Trackers(["tensorboard"], {}, tmp_path, CONFIG)
    sink, gate = trk.sinks[0], threading.Event()
    real = sink.write

    def held(step, values):
        assert gate.wait(30)
        real(step, values)

    sink.write = held
    t0 = time.monotonic()
    for ev in events():
        trk.log(ev)
    assert time.monotonic() - t0 < 5  # a synchronous log would sit in the first write for 30 s
    with caplog.at_level(logging.WARNING, logger="gyre.coordinator"):
        trk.close(timeout_s=0.2)
    assert "trackers: still writing after 0.2 s" in caplog.text
    gate.set()
    trk._thread.join(30)
    assert trk.failures == {}
    assert [s for s, _ in tb_scalars(tmp_path / "tensorboard")["timing_s/publish"]] == [1, 2]


def test_a_missing_package_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` does where it is not installed
    with pytest.raises(TrackerError, match=r"tracker 'wandb' needs the wandb package: pip install 'gyre\[wandb\]'"):
        check(["wandb"])
    for name in [m for m in sys.modules if m.startswith("torch.utils.tensorboard")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(TrackerError, match=r"pip install 'gyre\[tensorboard\]'"):
        check(["tensorboard"])
    with pytest.raises(TrackerError, match=r"pip install 'gyre\[tensorboard\]'"):
        Trackers(["tensorboard"], {}, tmp_path, CONFIG)
    assert not (tmp_path / "tensorboard").exists()  # refused before anything was made
    with pytest.raises(TrackerError, match=r"unknown tracker 'mlflow' \(known: tensorboard, wandb\)"):
        check(["mlflow"])


def test_a_tracker_that_cannot_start_is_one_line(tmp_path):
    (tmp_path / "tensorboard").write_text("a file where the log dir would go")
    with pytest.raises(TrackerError, match=r"^tracker 'tensorboard' did not start: FileExistsError"):
        Trackers(["tensorboard"], {}, tmp_path, CONFIG)


def test_validate_names_the_bad_field():
    validate(["tensorboard", "wandb"], {"wandb": {"project": "p", "mode": "online", "entity": "e", "name": "n"},
                                         "tensorboard": {"dir": "tb", "flush_secs": 5}})
    for trackers, options, message in (
            (["mlflow"], {}, r"trackers: unknown tracker 'mlflow'"),
            ("wandb", {}, r"trackers must be a list of names, got the string 'wandb'"),
            (["wandb", "wandb"], {}, r"trackers: 'wandb' named twice"),
            (["wandb"], {"mlflow": {}}, r"tracker_options: unknown tracker 'mlflow'"),
            (["wandb"], {"wandb": "offline"}, r"tracker_options.wandb must be a table"),
            (["wandb"], {"wandb": {"projet": "p"}}, r"tracker_options.wandb: unknown projet"),
            (["wandb"], {"wandb": {"mode": "offlne"}}, r"tracker_options.wandb.mode must be one of offline, online"),
            (["tensorboard"], {"tensorboard": {"flush_secs": 0}}, r"flush_secs must be > 0")):
        with pytest.raises(ValueError, match=message):
            validate(trackers, options)
