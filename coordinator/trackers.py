"""trackers.py: the run's metrics.jsonl events as scalars in TensorBoard and W&B (optional extras).

`scalars(event)` maps one event, as `Metrics.emit` writes it, to metric names in the ecosystem's
style (`rollout/`, `train/`, `perf/`, `timing_s/`, `eval/pass@k`, `mismatch_kl`); `Trackers` sends
them to the trackers the run config names, at the step they belong to. Not a metrics store:
metrics.jsonl stays the run's record, and a tracker that fails mid-run only warns.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import queue
import secrets
import string
import threading
from collections.abc import Iterable
from pathlib import Path

from gyre.workerd.wire import GyreError

log = logging.getLogger("gyre.coordinator")

TRACKERS = ("tensorboard", "wandb")
MODULES = {"tensorboard": "torch.utils.tensorboard", "wandb": "wandb"}  # what each imports (torch's needs tensorboard)
OPTIONS = {"tensorboard": ("dir", "flush_secs"),
           "wandb": ("project", "entity", "name", "group", "tags", "notes", "mode")}
WANDB_MODES = ("offline", "online", "disabled")
WANDB_ID_FILE = "wandb-run-id"  # in the run directory: `gyre up --resume` continues the same W&B run
CLOSE_TIMEOUT_S = 60.0  # Trackers.close: the queue written and W&B finished (online: uploaded) within this
QUEUE = 1000  # TensorBoard events held for its writer thread (see _TensorBoard._open)
STEP_METRIC = "train/step"  # W&B's x-axis: the run's step, not W&B's own row counter (see _WandB)

# Number fields per event kind: (field, metric). A missing, None or non-number field is
# skipped, never logged as 0. Dict-valued fields (loop_lag_ms, statuses, eval's k) are in scalars().
FIELDS: dict[str, tuple[tuple[str, str], ...]] = {
    "step": (("reward_mean", "rollout/reward_mean"), ("reward_valid_frac", "rollout/valid_frac"),
             ("staleness_mean", "rollout/staleness_mean"), ("groups", "rollout/groups"),
             ("executions", "rollout/executions"), ("equal_reward_groups", "rollout/equal_reward_groups"),
             ("waterlevel", "rollout/waterlevel"),
             ("loss", "train/loss"), ("tokens_trained", "train/tokens"), ("cells_training", "train/cells"),
             ("version", "train/version"), ("mismatch", "mismatch_kl"),
             ("forward_tokens", "perf/forward_tokens"), ("unique_admitted_tokens", "perf/unique_admitted_tokens"),
             ("expanded_tokens", "perf/expanded_tokens"), ("prefill_tokens", "perf/prefill_tokens"),
             ("cached_tokens", "perf/cached_tokens"), ("cache_hit_rate", "perf/cache_hit_rate"),
             ("seconds", "timing_s/step"), ("trainer_seconds", "timing_s/trainer")),
    "publish": (("seconds", "timing_s/publish"), ("bytes", "perf/publish_bytes")),
    "role": (("seconds", "timing_s/role_switch"), ("worker_seconds", "timing_s/role_switch_worker")),
    "join": (("seconds", "timing_s/join"), ("bytes", "perf/join_bytes")),
    "checkpoint": (("seconds", "timing_s/checkpoint"),),
    "eval": (("pass_at_1", "eval/pass@1"), ("reward_mean", "eval/reward_mean"), ("tasks", "eval/tasks"),
             ("scored_tasks", "eval/scored_tasks"), ("executions", "eval/executions"), ("seconds", "timing_s/eval")),
    "summary": (("wall_s", "timing_s/run"), ("tokens_trained", "train/tokens_total"),
                ("rollout_tokens", "rollout/tokens_total")),
}
LOOP_LAG = ("p50", "p99", "max")  # of the step's loop_lag_ms {p50, p99, max, samples}


class TrackerError(GyreError):
    """A tracker the run config names cannot start (not installed, or its init failed)."""


def _number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def scalars(event: dict) -> dict[str, float]:
    """The metrics one metrics.jsonl event carries; {} for the kinds no tracker shows
    (dispatch, execution: the step event counts them)."""
    kind = event.get("event")
    out = {metric: event[f] for f, metric in FIELDS.get(kind, ()) if _number(event.get(f))}
    if kind == "step":
        lag = event.get("loop_lag_ms")
        if isinstance(lag, dict):
            out.update({f"perf/loop_lag_ms_{q}": lag[q] for q in LOOP_LAG if _number(lag.get(q))})
        statuses = event.get("statuses")
        if isinstance(statuses, dict):  # cumulative since the run began, as the event has them
            out.update({f"rollout/status/{s}": n for s, n in statuses.items() if _number(n)})
    elif kind == "eval" and _number(event.get("pass_at_k")) and _number(event.get("k")):
        out[f"eval/pass@{event['k']}"] = event["pass_at_k"]
    return out


def validate(trackers: Iterable[str], tracker_options: dict) -> None:
    """The run config's `trackers` and `tracker_options`, checked without importing either
    package (CoordinatorConfig.__post_init__ calls it); ValueError names the bad field."""
    if isinstance(trackers, str):
        raise ValueError(f"trackers must be a list of names, got the string {trackers!r}")
    names = list(trackers)
    for name in names:
        if name not in TRACKERS:
            raise ValueError(f"trackers: unknown tracker {name!r} (known: {', '.join(TRACKERS)})")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"trackers: {', '.join(map(repr, twice))} named twice")
    if not isinstance(tracker_options, dict):
        raise ValueError(f"tracker_options must be a table per tracker, got {tracker_options!r}")
    for name, opts in tracker_options.items():
        if name not in TRACKERS:
            raise ValueError(f"tracker_options: unknown tracker {name!r} (known: {', '.join(TRACKERS)})")
        if not isinstance(opts, dict):
            raise ValueError(f"tracker_options.{name} must be a table, got {opts!r}")
        unknown = sorted(set(opts) - set(OPTIONS[name]))
        if unknown:
            raise ValueError(f"tracker_options.{name}: unknown {', '.join(unknown)} "
                             f"(known: {', '.join(OPTIONS[name])})")
    mode = tracker_options.get("wandb", {}).get("mode", "offline")
    if mode not in WANDB_MODES:
        raise ValueError(f"tracker_options.wandb.mode must be one of {', '.join(WANDB_MODES)}, got {mode!r}")
    flush = tracker_options.get("tensorboard", {}).get("flush_secs", 10)
    if not _number(flush) or flush <= 0:
        raise ValueError(f"tracker_options.tensorboard.flush_secs must be > 0, got {flush!r}")


def check(trackers: Iterable[str]) -> None:
    """Each named tracker's package importable, before the run starts (the CLI calls it);
    TrackerError names the extra to install."""
    for name in trackers:
        if name not in TRACKERS:
            raise TrackerError(f"unknown tracker {name!r} (known: {', '.join(TRACKERS)})")
        try:
            importlib.import_module(MODULES[name])
        except ImportError as e:
            raise TrackerError(f"tracker {name!r} needs the {name} package: pip install 'gyre[{name}]' "
                               f"({type(e).__name__}: {e})") from None


class _TensorBoard:
    """torch's SummaryWriter: add_scalar queues the event, a writer thread writes the file."""

    name = "tensorboard"

    def __init__(self, run_dir: Path, options: dict, config: dict):
        self.dir = run_dir / options.get("dir", "tensorboard")  # an absolute dir stays itself
        self.flush_secs = options.get("flush_secs", 10)
        self._writer = self._open()
        # The text plugin renders markdown: the resolved config as one JSON block.
        self._writer.add_text("config", "```json\n" + json.dumps(config, indent=2, default=str) + "\n```", 0)

    def resume(self, step: int) -> None:
        """A resumed run redoes the steps after `step`: a new event file whose purge_step makes
        TensorBoard hide what the stopped run wrote for them (a SessionLog START)."""
        self._writer.close()
        self._writer = self._open(purge_step=step + 1)

    def _open(self, purge_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        # A full queue makes add_scalar wait for the writer thread's disk writes, on the event
        # loop: a step event alone is ~25 scalars, torch's default queue 10 (a step event's
        # median cost here: 0.63 ms with it, 0.14 ms with this one).
        return SummaryWriter(str(self.dir), flush_secs=self.flush_secs, max_queue=QUEUE, purge_step=purge_step)

    def write(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self._writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self._writer.close()


class _WandB:
    """One W&B run per run directory, its id kept there: a resumed gyre run is the same W&B run."""

    name = "wandb"

    def __init__(self, run_dir: Path, options: dict, config: dict):
        import wandb

        self._wandb = wandb
        id_file = run_dir / WANDB_ID_FILE
        if id_file.exists():
            run_id = id_file.read_text().strip()
        else:
            run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
            id_file.write_text(run_id + "\n")
        self._run = wandb.init(dir=str(run_dir), id=run_id, resume="allow", config=config,
                               mode=options.get("mode", "offline"), project=options.get("project", "gyre"),
                               entity=options.get("entity"), name=options.get("name", run_dir.name),
                               group=options.get("group"), tags=options.get("tags"), notes=options.get("notes"),
                               settings=wandb.Settings(console="off"))  # gyre's own console stays gyre's
        self.id = self._run.id
        # wandb.init names its service in the environment for child processes to join: the
        # coordinator's children (workerds, harnesses, the tasks they run) must not log into it.
        os.environ.pop(wandb.env.SERVICE, None)
        # W&B's own step must only grow, and a resumed run redoes steps: plot against ours instead.
        self._run.define_metric(STEP_METRIC)
        self._run.define_metric("*", step_metric=STEP_METRIC)

    def resume(self, step: int) -> None:
        pass  # W&B has no purge: the redone steps' rows follow the stopped run's at the same x

    def write(self, step: int, values: dict[str, float]) -> None:
        self._run.log({STEP_METRIC: step, **values})

    def close(self) -> None:
        self._run.finish()
        # finish() can return before W&B's service has written the run's file (offline: read
        # right after, it may hold only its header); teardown waits for that, and for uploads.
        # Process-wide, which is fine: the coordinator is the one W&B user in its process.
        self._wandb.teardown()


SINKS = {"tensorboard": _TensorBoard, "wandb": _WandB}


class Trackers:
    """The run's trackers. Built by the coordinator at start-up (after `check`), fed every
    event by `Metrics.emit`, closed at shutdown; never raises after it is built.

    `log` only queues the event: one thread maps and writes (a step event is ~25 scalars for
    each tracker, measured 0.2-15 ms, the most with trainers busy on the same cores), so the
    event loop never waits on a tracker's file or socket."""

    def __init__(self, trackers: Iterable[str], tracker_options: dict, run_dir: Path, config_json: dict):
        names = list(trackers)
        check(names)
        self.step = 0  # the last step event's (or the resume's): other events attach to it
        self.failures: dict[str, int] = {}
        self.sinks: list = []
        self._closed = False
        for name in names:
            try:
                self.sinks.append(SINKS[name](Path(run_dir), (tracker_options or {}).get(name, {}), config_json))
            except Exception as e:  # noqa: BLE001 - one line before the run starts; the ones started close
                self._close_sinks()
                raise TrackerError(f"tracker {name!r} did not start: {type(e).__name__}: {e}") from None
        self._queue: queue.SimpleQueue[dict | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._drain, name="gyre-trackers", daemon=True)
        self._thread.start()

    def log(self, event: dict) -> None:
        """One metrics.jsonl event, as `Metrics.emit` wrote it (the same dict: it is only read)."""
        if not self._closed:
            self._queue.put(event)

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Write what is queued, then close every tracker (W&B: finish the run); the coordinator
        calls it once at shutdown, a second call does nothing. Waits at most `timeout_s`."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("trackers: still writing after %g s; left to finish in the background", timeout_s)

    # --- the trackers' thread -----------------------------------------------------------------

    def _drain(self) -> None:
        while (event := self._queue.get()) is not None:
            try:
                self._write(event)
            except Exception as e:  # noqa: BLE001 - an odd event must not end the thread
                self._failed("trackers", "mapping an event", e)
        self._close_sinks()

    def _write(self, event: dict) -> None:
        kind = event.get("event")
        if kind in ("step", "resume") and _number(event.get("step")):
            self.step = event["step"]
        if kind == "resume":
            self._each("resume", self.step)
        # An eval round is scored at the step it was dispatched at, which may be behind by now.
        step = event["step"] if kind == "eval" and _number(event.get("step")) else self.step
        values = scalars(event)
        if values:
            self._each("write", step, values)

    def _each(self, method: str, *args) -> None:
        for sink in self.sinks:
            try:
                getattr(sink, method)(*args)
            except Exception as e:  # noqa: BLE001 - a tracker never stops the run; metrics.jsonl has it all
                self._failed(sink.name, method, e)

    def _failed(self, name: str, what: str, e: Exception) -> None:
        n = self.failures[name] = self.failures.get(name, 0) + 1
        if n == 1:
            log.warning("tracker %s: %s failed (%s: %s); the run goes on, later failures are counted",
                        name, what, type(e).__name__, e)

    def _close_sinks(self) -> None:
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as e:  # noqa: BLE001 - shutdown goes on
                log.warning("tracker %s: close failed (%s: %s)", sink.name, type(e).__name__, e)
        for name, n in self.failures.items():
            log.warning("tracker %s: %d call(s) failed during the run; metrics.jsonl has every event", name, n)
