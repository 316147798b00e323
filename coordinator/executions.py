"""executions.py: `Executions`, the owner of a run's executions.

It holds the dispatch queue, each running execution (its asyncio task, and the execution
itself, whose phase the live view shows), the count of closed ones by status, each task's
last valid reward, the run of infrastructure failures in a row, the groups dispatched and
replaced so far, and the groups a resume holds back for later publications. It dispatches groups
(journaled in metrics.jsonl as `dispatch` events), launches queued executions when the
scheduler gives it slots, closes each one exactly once (its `execution` event, its group
settled in the buffer, a replacement for a dropped group), and restores itself from the
journal on a resume. Not the scheduler (schedule.py says how many to launch), not the
sandbox (launcher.py runs one) and not the buffer's rules (buffer.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from gyre.coordinator.buffer import Execution, Group, TrajectoryBuffer
from gyre.coordinator.config import CoordinatorConfig
from gyre.coordinator.evaluator import valid_reward
from gyre.coordinator.heldout import HeldOut
from gyre.coordinator.resume import ResumeError, redo_id
from gyre.coordinator.sandbox.reaper import adoptable_until
from gyre.coordinator.tasks import TaskSource
from gyre.coordinator.waterlevel import Waterlevel
from gyre.proxy.records import RecordsError, load_execution
from gyre.workerd.wire import GyreError

log = logging.getLogger("gyre.coordinator")


class InfraFailures(GyreError):
    """Executions keep failing before the agent's work could be assessed: the run stops."""


class Executions:
    def __init__(self, config: CoordinatorConfig, wl: Waterlevel, buffer: TrajectoryBuffer, tasks: TaskSource,
                 heldout: HeldOut | None, version: Callable[[], int]):
        self.c = config
        self.wl, self.buffer, self.tasks, self.heldout = wl, buffer, tasks, heldout
        self.version = version  # the published policy version, read at each dispatch
        self.queue: deque[Execution] = deque()
        self.runs: dict[str, asyncio.Task] = {}  # running: id -> its task
        self.active: dict[str, Execution] = {}  # running: id -> the execution (its phase: the live view's)
        self.last_reward: dict[str, float] = {}  # task id -> the reward of its last valid outcome
        self.status_counts: dict[str, int] = {}
        self.infra_streak = 0  # executions in a row that ended aborted_infra
        self.fatal: InfraFailures | None = None  # too many of them: the next tick ends the run
        self.groups_dispatched = 0
        self.replacements = 0  # groups dispatched for dropped ones, beyond the boundary schedule
        # Resume: journaled groups to dispatch again later, in their order; a group whose
        # harnesses outlived the crash is out at once, and holds its place here ({"ahead": True}).
        self.held: deque[dict] = deque()
        self.adopting: deque[Execution] = deque()  # resume: harnesses still running, to take back (launch_adopted)
        self.handed_off: set[str] = set()  # a stop for a restart left these running (cancel_all)
        self.outcomes: dict[str, dict] = {}  # resume: the journal's closed executions, by id
        self.changed = asyncio.Event()  # an execution closed (the streaming packer waits on it)
        self.stopping = False  # the run's stop began: a cancelled execution is not an outcome
        self.launcher: Any = None  # set at start-up (launcher.Launcher)
        self.metrics: Any = None  # set when the run starts (metrics.Metrics)

    # --- dispatch and launch ------------------------------------------------------------

    def dispatch(self, n_groups: int) -> None:
        c = self.c
        while n_groups > 0:
            n_groups -= 1
            if self.held:  # resume: a group of a lost stretch, dispatched again where it first was
                ev = self.held.popleft()
                if ev.get("ahead"):  # out since the resume (its harnesses outlived the crash): its slot now
                    continue
                group, _, _ = self.release(ev)
                if group.state == "dropped":  # it was when it first ran: its replacement too
                    self.replacements += 1
                    n_groups += 1
                continue
            task = self.tasks.next_task()
            gid = self.groups_dispatched
            self.groups_dispatched += 1
            group = Group(gid, task, self.version(), c.group_size)
            for i, tracked in enumerate(self.wl.dispatch(c.group_size + c.oversample)):
                run = Execution(f"g{gid:05d}-{i:02d}", gid, i, task, tracked, group.version)
                group.runs.append(run)
                self.queue.append(run)
            self.buffer.add(group)
            self.journal(group)

    def journal(self, group: Group) -> None:
        self.metrics.emit("dispatch", group=group.id, task=group.task.id, version=group.version,
                          runs=[r.id for r in group.runs])

    def launch(self, n: int) -> None:
        waiting: list[Execution] = []  # their task's image is still building: no slot is taken for that
        while self.queue and n > 0:
            run = self.queue.popleft()
            if self.launcher.images.state(run.task) == "building":
                waiting.append(run)
                continue
            self.wl.launch(run.tracked)
            self.active[run.id] = run
            self.runs[run.id] = asyncio.create_task(self._execute(run), name=f"gyre-exec-{run.id}")
            n -= 1
        self.queue.extendleft(reversed(waiting))

    def launch_eval(self, n: int) -> None:
        queue = self.heldout.queue if self.heldout is not None else ()
        for _ in range(min(n, len(queue))):
            run = queue.popleft()
            self.heldout.launched(run)
            self.active[run.id] = run
            self.runs[run.id] = asyncio.create_task(self._execute(run), name=f"gyre-eval-{run.id}")

    def launch_adopted(self) -> int:
        """Resume: the executions whose harnesses outlived the earlier coordinator (restore
        found them), running again at once: no slot is waited for, they hold theirs."""
        n = len(self.adopting)
        while self.adopting:
            run = self.adopting.popleft()
            self.wl.launch(run.tracked)
            self.active[run.id] = run
            self.runs[run.id] = asyncio.create_task(self._execute(run), name=f"gyre-adopt-{run.id}")
        return n

    async def _execute(self, run: Execution) -> None:
        try:
            await (self.launcher.adopt(run) if run.adopted else self.launcher.run(run))
        except asyncio.CancelledError:
            run.status = run.status or "cancelled"
            run.reward, run.valid = None, False
            self.close(run)
            raise
        except Exception as e:  # noqa: BLE001 - an infrastructure failure, recorded as such
            log.exception("execution %s failed", run.id)
            run.status, run.reward, run.valid, run.ref = "aborted_infra", None, False, f"{type(e).__name__}: {e}"
        self.close(run)

    async def cancel_all(self, handoff: bool = False) -> None:
        """The stop: every running execution cancelled (closed as such), the queued held-out
        ones closed too (their rounds end, marked incomplete). With `handoff` (a stop for a
        restart) an execution whose harness runs detached in a container is handed off
        instead (launcher.hand_off): left running, nothing journaled of its end, for the next
        coordinator of the run to adopt."""
        self.stopping = True
        if handoff:
            self.handed_off = {r.id for r in self.active.values() if r.group >= 0 and self.launcher.hand_off(r)}
        for task in list(self.runs.values()):
            task.cancel()
        await asyncio.gather(*self.runs.values(), return_exceptions=True)
        for run in self.heldout.cancel_queued() if self.heldout else ():
            run.status, run.valid = "cancelled", False
            self.close(run)

    # --- closing ------------------------------------------------------------------------

    def close(self, run: Execution) -> None:
        if run.closed:
            return
        if run.id in self.handed_off:  # still running, in its container: the next coordinator's to close
            self.active.pop(run.id, None)
            self.runs.pop(run.id, None)
            return
        run.t_end = run.t_end or time.time()
        self.active.pop(run.id, None)
        if run.valid and run.reward is not None:
            self.last_reward[run.task.id] = run.reward
        if run.group < 0:  # a held-out evaluation: recorded, scored, never trained
            self._close_eval(run)
            return
        self.wl.terminate(run.tracked)
        self.runs.pop(run.id, None)
        self.status_counts[run.status] = self.status_counts.get(run.status, 0) + 1
        if run.status == "aborted_infra":
            self.infra_streak += 1
            limit = self.c.infra_failures_in_row
            if limit and self.infra_streak >= limit and self.fatal is None:
                self.fatal = InfraFailures(
                    f"{self.infra_streak} executions in a row ended aborted_infra (infra_failures_in_row = {limit}); "
                    f"the last: {run.ref[:300]}")
        elif run.status != "cancelled":
            self.infra_streak = 0
        self.metrics.emit("execution", id=run.id, group=run.group, status=run.status, reward=run.reward,
                          valid=run.valid, version_dispatched=run.version_dispatched,
                          t_start=self.metrics.since_start(run.t_start), t_end=self.metrics.since_start(run.t_end),
                          ref=run.ref[:200], eval_attempts=run.eval_attempts, copy_out_error=run.copy_out_error,
                          **({"adopted": True} if run.adopted else {}))
        if self.stopping and run.status == "cancelled":
            # The stop's, not an outcome: the group neither settles nor is replaced; it stays
            # pending, and a resume dispatches this execution again.
            return
        for surplus in self.buffer.on_closed(run):
            surplus.status = "cancelled"
            task = self.runs.get(surplus.id)
            if task is not None:
                task.cancel()
        group = self.buffer.groups[run.group]
        if group.state == "dropped":
            log.warning("group %d dropped (%d valid of %d); dispatching a replacement",
                        group.id, len(group.valid_runs), len(group.runs))
            self.replacements += 1
            self.dispatch(1)
        self.changed.set()

    def _close_eval(self, run: Execution) -> None:
        self.runs.pop(run.id, None)
        r = self.heldout.round_of(run)
        self.metrics.emit("execution", id=run.id, group=None, eval=r.number, task=run.task.id, status=run.status,
                          reward=run.reward, valid=run.valid, version_dispatched=run.version_dispatched,
                          t_start=self.metrics.since_start(run.t_start), t_end=self.metrics.since_start(run.t_end),
                          ref=run.ref[:200])
        event = self.heldout.close(run)
        if event is not None:
            self.metrics.emit("eval", **event)
            log.info("held-out eval %d (step %d, version %d): pass@%d %s, pass@1 %s over %d tasks",
                     event["round"], event["step"], event["version"], event["k"], _fmt(event["pass_at_k"]),
                     _fmt(event["pass_at_1"]), event["scored_tasks"])

    # --- resume -------------------------------------------------------------------------

    def restore(self, state: dict, dispatches: dict[int, dict], outcomes: dict[str, dict]) -> tuple[int, int]:
        """The journal's groups back (Checkpoints.restore has loaded the checkpoint: `version()` is
        its version). Groups consumed by a checkpointed step stay consumed; groups dispatched
        after the checkpoint, or held at it, are held for the publications that first
        dispatched them; every other group's closed executions come back with their records,
        the rest adopted where their harness still runs or queued again under new ids. A held
        group with a harness still running is not held (its harness would be reaped and run
        again, hours lost): it is out now, its versions clamped as below, and the publication
        that first dispatched it takes its place (`ahead`) without dispatching anything.
        (restored, queued)."""
        self.outcomes = outcomes
        self.status_counts = {}
        for out in outcomes.values():  # every closed execution of the run, before and after the checkpoint
            if out.get("eval") is None:  # held-out evaluations are not the run's executions
                self.status_counts[out["status"]] = self.status_counts.get(out["status"], 0) + 1
        tasks = {t.id: t for t in self.tasks.tasks}
        consumed, held = set(state["consumed"]), set(state.get("held", ()))
        ahead = set(state.get("ahead", ()))  # released at an earlier resume, their places still held
        restored = redone = 0
        for gid in sorted(dispatches):
            ev = dispatches[gid]
            if ev["task"] not in tasks:
                raise ResumeError(f"group {gid}: task {ev['task']!r} is no longer in the task set")
            if gid >= state["groups_dispatched"]:
                self.tasks.next_task()  # dispatched after the checkpoint: keep the task order aligned
            if gid >= state["groups_dispatched"] or gid in held:
                if gid not in ahead and not self._running(ev):
                    self.held.append(ev)
                    continue
                self.held.append({"group": gid, "ahead": True})
            # A group dispatched after the checkpoint carries a version the restored model
            # does not have yet: clamp it, so staleness never reads negative.
            group = Group(gid, tasks[ev["task"]], min(ev["version"], self.version()), self.c.group_size)
            if gid in consumed:
                self.buffer.add(group)
                group.state = "consumed"
                continue
            k, r = self._rebuild(group, ev, adopt=True)
            restored, redone = restored + k, redone + r
        # New groups take ids after every id the journal holds; the held ones keep theirs.
        self.groups_dispatched = max([state["groups_dispatched"], *(g + 1 for g in dispatches)])
        self.replacements = state.get("replacements", 0)
        return restored, redone

    def _running(self, ev: dict) -> bool:
        """Whether a journaled group has an execution with no outcome whose harness the earlier
        coordinator left running in its sandbox (reaper.adoptable_until)."""
        folder = self.c.run_dir / "executions"
        return any(run_id not in self.outcomes and adoptable_until(folder / run_id) is not None
                   for run_id in ev["runs"])

    def release(self, ev: dict, *, adopt: bool = False) -> tuple[Group, int, int]:
        """A held group (see restore) dispatched again now, at the version published now: its
        closed executions restored, the others run under new ids (or, with `adopt`, at the
        resume itself, adopted where their harness still runs). (group, restored, queued);
        a group that settles dropped at once was dropped when it first ran, and the caller
        releases its replacement too."""
        tasks = {t.id: t for t in self.tasks.tasks}
        group = Group(ev["group"], tasks[ev["task"]], self.version(), self.c.group_size)
        restored, queued = self._rebuild(group, ev, adopt=adopt)
        if not any(r.id not in ev["runs"] for r in group.runs):
            self.journal(group)  # its version now, for a later resume
        return group, restored, queued

    def _rebuild(self, group: Group, ev: dict, *, adopt: bool = False) -> tuple[int, int]:
        """A journaled group back in the buffer: closed executions with their recorded trees,
        with `adopt` (at the resume) the ones whose harness outlived the earlier coordinator
        to be adopted under their own ids (`adopting`), the rest queued again under new ids
        (surplus ones cancelled). (restored, queued: adopted ones among them)."""
        self.buffer.add(group)
        closed: list[Execution] = []
        restored = redone = 0
        for i, run_id in enumerate(ev["runs"]):  # every run first: the group settles on all of them
            out = self.outcomes.get(run_id)
            tracked = self.wl.dispatch(1)[0]
            recorder = None
            folder_ex = self.c.run_dir / "executions" / run_id
            if out is not None and out["status"] != "cancelled" and folder_ex.is_dir():
                try:
                    recorder = load_execution(folder_ex)
                except RecordsError as e:  # its tree is damaged: it cannot train; run it again instead
                    log.warning("execution %s: its records cannot be read (%s); dispatching it again", run_id, e)
                    out = None
            if out is not None and out["status"] != "cancelled":
                status, reward, valid, ref = out["status"], out["reward"], out["valid"], out.get("ref", "")
                why = valid_reward(reward, tuple(self.c.reward_range)) if valid else None
                if why is not None:  # journaled before rewards were checked: never trained, never a crash
                    status, reward, valid, ref = "evaluator_error", None, False, f"invalid reward: {why}"
                run = Execution(run_id, group.id, i, group.task, tracked, group.version, status=status,
                                reward=reward, valid=valid, ref=ref)
                run.recorder = recorder
                self.wl.launch(tracked)
                self.wl.terminate(tracked)
                if valid and reward is not None:
                    self.last_reward[group.task.id] = reward
                closed.append(run)
                restored += 1
            elif out is None and adopt and adoptable_until(folder_ex) is not None:
                run = Execution(run_id, group.id, i, group.task, tracked, group.version, adopted=True)
            else:
                run = Execution(redo_id(self.c.run_dir, run_id), group.id, i, group.task, tracked, group.version)
            group.runs.append(run)
        surplus: set[str] = set()
        for run in closed:
            for extra in self.buffer.on_closed(run):  # enough valid outcomes: the rest is surplus
                surplus.add(extra.id)
        for run in group.runs:
            if run.closed:
                continue
            if run.id in surplus or group.state != "open":
                run.status, run.valid, run.adopted = "cancelled", False, False  # its sandbox is swept
                self.wl.launch(run.tracked)
                self.wl.terminate(run.tracked)
            elif run.adopted and self.launcher is not None and self.launcher.adopting(run.id):
                self.adopting.append(run)
                redone += 1
            else:
                if run.adopted:  # no launcher to adopt it with: run again
                    run.id, run.adopted = redo_id(self.c.run_dir, run.id), False
                self.queue.append(run)
                redone += 1
        if surplus and group.state == "open":
            self.buffer.on_closed(closed[-1])  # all closed now: settle (ready)
        if any(r.id not in ev["runs"] for r in group.runs):
            self.journal(group)  # the new ids, for a later resume
        return restored, redone


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3f}"
