"""sim.py: a discrete-event simulator of the coordinator's scheduling on a virtual clock.

It is a driver of the run's own scheduler: after every event it builds a `schedule.State`
and carries out `schedule.decide`'s decisions, as the coordinator's tick does (the same
policies, launches, publications, role switches, joins and step starts, pause/resume
included). It models only what those decisions act on: executions on rollout capacity,
group readiness, a batch's micro-steps over its members, switch and publication times.
Not the coordinator: no I/O, no asyncio, no torch; times are hours.

Model choices (the ones that move the numbers):
- Rollout degrades with load. The proxy balances calls, so every serving cell carries the
  same load = running / serving slots (standalone pool included); an execution progresses
  at rate (1 + alpha) / (1 + alpha * load), alpha = `load_alpha` (0.3). Sampled durations
  are the durations on a full cell (load 1, the paper's operating point): a half-empty
  pool runs them up to 1.3x faster, and packing executions onto fewer cells slows them
  back down. Per-cell throughput still grows with load, so full cells are the efficient
  ones. If running ever exceeds the serving slots (a cell switching back is not serving
  yet) the surplus runs slower (load > 1); with no serving slot at all executions pause.
  Queued executions wait for a free slot: launches never exceed the serving slots.
- The harness deadline is wall clock: an execution ends at min(work done, launch + timeout).
- A cell leaving rollout stops serving at once; its executions continue on the others.
  A switching cell ("switching" in the timeline) neither serves nor trains; cells switch
  in parallel, and a joining satellite's weight pull is inside `switch_to_train_s`. The
  core's parameter broadcast between steps of a burst is taken as free.
- Training work of one step is `train_h_all * cells` cell-hours, split evenly over the B
  groups and into `micro_steps_per_group` micro-steps per group (at least ceil(k / B) with
  k cells training, as the packer cuts them); cells claim micro-steps as they free up, so
  k cells finish a step in about `train_h_all * cells / k` hours.
- Off by default, a host model (Workload.host_start_s, fitted by replay.py from real runs on
  one machine): k executions launched at one instant each take k * host_start_s more, their
  harnesses starting up on the same cores; independent GPU cells have none.
- A publication takes `publish_s` (30 s: the core broadcasts over RDMA; rollout engines
  keep serving and swap weights between calls); the next burst's dispatch follows it.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gyre.coordinator.policies import POLICIES, Snapshot
from gyre.coordinator.schedule import BatchView, Decisions, State, decide, dispatch_target, policy_snapshot, topup
from gyre.coordinator.waterlevel import ExecState, Waterlevel
from gyre.coordinator.workloads import PRESETS, SimError, Workload, duration_stats, sample_query, workload_from_metrics  # noqa: F401 - the workloads, re-exported for `gyre sim`'s users

ROLLOUT, TRAINING, SWITCHING = "rollout", "training", "switching"
Trace = Callable[[float, Snapshot, tuple[str, ...]], None]
_EPS_H = 1e-7  # work-hours tolerance of the shared progress clock (0.4 ms)


@dataclass
class SimResult:
    hours: float  # virtual wall time until the last optimizer update
    steps: int
    staleness_mean: float
    per_cell_training_share: list[float]
    role_timeline: list[tuple[float, int, str]]  # (t_hours, cell, rollout|training|switching)
    switches: int
    mean_waterlevel: float
    policy: str = ""
    phi: float = 0.0
    mu: int = 1
    async_training_cells: int | None = None
    step_hours: list[float] = field(default_factory=list)  # time of each optimizer update
    publication_hours: list[float] = field(default_factory=list)  # time each publication completed

    @property
    def cells(self) -> int:
        return 1 + max(c for _, c, _ in self.role_timeline)


class _Sim:
    """One run: an event heap of (t, seq, kind, arg), the modelled cluster, and the
    scheduler (schedule.py) asked after every event, as the coordinator's tick asks it."""

    def __init__(self, w: Workload, policy: str, phi: float, mu: int, seed: int, standalone: int,
                 async_cells: int | None, trace: Trace | None = None):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.spec = POLICIES[policy]
        if self.spec.fixed_split and not (async_cells is not None and 1 <= async_cells < w.cells):
            raise ValueError(f"{policy} needs 1 <= async_training_cells < {w.cells}, got {async_cells}")
        self.w, self.policy_name, self.phi, self.mu = w, policy, phi, mu
        self.async_cells, self.standalone, self.rng = async_cells, standalone, random.Random(seed)
        self.trace = trace
        self.t = 0.0
        self.heap: list = []
        self.seq = itertools.count()
        self.wl = Waterlevel()
        self.tracked: list = []  # per execution: (its Tracked in the counters, work hours at load 1)
        self.exec_group: list[int] = []
        self.queue: deque[int] = deque()
        self.vclock, self.rate, self.vheap, self.next_due = 0.0, 0.0, [], -1.0
        self.group_version: list[int] = []
        self.group_left: list[int] = []
        self.ready: list[tuple[int, int]] = []  # heap of (version at dispatch, group id)
        n = w.cells
        start = list(self.spec.initial_roles(n, async_cells or 1))
        self.roles, self.phase, self.busy = list(start), list(start), [False] * n
        self.timeline = [(0.0, c, r) for c, r in enumerate(start)]
        self.switches = 0
        self.version = self.trainer_version = self.steps_done = self.steps_in_burst = self.publications = 0
        self.step_in_flight = self.publishing = False
        self.members: list[int] = []  # the batch in flight's participants (a prefix)
        self.taken = self.unclaimed = self.outstanding = self.v_before = 0
        self.staleness: list[int] = []
        self.step_hours: list[float] = []
        self.publication_hours: list[float] = []
        self.decisions: list[tuple[float, State, Decisions]] = []  # kept when `record` is set
        self.record = False
        self.wl_area = 0.0
        self.group_h = w.train_h_all * w.cells / w.groups_per_step  # one group's training, in cell-hours
        self.pending_h: deque[float] = deque()  # the unclaimed micro-steps' hours, in order

    # --- clock, events ----------------------------------------------------------------

    def push(self, t: float, kind: str, arg: int = 0) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), kind, arg))

    def advance(self, t: float) -> None:
        dt = t - self.t
        self.wl_area += self.wl.c.waterlevel * dt
        self.vclock += self.rate * dt
        self.t = t

    def run(self, steps: int) -> None:
        handlers = {"exec": self.on_exec_due, "deadline": self.on_deadline, "micro": self.on_micro_done,
                    "switched": self.on_switched, "published": self.on_published}
        self.dispatch(dispatch_target(self.phi, self.mu, self.w.groups_per_step, 0))
        self.reconcile(steps)
        while self.steps_done < steps:
            if not self.heap:
                raise SimError(f"stalled at t={self.t:.3f} h after {self.steps_done} steps: {self.state(steps)}")
            t, _, kind, arg = heapq.heappop(self.heap)
            self.advance(t)
            handlers[kind](arg)
            self.reconcile(steps)
            if self.trace is not None:
                self.trace(self.t, self.snapshot(), tuple(self.phase))

    # --- executions -------------------------------------------------------------------

    def dispatch(self, groups: int) -> None:
        for _ in range(groups):
            gid = len(self.group_version)
            self.group_version.append(self.version)
            self.group_left.append(self.w.group_size)
            for work in sample_query(self.w, self.rng, gid):
                eid = len(self.tracked)
                self.tracked.append((self.wl.dispatch(1)[0], work))
                self.exec_group.append(gid)
                self.queue.append(eid)

    def serving_slots(self) -> int:
        return self.standalone + self.w.exec_slots_per_cell * self.phase.count(ROLLOUT)

    def launch(self, n: int) -> None:
        launched = []
        for _ in range(n):
            eid = self.queue.popleft()
            self.wl.launch(self.tracked[eid][0])
            launched.append(eid)
        # The host model: harnesses started together share its cores while they start up.
        start_h = self.w.host_start_s * len(launched) / 3600
        for eid in launched:
            work = self.tracked[eid][1]
            if math.isfinite(work):
                heapq.heappush(self.vheap, (self.vclock + work + start_h, eid))
            self.push(self.t + self.w.timeout_h, "deadline", eid)

    def finish(self, eid: int) -> None:
        self.wl.terminate(self.tracked[eid][0])
        g = self.exec_group[eid]
        self.group_left[g] -= 1
        if self.group_left[g] == 0:
            heapq.heappush(self.ready, (self.group_version[g], g))

    def running(self, eid: int) -> bool:
        return self.tracked[eid][0].state is ExecState.RUNNING

    def on_exec_due(self, _: int) -> None:
        while self.vheap and self.vheap[0][0] <= self.vclock + _EPS_H:
            _, eid = heapq.heappop(self.vheap)
            if self.running(eid):
                self.finish(eid)

    def on_deadline(self, eid: int) -> None:
        if self.running(eid):
            self.finish(eid)  # timed out; its entry in vheap is skipped later

    def reschedule_completion(self) -> None:
        """All running executions share one rate, so one event for the earliest finisher."""
        slots = self.serving_slots()
        load = self.wl.c.running / slots if slots else 0.0
        self.rate = (1 + self.w.load_alpha) / (1 + self.w.load_alpha * load) if slots else 0.0
        while self.vheap and not self.running(self.vheap[0][1]):
            heapq.heappop(self.vheap)
        if not self.vheap or self.rate == 0.0:
            self.next_due = -1.0  # whatever is pending finds nothing; the next rate pushes anew
            return
        due = self.t + max(0.0, self.vheap[0][0] - self.vclock) / self.rate
        if due != self.next_due:  # an event made stale by a rate change finds nothing due
            self.next_due = due
            self.push(due, "exec")

    # --- training (the model of training.py's Batch) ------------------------------------

    def start_step(self, cells: tuple[int, ...]) -> None:
        self.step_in_flight, self.taken, self.v_before = True, 0, self.trainer_version
        self.members = list(cells)

    def take_and_claim(self) -> None:
        """Streaming: take ready groups (oldest version first) up to B, then idle members
        in training claim micro-steps in cell order; the step ends once every micro-step is
        trained and every member trains (a paused member resumes first)."""
        if not self.step_in_flight:
            return
        while self.taken < self.w.groups_per_step and self.ready:
            version, _ = heapq.heappop(self.ready)
            self.staleness.append(self.v_before - version)
            self.taken += 1
            # As the packer cuts it (training.Batch): at least a micro-step per training cell over
            # the step's B groups, so none of them has nothing to claim.
            m = max(self.w.micro_steps_per_group, -(-len(self.members) // self.w.groups_per_step))
            self.pending_h.extend([self.group_h / m] * m)
            self.unclaimed += m
        for c in self.members:
            if self.unclaimed and self.phase[c] == TRAINING and not self.busy[c]:
                self.unclaimed -= 1
                self.outstanding += 1
                self.busy[c] = True
                self.push(self.t + self.pending_h.popleft(), "micro", c)
        trained = self.taken == self.w.groups_per_step and not self.unclaimed and not self.outstanding
        if trained and all(self.phase[c] == TRAINING for c in self.members):
            # The optimizer update (negligible time) closes the step.
            self.step_in_flight, self.members = False, []
            self.trainer_version += 1
            self.steps_done += 1
            self.steps_in_burst += 1
            self.step_hours.append(self.t)

    def on_micro_done(self, cell: int) -> None:
        self.busy[cell] = False
        self.outstanding -= 1

    def publish(self) -> None:
        self.publishing = True  # the core is held by the scheduler while weights move
        self.push(self.t + self.w.publish_s / 3600, "published")

    def on_published(self, _: int) -> None:
        self.publishing = False
        self.version, self.steps_in_burst = self.trainer_version, 0
        self.publications += 1
        self.publication_hours.append(self.t)
        self.dispatch(topup(self.phi, self.mu, self.w.groups_per_step, self.publications))

    # --- placement: the scheduler's decisions, carried out ------------------------------

    def state(self, steps: int) -> State:
        c, w = self.wl.c, self.w
        batch = None
        if self.step_in_flight:
            packed = self.taken == w.groups_per_step
            batch = BatchView(members=tuple(self.members), window_open=not packed or self.unclaimed > 0,
                              unclaimed=self.unclaimed + (0 if packed else 1),  # as training.Batch counts
                              pending=self.unclaimed > 0, packing_done=packed)
        return State(policy=self.policy_name, roles=tuple(self.roles), capacity=(w.exec_slots_per_cell,) * w.cells,
                     queued=c.queued, running=c.running, ready_groups=len(self.ready),
                     groups_per_step=w.groups_per_step, mu=self.mu, steps=steps, steps_done=self.steps_done,
                     steps_in_burst=self.steps_in_burst, async_training_cells=self.async_cells or 1,
                     switching=frozenset(i for i, p in enumerate(self.phase) if p == SWITCHING),
                     busy=frozenset(i for i, b in enumerate(self.busy) if b),
                     standalone=self.standalone, batch=batch, transfer=self.publishing)

    def snapshot(self) -> Snapshot:
        """The policy's view of every cell (for traces)."""
        return policy_snapshot(self.state(self.steps_done + 1), self.w.cells)

    def switch(self, cell: int, role: str) -> None:
        self.roles[cell], self.phase[cell] = role, SWITCHING
        self.switches += 1
        self.timeline.append((self.t, cell, SWITCHING))
        secs = self.w.switch_to_train_s if role == TRAINING else self.w.switch_to_rollout_s
        self.push(self.t + secs / 3600, "switched", cell)

    def on_switched(self, cell: int) -> None:
        self.phase[cell] = self.roles[cell]
        self.timeline.append((self.t, cell, self.roles[cell]))

    def reconcile(self, steps: int) -> None:
        """The coordinator's tick after every event, repeated until the scheduler has
        nothing more to do at this instant (the real tick repeats every 100 ms instead):
        e.g. a step starts, the batch takes the ready groups, then satellites may join."""
        for _ in range(8):
            self.take_and_claim()
            if self.steps_done >= steps:
                break
            s = self.state(steps)
            d = decide(s)
            if self.record:
                self.decisions.append((self.t, s, d))
            if not d:
                break
            self.launch(d.launch)
            if d.publish:
                self.publish()
            for cell, role in d.switches:
                self.switch(cell, role)
            self.members.extend(d.joins)
            if d.start_step:
                self.start_step(d.start_step)
        else:
            raise SimError(f"the scheduler did not settle at t={self.t:.3f} h: {self.state(steps)}")
        self.reschedule_completion()

    def result(self, steps: int) -> SimResult:
        hours = self.t
        share = [0.0] * self.w.cells
        last: dict[int, tuple[float, str]] = {}
        for t, c, role in [*self.timeline, *((hours, c, "end") for c in range(self.w.cells))]:
            if c in last and last[c][1] == TRAINING:
                share[c] += t - last[c][0]
            last[c] = (t, role)
        return SimResult(hours=hours, steps=steps, staleness_mean=sum(self.staleness) / max(1, len(self.staleness)),
                         per_cell_training_share=[s / hours if hours else 0.0 for s in share],
                         role_timeline=[(round(t, 6), c, r) for t, c, r in self.timeline], switches=self.switches,
                         mean_waterlevel=self.wl_area / hours if hours else 0.0, policy=self.policy_name,
                         phi=self.phi, mu=self.mu, async_training_cells=self.async_cells, step_hours=self.step_hours,
                         publication_hours=self.publication_hours)


def simulate(workload: Workload, *, policy: str, phi: float, mu: int, steps: int, seed: int, standalone: int = 0,
             async_training_cells: int | None = None, trace: Trace | None = None) -> SimResult:
    """Run `steps` optimizer steps of `policy` on `workload`; deterministic per seed.
    Async without a split uses `balanced_split(workload)`. `trace(t_hours, snapshot,
    phases)` is called after every event (phases: rollout | training | switching per cell)."""
    if mu < 1 or steps < 1 or phi < 0:
        raise ValueError("need mu >= 1, steps >= 1, phi >= 0")
    if POLICIES.get(policy) is not None and POLICIES[policy].fixed_split and async_training_cells is None:
        async_training_cells = balanced_split(workload)
    sim = _Sim(workload, policy, phi, mu, seed, standalone, async_training_cells, trace)
    sim.run(steps)
    return sim.result(steps)


def balanced_split(w: Workload) -> int:
    """The async split whose training and rollout cell-hours per step are closest to even."""
    mean_h = duration_stats(w, queries=500, seed=0)["mean_exec_h"]
    rollout = w.groups_per_step * w.group_size * mean_h / w.exec_slots_per_cell
    train = w.train_h_all * w.cells
    return min(range(1, w.cells), key=lambda t: max(train / t, rollout / (w.cells - t)))


def matched_settings(ed: float) -> dict[str, tuple[float, int]]:
    """The paper's (phi, mu) per policy at mean staleness E[d] = phi + (mu - 1)/2. Async:
    mu=1, phi=ed. Colocate: the largest burst that fits, mu = floor(2 ed) + 1, the rest as
    phi (0 when 2 ed is whole). Elastic: bursts of at most 3 (the paper's choice), the rest
    as phi. At 1.5 this is the paper's (1.5, 1), (0, 4), (0.5, 3). `compare` searches
    `matched_pairs` instead."""
    if ed < 0:
        raise ValueError(f"ed must be >= 0, got {ed}")
    mu_c = math.floor(2 * ed + 1e-9) + 1
    mu_e = min(3, mu_c)
    return {"elastic": (ed - (mu_e - 1) / 2, mu_e), "async": (float(ed), 1), "async-streaming": (float(ed), 1),
            "colocate": (ed - (mu_c - 1) / 2, mu_c)}


def matched_pairs(ed: float) -> list[tuple[float, int]]:
    """Every (phi, mu) with phi + (mu - 1)/2 = ed and phi >= 0: mu = 1 .. floor(2 ed) + 1."""
    if ed < 0:
        raise ValueError(f"ed must be >= 0, got {ed}")
    return [(max(0.0, ed - (mu - 1) / 2), mu) for mu in range(1, math.floor(2 * ed + 1e-9) + 2)]


def _runs(w: Workload, policy: str, phi: float, mu: int, steps: int, seeds: list[int], standalone: int,
          t: int | None = None) -> dict:
    rs = [simulate(w, policy=policy, phi=phi, mu=mu, steps=steps, seed=s, standalone=standalone,
                   async_training_cells=t) for s in seeds]
    n = len(rs)
    out = {"hours": sum(r.hours for r in rs) / n, "hours_by_seed": [r.hours for r in rs], "phi": phi, "mu": mu,
           "staleness_mean": sum(r.staleness_mean for r in rs) / n,
           "training_share": [sum(col) / n for col in zip(*(r.per_cell_training_share for r in rs))]}
    if t is not None:
        out["training_cells"] = t
    return out


def _best(w: Workload, policy: str, ed: float, steps: int, seeds: list[int], standalone: int) -> dict:
    """The fastest setting of `policy` at E[d] = ed over `matched_pairs` (and, for a fixed
    split, over training_cells 1..cells-1: the split is searched at the best (phi, mu), then
    (phi, mu) again at the best split, until neither moves); `tried` lists every run."""
    tried: dict[tuple, dict] = {}

    def run(pair: tuple[float, int], t: int | None) -> dict:
        if (pair, t) not in tried:
            tried[(pair, t)] = _runs(w, policy, *pair, steps, seeds, standalone, t)
        return tried[(pair, t)]

    pairs = matched_pairs(ed)
    if not POLICIES[policy].fixed_split:
        best = min((run(p, None) for p in pairs), key=lambda r: r["hours"])
    else:
        t, pair = balanced_split(w), None
        for _ in range(w.cells):  # hours never rise from one round to the next; ties could cycle
            new_pair = min(pairs, key=lambda p: run(p, t)["hours"])
            new_t = min(range(1, w.cells), key=lambda c: run(new_pair, c)["hours"])
            if (new_pair, new_t) == (pair, t):
                break
            pair, t = new_pair, new_t
        best = run(pair, t)
    ranked = sorted(tried.values(), key=lambda r: r["hours"])
    return {**best, "tried": [{k: r[k] for k in ("phi", "mu", "training_cells", "hours") if k in r} for r in ranked]}


def compare(workload: Workload, *, ed: float = 1.5, steps: int, seeds: list[int], standalone: int = 0) -> dict:
    """Every policy at matched E[d], each at its best (phi, mu) (and split, for the fixed
    splits), mean over seeds; speedups of elastic over each: `async` is the paper's Async
    baseline (non-streaming), `async-streaming` its A3 ablation (a step from one ready group)."""
    out = {p: _best(workload, p, ed, steps, seeds, standalone) for p in ("elastic", "async", "async-streaming",
                                                                        "colocate")}
    el = out["elastic"]["hours"]
    return {"workload": workload.name, "ed": ed, "steps": steps, "seeds": list(seeds), "policies": out,
            "speedup": {"vs_async": out["async"]["hours"] / el,
                        "vs_async_streaming": out["async-streaming"]["hours"] / el,
                        "vs_colocate": out["colocate"]["hours"] / el}}
