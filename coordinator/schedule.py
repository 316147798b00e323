"""schedule.py: the scheduler's decisions for one tick, a pure function of a snapshot.

Runs (main.py: a 100 ms tick over live workers) and `gyre sim` (sim.py: after every
simulated event) are thin drivers over `decide`: each builds a `State` from what it holds,
carries out the `Decisions` and owns none of the rules. No I/O, no clock, no asyncio.

The rules, in the order `decide` applies them:
1. Launch: queued executions start while the serving slots (rollout cells that are not
   switching or dead, plus a standalone pool) exceed the running ones, until the last step.
2. Publish at burst end (mu steps done, or the last step) once no step is in flight, no
   weights are moving and the core is not switching.
3. Roles: the policy (policies.py) over the trainable prefix (alive cells in the reducer's
   world, 0..k-1); every other live cell rolls out, a dead cell keeps its role. Training
   cells stay a prefix: a cell after a rollout cell goes back (a cell still switching or
   busy can leave a gap for a moment; nothing trains across it). A batch in flight that
   starves with no other cell rolling out pauses its members in rollout and resumes them
   once there is work and room. A cell that is switching, busy (mid micro-step) or the
   core while weights move keeps its role until it is free; every other cell whose target
   differs switches now, in parallel.
4. Joins: settled training cells next in prefix order join the batch in flight while its
   window is open.
5. A step starts on the settled training prefix once nothing in it is still switching to
   training and the policy's readiness holds (a full batch, or one ready group).
6. Held-out evaluations (never trained, outside the waterlevel the policies see) take the
   serving slots training executions leave free, also after the last step; while any is
   left then, every live cell rolls out, and the run is done only once they are too.
7. Done: the last step is trained and published, nothing in flight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gyre.coordinator.policies import POLICIES, PolicySpec, Snapshot

ROLLOUT, TRAINING = "rollout", "training"


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchView:
    """The batch in flight as the scheduler sees it."""

    members: tuple[int, ...]  # participants and cells joining: a prefix 0..m-1
    window_open: bool  # it still takes new participants
    unclaimed: int  # micro-steps not yet claimed (+1 while groups are still to be packed)
    pending: bool  # packed micro-steps wait to be claimed
    packing_done: bool  # all of its groups are packed


@dataclass(frozen=True, slots=True, kw_only=True)
class State:
    policy: str
    roles: tuple[str, ...]  # per cell: the role it holds, or is switching to
    capacity: tuple[int, ...]  # per cell: concurrent executions it serves in rollout
    queued: int  # executions dispatched, not launched
    running: int  # executions launched, not closed
    ready_groups: int  # ready groups not yet taken by a batch
    groups_per_step: int  # B
    mu: int
    steps: int  # the run's optimizer steps
    steps_done: int
    steps_in_burst: int  # optimizer steps since the last publication
    async_training_cells: int = 1
    switching: frozenset[int] = frozenset()  # cells whose role change has not completed
    busy: frozenset[int] = frozenset()  # cells that cannot switch now (a micro-step in progress)
    dead: frozenset[int] = frozenset()
    no_reducer: frozenset[int] = frozenset()  # rejoined cells: rollout only, outside the reducer's world
    standalone: int = 0  # executions a never-training rollout pool serves
    batch: BatchView | None = None
    transfer: bool = False  # weights are moving (a publication or a rejoin)
    eval_queued: int = 0  # held-out evaluation executions waiting for a slot
    eval_running: int = 0

    @property
    def cells(self) -> int:
        return len(self.roles)

    @property
    def spec(self) -> PolicySpec:
        return POLICIES[self.policy]


@dataclass(frozen=True, slots=True)
class Decisions:
    launch: int = 0  # queued executions to start now
    launch_eval: int = 0  # queued evaluation executions to start now
    publish: bool = False
    switches: tuple[tuple[int, str], ...] = ()  # (cell, role) changes to start now
    joins: tuple[int, ...] = ()  # cells that join the batch in flight, in order
    start_step: tuple[int, ...] = ()  # participants of a new step (empty: none starts)
    done: bool = False

    def __bool__(self) -> bool:  # anything to carry out
        return bool(self.launch or self.launch_eval or self.publish or self.switches or self.joins or self.start_step)


def decide(s: State) -> Decisions:
    publish = _publish(s)
    k = trainable(s)
    want = target_roles(s, k)
    evals = s.eval_queued + s.eval_running
    if evals and s.steps_done >= s.steps:  # training is over: every live cell serves the evaluations
        want = [r if c in s.dead else ROLLOUT for c, r in enumerate(s.roles)]
    held = s.switching | s.busy | s.dead | ({0} if s.transfer or publish else set())
    switches = tuple((c, r) for c, r in enumerate(want) if r != s.roles[c] and c not in held)
    start = () if publish else _start(s, want, k)
    done = (s.steps_done >= s.steps and s.batch is None and not s.transfer and not publish
            and not s.switching and not evals)
    launch = _launch(s)
    return Decisions(launch=launch, launch_eval=_launch_eval(s, launch), publish=publish, switches=switches,
                     joins=_joins(s, want, k), start_step=start, done=done)


def trainable(s: State) -> int:
    """Cells 0..k-1 that may train: alive and in the reducer's world, as a prefix (the
    prefix process groups need it). Cells after a gap roll out only."""
    k, n, out = 0, len(s.roles), s.dead | s.no_reducer
    while k < n and k not in out:
        k += 1
    return k


def serving_slots(s: State) -> int:
    return s.standalone + sum(cap for c, (cap, r) in enumerate(zip(s.capacity, s.roles))
                              if r == ROLLOUT and c not in s.switching and c not in s.dead)


def policy_snapshot(s: State, k: int) -> Snapshot:
    """The policy's view of cells 0..k-1; live rollout cells outside them count as a
    standalone pool."""
    b = s.batch
    outside = sum(s.capacity[c] for c in range(k, s.cells) if c not in s.dead)
    return Snapshot(roles=s.roles[:k], queued=s.queued, running=s.running, ready_groups=s.ready_groups,
                    groups_per_step=s.groups_per_step, mu=s.mu, steps_in_burst=s.steps_in_burst,
                    step_in_flight=b is not None, async_training_cells=s.async_training_cells,
                    capacity=s.capacity[:k], standalone=s.standalone + outside,
                    window_open=b.window_open if b else False, unclaimed=b.unclaimed if b else 0)


def target_roles(s: State, k: int | None = None) -> list[str]:
    k = trainable(s) if k is None else k
    want = list(s.spec.roles(policy_snapshot(s, k))) if k else []
    for cell in range(k, s.cells):
        want.append(s.roles[cell] if cell in s.dead else ROLLOUT)
    _pause_or_resume(s, want, k)
    if ROLLOUT in want[:k]:  # training cells stay a prefix
        first = want.index(ROLLOUT)
        want[first:k] = [ROLLOUT] * (k - first)
    return want


def _pause_or_resume(s: State, want: list[str], k: int) -> None:
    """A batch in flight that waits for groups while no live cell rolls out would wait
    forever (a rollout cell died, or replacements of dropped groups need rollout): its
    members pause in rollout, keeping their accumulated gradients, and resume once there
    is something to train and the other rollout cells cover the waterlevel."""
    b = s.batch
    if b is None or not b.members:
        return
    members = {c for c in b.members if c < k}  # (a member that died has stopped the step)
    if not members:
        return
    level = s.queued + s.running
    others = s.standalone + sum(s.capacity[c] for c, r in enumerate(want)
                                if r == ROLLOUT and c not in s.dead and c not in members)
    if not all(s.roles[c] == ROLLOUT for c in members):  # not paused
        starving = not b.packing_done and not b.pending and level > 0
        if starving and others == 0:
            for c in members:
                want[c] = ROLLOUT
        return
    resume = (b.pending or b.packing_done) and others >= level
    for c in members:
        want[c] = TRAINING if resume else ROLLOUT


def _launch(s: State) -> int:
    if s.steps_done >= s.steps:
        return 0
    return min(s.queued, max(0, serving_slots(s) - s.running - s.eval_running))


def _launch_eval(s: State, launch: int) -> int:
    free = serving_slots(s) - s.running - launch - s.eval_running
    return min(s.eval_queued, max(0, free))


def _publish(s: State) -> bool:
    burst_done = s.steps_in_burst >= s.mu or (s.steps_done >= s.steps and s.steps_in_burst > 0)
    return burst_done and s.batch is None and not s.transfer and 0 not in s.switching


def _settled_training(s: State, want: list[str], cell: int) -> bool:
    return (s.roles[cell] == TRAINING and want[cell] == TRAINING and cell not in s.switching
            and cell not in s.dead)


def _start(s: State, want: list[str], k: int) -> tuple[int, ...]:
    if s.batch is not None or s.transfer or s.steps_done >= s.steps or s.steps_in_burst >= s.mu:
        return ()
    if any(c in s.switching and s.roles[c] == TRAINING for c in range(k)):
        return ()  # the prefix is still gathering: the step starts with all of it
    cells = []
    for c in range(k):
        if not _settled_training(s, want, c):
            break
        cells.append(c)
    if not cells or s.ready_groups < s.spec.groups_to_start(s.groups_per_step):
        return ()
    return tuple(cells)


def _joins(s: State, want: list[str], k: int) -> tuple[int, ...]:
    b = s.batch
    if b is None or not b.window_open:
        return ()
    c, out = len(b.members), []
    while c < k and _settled_training(s, want, c):
        out.append(c)
        c += 1
    return tuple(out)


def dispatch_target(phi: float, mu: int, groups_per_step: int, publications: int) -> int:
    """Groups dispatched in total once `publications` publications are done (0: the initial
    fill of (phi + mu) * B): boundary dispatch keeps phi + mu batches in the pipeline."""
    return math.floor((phi + mu * (1 + publications)) * groups_per_step + 1e-9)


def topup(phi: float, mu: int, groups_per_step: int, publications: int) -> int:
    """Groups to dispatch when publication number `publications` (1, 2, ...) completes."""
    return (dispatch_target(phi, mu, groups_per_step, publications)
            - dispatch_target(phi, mu, groups_per_step, publications - 1))
