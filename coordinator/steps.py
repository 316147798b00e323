"""steps.py: `Steps`, the owner of training's progress: versions, steps, bursts, publications.

It holds the published policy version and the core trainer's, the steps done (in all and in
the current burst), the publications, the batch in flight with its task and the cells joining
it, each step's report, the tokens trained and the step of the newest checkpoint. It runs a
step (level the participants, train the batch, report), lets a cell join the batch in flight,
publishes the core's weights to every engine (then dispatches the next groups, a held-out
round, a checkpoint), and settles the step in flight at shutdown. Not the scheduler (it says
when), not the batch's packing and micro-steps (training.py), not the checkpoint's files
(resume.py) and not the weights' transport (publisher.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from gyre.coordinator import failpoints
from gyre.coordinator.buffer import TrajectoryBuffer
from gyre.coordinator.cells import Cells
from gyre.coordinator.config import CoordinatorConfig
from gyre.coordinator.diagnosis import diagnose, why
from gyre.coordinator.executions import Executions
from gyre.coordinator.heldout import HeldOut
from gyre.coordinator.publisher import memcpy_seconds
from gyre.coordinator.report import StepReport, equal_rewards, prefill_of
from gyre.coordinator.schedule import topup
from gyre.coordinator.training import Batch
from gyre.coordinator.waterlevel import Waterlevel
from gyre.workerd import wire

log = logging.getLogger("gyre.coordinator")


class Steps:
    def __init__(self, config: CoordinatorConfig, *, buffer: TrajectoryBuffer, wl: Waterlevel, cells: Cells,
                 executions: Executions, heldout: HeldOut | None, probe: Any,
                 checkpoint: Callable[[], Awaitable[None]], on_step: Callable[[StepReport], None] | None = None):
        self.c = config
        self.buffer, self.wl, self.cells, self.executions, self.heldout = buffer, wl, cells, executions, heldout
        self.probe = probe  # the loop's lateness, read over each step
        self.checkpoint = checkpoint  # a checkpoint of the whole run (resume.Checkpoints.save)
        self.on_step = on_step
        self.version = 0  # published policy version
        self.trainer_version = 0
        self.steps_done = 0
        self.steps_in_burst = 0
        self.publications = 0
        self.step_task: asyncio.Task | None = None
        self.batch: Batch | None = None
        self.join_tasks: dict[int, asyncio.Task] = {}  # cells joining the batch in flight
        self.step_began = 0.0  # the loop probe's time at the step's start (its loop lag)
        self.train_busy_s: dict[int, float] = {}  # per cell: seconds in micro-steps and updates
        self.reports: list[StepReport] = []
        self.tokens_trained = 0
        self.checkpointed_step: int | None = None  # the step of the newest checkpoint, None before one
        # Set at start-up (main.py): the workers, the weights' mover and the journal.
        self.link: Any = None
        self.weights: Any = None
        self.metrics: Any = None

    def in_flight(self) -> Batch | None:
        """The batch of the step under way, None between steps (the live view, release_done)."""
        task = self.step_task
        return self.batch if task is not None and not task.done() else None

    def training(self, cell: int) -> bool:
        """The cell trains in the step in flight now (its death stops the run)."""
        batch = self.in_flight()
        return batch is not None and cell in batch.participants

    # --- a step -------------------------------------------------------------------------

    def start(self, cells: list[int]) -> None:
        self.step_task = asyncio.create_task(self._step(cells), name="gyre-step")

    def start_join(self, cell: int) -> None:
        self.join_tasks[cell] = asyncio.create_task(self._join(cell), name=f"gyre-join-{cell}")

    def new_batch(self, cells: list[int]) -> Batch:
        return Batch(cells, link=self.link, nodes=self.cells.nodes, buffer=self.buffer, config=self.c,
                     changed=self.executions.changed, trains=self._trains, step=self.steps_done,
                     train_busy_s=self.train_busy_s)

    def _trains(self, cell: int) -> bool:
        return self.cells.roles[cell] == "training" and self.cells.settled(cell)

    async def level(self, cells: list[int]) -> int:
        """The core's current weights to those of `cells` whose trainers are behind it."""
        return await self.weights.level(cells, self.trainer_version)

    async def _step(self, cells: list[int]) -> None:
        t0 = time.monotonic()
        self.step_began = self.probe.now()
        if cells != list(range(len(cells))):
            raise RuntimeError(f"training cells {cells} are not a prefix 0..k-1 (prefix groups)")
        self.batch = self.new_batch(cells)
        await self.level(cells)  # a cell that trained no step of this burst yet starts level
        await self.weights.prepare(self.trainer_version)  # while the core is idle: joins pull from there
        res = await self.batch.run()
        version_before = self.trainer_version
        if res.version is not None:  # None: nothing trained, no update applied
            self.trainer_version = res.version
        self.steps_done += 1
        self.steps_in_burst += 1
        satellites = [c for c in res.participants if c != 0]
        if satellites and self.steps_in_burst < self.c.mu:  # they train the next step of the burst too
            await self.level(satellites)
        self._report(res.groups, res.executions, res.results, version_before, len(res.participants),
                     time.monotonic() - t0, res.tokens, trained=res.version is not None, claimed=res.claimed,
                     started=None if res.first_claim is None else res.first_claim - t0)

    async def _join(self, cell: int) -> None:
        """A training cell joins the batch in flight: the core's (fixed) weights first, if
        its trainer is behind, then it claims micro-steps."""
        t0 = time.monotonic()
        try:
            nbytes = await self.level([cell])
            if not self.link.nodes[self.cells.nodes[cell]].alive:
                return  # died while pulling: never a participant
            joined = self.batch.join(cell)
            self.metrics.emit("join", cell=cell, joined=joined, seconds=round(time.monotonic() - t0, 4),
                              bytes=nbytes, step=self.steps_done + 1)
        finally:
            self.join_tasks.pop(cell, None)

    def _report(self, groups, executions, results, version_before, n_cells, seconds, packed, *,
                trained: bool, claimed: dict[int, int], started: float | None) -> None:
        """A step done: its report (the `on_step` callback, the step line) and its `step` event
        (with the diagnosis: diagnosis.py), whether it trained anything or not. `claimed`: each
        cell's micro-steps; `started`: seconds from the step's start to its first micro-step
        (None: none was trained)."""
        runs = [r for g in groups for r in g.runs if r.status != "cancelled"]
        valid = [r.reward for r in runs if r.valid and r.reward is not None]
        staleness = [version_before - g.version for g in groups]
        diag = diagnose(groups)
        # A step that trained says which groups added nothing; one that trained nothing, why.
        note = why(diag, len(groups), calls=not trained)
        if not trained:
            note = f"nothing trained: {note or 'no group added a token'}; no weights published"
        rep = StepReport(step=self.steps_done, version=self.trainer_version,
                         reward_mean=sum(valid) / len(valid) if valid else None,
                         reward_valid_frac=len(valid) / len(runs) if runs else None,
                         staleness_mean=sum(staleness) / len(staleness), groups=len(groups),
                         executions=executions, tokens_trained=sum(r.tokens for r in results),
                         cells_training=n_cells, loss=sum(r.loss for r in results), seconds=round(seconds, 3),
                         equal_reward_groups=sum(equal_rewards(g) for g in groups), trained=trained,
                         diagnosis=diag, note=note)
        self.reports.append(rep)
        self.tokens_trained += rep.tokens_trained
        # Engine/trainer gap over the step's targets (token-weighted mean of b - l): near zero
        # when the engines run the trainer's weights; a health signal for GPU backends.
        tokens = sum(r.tokens for r in results)
        mismatch = sum(r.mismatch_kl * r.tokens for r in results) / tokens if tokens else None
        prefill, cached = prefill_of(runs)
        counters = self.wl.c
        fields = {k: v for k, v in rep.__dict__.items() if k != "diagnosis"}
        self.metrics.emit("step", **fields, **diag, mismatch=mismatch, staleness=staleness,
                          group_ids=[g.id for g in groups], prefill_tokens=prefill, cached_tokens=cached,
                          # The forward pass: tokens computed, unique admitted (each tree node on
                          # an admitted path once), path-expanded, and the trainers' seconds.
                          packing=self.c.packing, forward_tokens=packed.forward,
                          unique_admitted_tokens=packed.unique, expanded_tokens=packed.expanded,
                          trainer_seconds=round(sum(r.seconds for r in results), 4),
                          # Micro-steps trained, and claimed by each cell (a cell in a step with
                          # fewer micro-steps than training cells claims none: idle by construction);
                          # when the first was claimed (a streaming step waits for ready groups first).
                          micro_steps=len(results),
                          micro_steps_by_cell=[claimed.get(i, 0) for i in range(self.c.cells)],
                          training_started_s=None if started is None else round(started, 4),
                          loop_lag_ms=self.probe.lag_ms(since=self.step_began),
                          cache_hit_rate=None if prefill is None or not prefill + cached
                          else round(cached / (prefill + cached), 4),
                          waterlevel=counters.waterlevel,
                          counters={"d": counters.d, "p": counters.p, "f": counters.f},
                          statuses=dict(self.executions.status_counts))
        if self.on_step is not None:
            self.on_step(rep)

    # --- publication --------------------------------------------------------------------

    async def publish(self) -> None:
        """The core's weights to every engine: its own engine copies its trainer; the other
        cells get the core's export (engines and trainers, so a later join starts level)."""
        t0 = time.monotonic()
        version = self.trainer_version
        nodes = self.cells.nodes
        others = [i for i in range(1, len(nodes)) if i not in self.cells.dead]
        unchanged = version == self.version  # no update since the engines' version: nothing to send
        if unchanged:
            nbytes = await self.weights.unchanged([0, *others], version)
        else:
            await self.link.request(nodes[0], wire.LoadWeights(version=version))
            await failpoints.hold("publication", self.c.run_dir)
            nbytes = await self.weights.push(others, engine=True, version=version)
        self.version = version
        self.steps_in_burst = 0
        self.publications += 1
        self.metrics.emit("publish", version=version, seconds=round(time.monotonic() - t0, 4), bytes=nbytes,
                          engines=len(nodes), unchanged=unchanged,
                          transfer=(self.weights.last_transfer if nbytes else None) or self.c.weight_transfer,
                          memcpy_seconds=round(memcpy_seconds(nbytes), 5) if nbytes else None)
        if self.steps_done < self.c.steps:
            self.executions.dispatch(topup(self.c.phi, self.c.mu, self.c.groups_per_step, self.publications))
        if self.heldout is not None and self.steps_done % self.c.eval_every == 0:
            self.heldout.dispatch(step=self.steps_done, version=version)  # the version just published
        if self.c.checkpoint_every and self.steps_done % self.c.checkpoint_every == 0 and self.steps_done:
            await self.checkpoint()

    # --- the stop -----------------------------------------------------------------------

    async def settle(self) -> None:
        """The step in flight at shutdown: one whose optimizer update was sent completes (the
        workers apply it whatever we do, so the count must follow); any other is cancelled and
        its groups go back to the buffer, untrained."""
        task, batch = self.step_task, self.batch
        if task is None or task.done():
            return
        if batch is not None and batch.applying:
            try:
                await asyncio.wait_for(asyncio.shield(task), self.c.worker_call_timeout_s)
                return
            except Exception as e:  # noqa: BLE001 - reported; the run is ending either way
                log.warning("the step in flight at shutdown did not complete: %s", e)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        if batch is not None:
            self.buffer.untake(batch.taken)
