"""main.py: the coordinator: startup -> run (a 100 ms tick) -> shutdown, in one event loop.

It owns the waterlevel counters, the dispatch queue, the trajectory buffer, the cells'
roles and the proxy. Each tick reads them into a `schedule.State`, asks `schedule.decide`
(the rules live there, shared with `gyre sim`) and carries the decisions out: launch
queued executions, start a publication, start each cell's role switch (in parallel),
let cells join the batch in flight, start a step; the run ends when the scheduler says
it is done. Long operations run as tasks the tick starts and watches; an exception in
any of them ends the run (a half-alive coordinator is worse than a restart). Not the
scheduling rules, the workers' logic or the proxy's: all three are driven through their
interfaces.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from collections import deque
from dataclasses import dataclass

from gyre.coordinator import health, resume
from gyre.coordinator.buffer import Execution, Group, TrajectoryBuffer
from gyre.coordinator.config import CoordinatorConfig
from gyre.coordinator.gcpolicy import GcPolicy
from gyre.coordinator.launcher import Launcher, launch_spec, open_sandboxes
from gyre.coordinator.link import WorkerCallTimeout, WorkerDeadError, WorkerError
from gyre.coordinator.local import LocalCluster
from gyre.coordinator.loopprobe import LoopProbe
from gyre.coordinator.metrics import Metrics
from gyre.coordinator.policies import POLICIES
from gyre.coordinator.preflight import start_proxy
from gyre.coordinator.publisher import WeightPublisher, memcpy_seconds
from gyre.coordinator.routing import LinkBackend, RoutingTable
from gyre.coordinator.sandbox import SandboxError
from gyre.coordinator.schedule import BatchView, State, decide, topup
from gyre.coordinator.status import Rates, snapshot
from gyre.coordinator.taskformats import load_task_source
from gyre.coordinator.tasks import TaskSource, default_tasks
from gyre.coordinator.training import Batch
from gyre.coordinator.waterlevel import Waterlevel
from gyre.proxy.chat import ChatTokenizer
from gyre.proxy.server import ProxyConfig, ProxyServer
from gyre.workerd import wire
from gyre.workerd.wire import GyreError

log = logging.getLogger("gyre.coordinator")
# bench/scale.py, SmolLM2's tokenizer, 128 executions, a step packed while serving: loop lag
# while packing p99 / max 32.3 / 32.3 ms at 5 ms, 21.3 / 22.8 ms at 0.5 ms.
SWITCH_INTERVAL_S = 0.0005
TICK_S = 0.1


@dataclass
class StepReport:
    step: int
    version: int
    reward_mean: float | None
    reward_valid_frac: float | None
    staleness_mean: float
    groups: int
    executions: int
    tokens_trained: int
    cells_training: int
    loss: float
    seconds: float
    # Groups whose valid rewards were all equal: group-relative advantages are zero, so
    # they train nothing (a run of such steps learns nothing; the reward needs spread).
    equal_reward_groups: int = 0



class InfraFailures(GyreError):
    """Executions keep failing before the agent's work could be assessed: the run stops."""

class Coordinator:
    def __init__(self, config: CoordinatorConfig, *, on_step=None, resume: bool = False):
        from gyre.coordinator.runconfig import with_model_defaults

        self.c = config = with_model_defaults(config)  # lr, output limits, context: per model
        self.resume = resume  # continue RUN_DIR from its latest checkpoint (resume.py)
        tasks = load_task_source(config.tasks_path) if config.tasks_path else default_tasks()
        self.tasks = TaskSource(tasks, seed=config.seed)
        self.spec = POLICIES[config.policy]
        self.wl = Waterlevel()
        self.buffer = TrajectoryBuffer(config.min_valid)
        self.queue: deque[Execution] = deque()
        self.runs: dict[str, asyncio.Task] = {}
        self.roles = list(self.spec.initial_roles(config.cells, config.async_training_cells))
        self.version = 0  # published policy version
        self.trainer_version = 0
        self.steps_done = 0
        self.steps_in_burst = 0
        self.publications = 0
        self.groups_dispatched = 0
        self.replacements = 0  # groups dispatched for dropped ones, beyond the boundary schedule
        self.step_task: asyncio.Task | None = None
        self.batch: Batch | None = None
        self.side_task: asyncio.Task | None = None  # a publication or a rejoin: weights on the move
        self.switch_tasks: dict[int, asyncio.Task] = {}  # per cell: its role change (the last one)
        self.join_tasks: dict[int, asyncio.Task] = {}  # cells joining the batch in flight
        self.changed = asyncio.Event()  # a run closed (the streaming packer waits on it)
        self.infra_streak = 0  # executions in a row that ended aborted_infra
        self.fatal: Exception | None = None  # raised by the next tick: the run cannot go on
        self.status_counts: dict[str, int] = {}
        self.train_busy_s: dict[int, float] = {}  # per cell: seconds in micro-steps and updates
        self.reports: list[StepReport] = []
        self.on_step = on_step
        self.metrics: Metrics | None = None
        self.should_exit = False  # set by SIGINT/SIGTERM: stop at the next tick, gracefully
        self.role_history: list[list[tuple[float, str]]] = [[(0.0, r)] for r in self.roles]  # per cell
        self.role_switches: list[dict] = []
        self.rates = Rates()
        self.probe = LoopProbe()  # the event loop's lateness: every harness call waits on it
        self.gc = GcPolicy(config.gc_freeze_every_s)  # long-lived objects out of full collections
        self.tokens_trained = 0
        self.dead: set[int] = set()  # cells whose worker died; excluded until a worker re-registers
        self.no_reducer: set[int] = set()  # rejoined cells: they roll out, they cannot reduce gradients
        self._rejoins: dict[int, str] = {}  # dead cell -> the ready replacement node, not yet brought in
        self.cluster: LocalCluster | None = None
        # Set once the run starts (run, _startup): the workers, routes, proxy and sandboxes.
        self.link = None  # the cluster's WorkerLink
        self.weights: WeightPublisher | None = None  # the core's weights to the other cells
        self.nodes: list[str] = []  # per cell: its node id
        self.table: RoutingTable | None = None
        self.proxy: ProxyServer | None = None
        self.sandboxes = None  # the sandbox host pool (launcher.open_sandboxes)
        self.launcher: Launcher | None = None
        self._checkpoint_dir = self._state = self._journal = None  # resume: what resume.latest found
        self.held: deque[dict] = deque()  # resume: journaled groups to dispatch again later (resume.py)
        self.checkpointed_step: int | None = None  # the step of the newest checkpoint, None before one
        self.stop_signal: int | None = None  # the signal that stopped the run (SIGINT, SIGTERM)
        self.peak_rss: list[int | None] = []  # per cell, read from the workers at shutdown

    def status(self) -> dict:
        """The live view's data (GET /gyre/status, `gyre top`)."""
        return snapshot(self)

    # --- lifecycle ----------------------------------------------------------------------

    async def run(self) -> list[StepReport]:
        c = self.c
        preset = c.preset()
        if preset.executable() is None:  # before anything starts: no run of placeholder zeros
            hint = f"; install: {preset.install}" if preset.install else ""
            raise GyreError(f"harness {preset.name!r}: {preset.command[0]!r} is not on PATH{hint}")
        if c.weight_transfer == "mooncake" and c.keys_dir is not None:
            log.warning("weight_transfer = mooncake with CURVE keys: Mooncake's transfer engine listens on every "
                        "interface without authentication; keep it on a private network")
        c.run_dir.mkdir(parents=True, exist_ok=True)
        t0 = None
        if self.resume:
            self._checkpoint_dir, self._state = resume.latest(c.run_dir)  # fails before anything starts
            self._journal = resume.read_journal(c.run_dir)
            t0 = time.monotonic() - self._journal[2]  # times continue from the journal's last
        (c.run_dir / "config.json").write_text(json.dumps(c.to_json(), indent=2))
        self.metrics = Metrics(c.run_dir / "metrics.jsonl", t0=t0)
        cluster = LocalCluster(c.model_dir, cells=c.cells, roles=tuple(self.roles), address=c.address,
                               trainer={"lr": c.lr, "temperature": c.rollout_temperature,
                                        "micro_step_tokens": c.micro_step_tokens, **c.trainer_options},
                               log_dir=c.run_dir / "logs",
                               engine={"seed": c.seed, "max_running": c.engine_max_running,
                                       "prefix_cache_mb": c.prefix_cache_mb, **c.engine_options},
                               backends=(c.engine_backend, c.trainer_backend),
                               keys_dir=c.keys_dir, spawn=c.workers == "local", call_timeout_s=c.worker_call_timeout_s,
                               start_timeout_s=c.topology_timeout_s if c.workers == "external" else 120.0)
        self._install_signal_handlers()
        cluster.on_rejoin = self._on_rejoin
        async with cluster:
            self.cluster = cluster
            self.link = cluster.link
            self.nodes = [cluster.node_of_cell(i) for i in range(c.cells)]
            self.weights = WeightPublisher(c, self.link, self.nodes, cluster, self.dead)
            await self._startup()
            ended = False
            try:
                while not await self.tick():
                    await asyncio.sleep(TICK_S)
                ended = True
            finally:
                await self._shutdown(save=ended or isinstance(self.fatal, InfraFailures))
                self._summary()
        self.metrics.close()
        return self.reports

    def _install_signal_handlers(self) -> None:
        """First SIGINT/SIGTERM: finish gracefully at the next tick. Second SIGINT: exit now."""
        import os
        import signal

        loop = asyncio.get_running_loop()

        def on_signal(sig: int) -> None:
            if self.should_exit and sig == signal.SIGINT:
                if os.isatty(1):  # os._exit skips the live view's cleanup: show the cursor again
                    os.write(1, b"\n\x1b[?25h")
                os._exit(130)
            log.warning("signal %d: stopping: a step in flight is given up, a checkpoint of the last one saved "
                        "(Ctrl-C again: exit at once, saving nothing)", sig)
            self.should_exit = True
            self.stop_signal = self.stop_signal or sig

        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, on_signal, sig)
            except (NotImplementedError, RuntimeError):  # not the main thread (tests)
                return

    async def _startup(self) -> None:
        c = self.c
        self.table = RoutingTable(policy=c.routing, balance_abs=c.route_balance_abs, balance_rel=c.route_balance_rel)
        self.table.set_nodes(self.nodes)
        for node, role in zip(self.nodes, self.roles):
            if role != "rollout":
                self.table.close(node)
        proxy_cfg = ProxyConfig(host=c.proxy_host, port=c.proxy_port, default_max_tokens=c.default_max_tokens,
                                max_tokens_cap=c.max_tokens_cap, max_context=c.max_context,
                                temperature=c.rollout_temperature, top_p=c.rollout_top_p)
        self.proxy = ProxyServer(ChatTokenizer(c.model_dir), LinkBackend(self.link, self.table), proxy_cfg,
                                 run_dir=c.run_dir)
        await start_proxy(self.proxy)
        self.proxy.status_provider = self.status
        (c.run_dir / "coordinator.json").write_text(json.dumps({
            "status_url": f"{self.proxy.base_url}/gyre/status", "pid": os.getpid(), "started": time.time()}))
        self.sandboxes = await open_sandboxes(c)  # orphans of dead runs reaped here
        self.launcher = Launcher(self.proxy, c.run_dir, launch_spec(c), default_evaluator={"type": "similarity"},
                                 pool=self.sandboxes.pool, owner=self.sandboxes.owner,
                                 remote_relay=self._remote_relay)
        for task in self.tasks.tasks:  # a task this sandbox cannot run fails the start, named
            self.launcher.check_task(task)
        # Gradient reduction: every cell joins one gloo world with prebuilt prefix groups.
        init = c.reducer_init or self.cluster.reducer_init(c.run_dir)
        link = self.link
        if c.weight_transfer == "mooncake":  # fail at start-up, named, where Mooncake cannot run
            await asyncio.gather(*(link.request(n, wire.InitTransfer(
                req_id=link.new_req_id(), backend="mooncake", host=self.cluster.transfer_host(n, c.transfer_host)))
                for n in self.nodes))
        await asyncio.gather(*(link.request(n, wire.InitReducer(
            req_id=link.new_req_id(), rank=i, world_size=c.cells, init_method=init))
            for i, n in enumerate(self.nodes)))
        if c.weight_transfer == "broadcast" and len(self.nodes) > 1:
            await self.weights.init_broadcast()
        if self.resume:
            await resume.restore(self)
        else:
            self._dispatch(c.initial_groups)
        # Packing and evaluators run in threads; each time the loop wakes while one holds the
        # GIL it waits up to the switch interval (CPython's 5 ms) for every callback it runs.
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        self.gc.start()  # start-up objects out of the collector's way, then every gc_freeze_every_s
        self.probe.start()
        log.info("coordinator up: %d cells, policy %s, proxy %s", c.cells, c.policy, self.proxy.base_url)

    async def _shutdown(self, save: bool) -> None:
        """Stop everything; with `save` (the run ended, or was stopped by a signal or by
        failing sandboxes, its workers fine) the trained steps not yet checkpointed are."""
        await self.probe.stop()
        await self.gc.stop()
        await self._settle_step()
        if self.side_task is not None and not self.side_task.done():
            self.side_task.cancel()  # a publication: the next start loads the checkpoint's weights everywhere
        for task in list(self.runs.values()):
            task.cancel()
        await asyncio.gather(*self.runs.values(), return_exceptions=True)
        if save:
            await resume.final_checkpoint(self)
        if self.sandboxes is not None:
            await self.sandboxes.close()
        await self.proxy.stop()
        # Each live worker's peak memory, for the summary (a dead one has no answer: None).
        stats = await asyncio.gather(*(self.link.request(n, wire.Stats(req_id=self.link.new_req_id()), timeout=10)
                                       for n in self.nodes), return_exceptions=True)
        self.peak_rss = [s.peak_rss_bytes if isinstance(s, wire.WorkerStats) else None for s in stats]

    async def _settle_step(self) -> None:
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

    def _summary(self) -> None:
        wall = self.metrics.now()
        cells = []
        for i, node in enumerate(self.nodes):
            route = self.table.routes.get(node)
            rollout_busy = route.busy_s if route else 0.0
            train_busy = self.train_busy_s.get(i, 0.0)
            rss = self.peak_rss[i] if i < len(self.peak_rss) else None
            cells.append({"cell": i, "rollout_busy_s": round(rollout_busy, 3), "train_busy_s": round(train_busy, 3),
                          "rollout_tokens": route.tokens if route else 0,
                          "peak_rss_mb": None if rss is None else round(rss / 2**20, 1),
                          "idle_frac": round(max(0.0, 1 - (rollout_busy + train_busy) / wall), 4) if wall else None})
        self.metrics.emit("summary", steps=self.steps_done, wall_s=wall, statuses=dict(self.status_counts),
                          pending_groups=sorted([*(g.id for g in self.buffer.groups.values() if g.state != "consumed"),
                                                 *(ev["group"] for ev in self.held)]),
                          dropped_groups=sorted(g.id for g in self.buffer.groups.values() if g.state == "dropped"),
                          dead_cells=sorted(self.dead), rejoined_cells=sorted(self.no_reducer),
                          counters={"d": self.wl.c.d, "p": self.wl.c.p, "f": self.wl.c.f},
                          rollout_tokens=sum(c["rollout_tokens"] for c in cells),
                          tokens_trained=self.tokens_trained, cells=cells)

    async def _remote_relay(self, node: str, pid: int, proxy_port: int):
        """A proxy listener in a sandbox on `node`'s host, made by its workerd (relays.py):
        (the port inside, an async close)."""
        if node not in self.link.nodes:
            raise SandboxError(f"sandbox host's node {node!r} is not a connected workerd")
        link = self.link
        try:
            opened = await link.request(node, wire.OpenRelay(req_id=link.new_req_id(), pid=pid, proxy_port=proxy_port),
                                        timeout=30)
        except (WorkerError, WorkerDeadError, WorkerCallTimeout) as e:
            raise SandboxError(f"node {node} could not make the sandbox's proxy listener: {e}") from None

        async def close() -> None:
            await link.request(node, wire.CloseRelay(req_id=link.new_req_id(), relay=opened.relay), timeout=30)

        return opened.port, close

    # --- worker health ------------------------------------------------------------------

    # --- worker health (health.py) ------------------------------------------------------

    def _watch_workers(self) -> None:
        health.watch(self)

    def _on_rejoin(self, cell: int, node: str) -> None:
        health.on_rejoin(self, cell, node)

    def record_role(self, cell: int, old: str, new: str) -> None:
        """A role change (or death, or rejoin) for the live view's timeline and switch list."""
        t = self.metrics.now()
        self.role_history[cell].append((t, new))
        self.role_switches.append({"t": t, "cell": cell, "from": old, "to": new})

    # --- the tick -----------------------------------------------------------------------

    async def tick(self) -> bool:
        """One pass: the scheduler's decisions (schedule.py) for what the coordinator holds
        now, carried out; returns True when the run is finished."""
        if self.fatal is not None:
            raise self.fatal
        if self.should_exit:
            return True
        for task in (self.step_task, self.side_task, *self.switch_tasks.values(), *self.join_tasks.values(),
                     *self.runs.values()):
            if task is not None and task.done() and not task.cancelled() and task.exception():
                raise task.exception()  # a failed step, switch, publication or launch ends the run
        routes = self.table.routes.values()
        self.rates.sample(self.metrics.now(), sum(r.tokens for r in routes), self.tokens_trained,
                          prefill_tokens=sum(r.prefilled for r in routes))
        self._watch_workers()
        health.start_rejoin(self)
        d = decide(self.schedule_state())
        self._launch(d.launch)
        if d.publish:
            self.side_task = asyncio.create_task(self._publish(), name="gyre-publish")
        for cell, role in d.switches:
            self.switch_tasks[cell] = asyncio.create_task(self._switch(cell, role), name=f"gyre-switch-{cell}")
        for cell in d.joins:
            self.join_tasks[cell] = asyncio.create_task(self._join(cell), name=f"gyre-join-{cell}")
        if d.start_step:
            self.step_task = asyncio.create_task(self._step(list(d.start_step)), name="gyre-step")
        return d.done and not self.join_tasks

    @staticmethod
    def _idle(task: asyncio.Task | None) -> bool:
        return task is None or task.done()

    def schedule_state(self) -> State:
        """What the scheduler decides over, read from the coordinator's own objects."""
        c, counters = self.c, self.wl.c
        batch = self.batch if not self._idle(self.step_task) else None
        view = None
        if batch is not None:
            view = BatchView(members=(*batch.participants, *sorted(self.join_tasks)), window_open=batch.window_open,
                             unclaimed=batch.unclaimed, pending=bool(batch.pending), packing_done=batch.packing_done)
        return State(policy=c.policy, roles=tuple(self.roles), capacity=(c.exec_slots_per_cell,) * c.cells,
                     queued=counters.queued, running=counters.running, ready_groups=self.buffer.ready_count,
                     groups_per_step=c.groups_per_step, mu=c.mu, steps=c.steps, steps_done=self.steps_done,
                     steps_in_burst=self.steps_in_burst, async_training_cells=c.async_training_cells,
                     switching=frozenset(cell for cell, t in self.switch_tasks.items() if not t.done()),
                     busy=frozenset(batch.busy) if batch is not None else frozenset(),
                     dead=frozenset(self.dead), no_reducer=frozenset(self.no_reducer), batch=view,
                     transfer=not self._idle(self.side_task))

    def settled(self, cell: int) -> bool:
        """The cell holds its role: no switch of it is under way (a batch claims only then)."""
        task = self.switch_tasks.get(cell)
        return task is None or task.done()

    # 1) launch
    def _launch(self, n: int) -> None:
        waiting: list[Execution] = []  # their task's image is still building: no slot is taken for that
        while self.queue and n > 0:
            run = self.queue.popleft()
            if self.launcher.image_state(run.task) == "building":
                waiting.append(run)
                continue
            self.wl.launch(run.tracked)
            self.runs[run.id] = asyncio.create_task(self._execute(run), name=f"gyre-exec-{run.id}")
            n -= 1
        self.queue.extendleft(reversed(waiting))

    async def _execute(self, run: Execution) -> None:
        try:
            await self.launcher.run(run)
        except asyncio.CancelledError:
            run.status = run.status or "cancelled"
            run.reward, run.valid = None, False
            self._close(run)
            raise
        except Exception as e:  # noqa: BLE001 - an infrastructure failure, recorded as such
            log.exception("execution %s failed", run.id)
            run.status, run.reward, run.valid, run.ref = "aborted_infra", None, False, f"{type(e).__name__}: {e}"
        self._close(run)

    def _close(self, run: Execution) -> None:
        if run.closed:
            return
        run.t_end = run.t_end or time.time()
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
                          ref=run.ref[:200], eval_attempts=run.eval_attempts)
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
            self._dispatch(1)
        self.changed.set()

    def _dispatch(self, n_groups: int) -> None:
        c = self.c
        while n_groups > 0:
            n_groups -= 1
            if self.held:  # resume: a group of a lost stretch, dispatched again where it first was
                group, _, _ = resume.release(self, self.held.popleft())
                if group.state == "dropped":  # it was when it first ran: its replacement too
                    self.replacements += 1
                    n_groups += 1
                continue
            task = self.tasks.next_task()
            gid = self.groups_dispatched
            self.groups_dispatched += 1
            group = Group(gid, task, self.version, c.group_size)
            for i, tracked in enumerate(self.wl.dispatch(c.group_size + c.oversample)):
                run = Execution(f"g{gid:05d}-{i:02d}", gid, i, task, tracked, self.version)
                group.runs.append(run)
                self.queue.append(run)
            self.buffer.add(group)
            self._journal_group(group)

    def _journal_group(self, group: Group) -> None:
        self.metrics.emit("dispatch", group=group.id, task=group.task.id, version=group.version,
                          runs=[r.id for r in group.runs])

    # 2) placement: every switch its own task, cells in parallel
    async def _switch(self, cell: int, new: str) -> None:
        """One cell's role change; the role is its target from the start (the scheduler
        holds the cell until this ends), routes close before and open after."""
        old, node = self.roles[cell], self.nodes[cell]
        self.roles[cell] = new
        t0 = time.monotonic()
        if new == "training":
            self.table.close(node)  # no new requests, its executions re-homed; running ones are handed back
        try:
            reply = await self.link.request(node, wire.SetRole(req_id=self.link.new_req_id(), role=new))
        except WorkerDeadError as e:  # the health watch excludes the cell
            log.warning("role change of cell %d to %s: %s", cell, new, e)
            return
        if new == "rollout":
            self.table.open(node)  # every node has a route since start-up
        if self.batch is not None:
            async with self.batch.cond:
                self.batch.cond.notify_all()  # a paused participant may claim again
        self.record_role(cell, old, new)
        self.metrics.emit("role", cell=cell, **{"from": old, "to": new}, seconds=round(time.monotonic() - t0, 4),
                          worker_seconds=round(reply.seconds, 4))

    async def _join(self, cell: int) -> None:
        """A training cell joins the batch in flight: the core's (fixed) weights first, if
        its trainer is behind, then it claims micro-steps."""
        t0 = time.monotonic()
        try:
            nbytes = await self._level([cell])
            if not self.link.nodes[self.nodes[cell]].alive:
                return  # died while pulling: never a participant
            joined = self.batch.join(cell)
            self.metrics.emit("join", cell=cell, joined=joined, seconds=round(time.monotonic() - t0, 4),
                              bytes=nbytes, step=self.steps_done + 1)
        finally:
            self.join_tasks.pop(cell, None)

    async def _level(self, cells: list[int]) -> int:
        """The core's current weights to those of `cells` whose trainers are behind it."""
        return await self.weights.level(cells, self.trainer_version)

    # 3) training
    def _new_batch(self, cells: list[int]) -> Batch:
        return Batch(cells, link=self.link, nodes=self.nodes, buffer=self.buffer, config=self.c, changed=self.changed,
                     trains=self._trains, step=self.steps_done, train_busy_s=self.train_busy_s)

    def _trains(self, cell: int) -> bool:
        return self.roles[cell] == "training" and self.settled(cell)

    async def _step(self, cells: list[int]) -> None:
        t0 = time.monotonic()
        self._step_began = self.probe.now()
        if cells != list(range(len(cells))):
            raise RuntimeError(f"training cells {cells} are not a prefix 0..k-1 (prefix groups)")
        self.batch = self._new_batch(cells)
        await self._level(cells)  # a cell that trained no step of this burst yet starts level
        await self.weights.prepare(self.trainer_version)  # while the core is idle: joins pull from there
        res = await self.batch.run()
        version_before = self.trainer_version
        self.trainer_version = res.version
        self.steps_done += 1
        self.steps_in_burst += 1
        satellites = [c for c in res.participants if c != 0]
        if satellites and self.steps_in_burst < self.c.mu:  # they train the next step of the burst too
            await self._level(satellites)
        self._report(res.groups, res.executions, res.results, version_before, len(res.participants),
                     time.monotonic() - t0, res.tokens)

    def _report(self, groups, executions, results, version_before, n_cells, seconds, packed) -> None:
        runs = [r for g in groups for r in g.runs if r.status != "cancelled"]
        valid = [r.reward for r in runs if r.valid and r.reward is not None]
        staleness = [version_before - g.version for g in groups]
        rep = StepReport(step=self.steps_done, version=self.trainer_version,
                         reward_mean=sum(valid) / len(valid) if valid else None,
                         reward_valid_frac=len(valid) / len(runs) if runs else None,
                         staleness_mean=sum(staleness) / len(staleness), groups=len(groups),
                         executions=executions, tokens_trained=sum(r.tokens for r in results),
                         cells_training=n_cells, loss=sum(r.loss for r in results), seconds=round(seconds, 3),
                         equal_reward_groups=sum(_equal_rewards(g) for g in groups))
        self.reports.append(rep)
        self.tokens_trained += rep.tokens_trained
        # Engine/trainer gap over the step's targets (token-weighted mean of b - l): near zero
        # when the engines run the trainer's weights; a health signal for GPU backends.
        tokens = sum(r.tokens for r in results)
        mismatch = sum(r.mismatch_kl * r.tokens for r in results) / tokens if tokens else None
        prefill, cached = prefill_of(runs)
        self.metrics.emit("step", **rep.__dict__, mismatch=mismatch, staleness=staleness,
                          group_ids=[g.id for g in groups], prefill_tokens=prefill, cached_tokens=cached,
                          # The forward pass: tokens computed, unique admitted (each tree node on
                          # an admitted path once), path-expanded, and the trainers' seconds.
                          packing=self.c.packing, forward_tokens=packed.forward,
                          unique_admitted_tokens=packed.unique, expanded_tokens=packed.expanded,
                          trainer_seconds=round(sum(r.seconds for r in results), 4),
                          loop_lag_ms=self.probe.lag_ms(since=self._step_began),
                          cache_hit_rate=None if prefill is None or not prefill + cached
                          else round(cached / (prefill + cached), 4),
                          waterlevel=self.wl.c.waterlevel,
                          counters={"d": self.wl.c.d, "p": self.wl.c.p, "f": self.wl.c.f},
                          statuses=dict(self.status_counts))
        if self.on_step is not None:
            self.on_step(rep)

    # 4) publication
    async def _publish(self) -> None:
        """The core's weights to every engine: its own engine copies its trainer; the other
        cells get the core's export (engines and trainers, so a later join starts level)."""
        t0 = time.monotonic()
        version = self.trainer_version
        core = self.nodes[0]
        await self.link.request(core, wire.LoadWeights(req_id=self.link.new_req_id(), version=version))
        others = [i for i in range(1, len(self.nodes)) if i not in self.dead]
        nbytes = await self.weights.push(others, engine=True, version=version)
        self.version = version
        self.steps_in_burst = 0
        self.publications += 1
        self.metrics.emit("publish", version=version, seconds=round(time.monotonic() - t0, 4), bytes=nbytes,
                          engines=len(self.nodes), transfer=(self.weights.last_transfer if nbytes else None)
                          or self.c.weight_transfer,
                          memcpy_seconds=round(memcpy_seconds(nbytes), 5) if nbytes else None)
        if self.steps_done < self.c.steps:
            self._dispatch(topup(self.c.phi, self.c.mu, self.c.groups_per_step, self.publications))
        if self.c.checkpoint_every and self.steps_done % self.c.checkpoint_every == 0 and self.steps_done:
            await resume.checkpoint(self)


def _equal_rewards(group: Group) -> bool:
    """Every counted valid reward of the group the same: no advantage to learn from."""
    rewards = [r.reward for r in group.valid_runs[: group.size] if r.reward is not None]
    return len(rewards) > 0 and max(rewards) == min(rewards)


def prefill_of(runs) -> tuple[int | None, int | None]:
    """(computed, reused) prompt tokens over the model calls of a step's executions; None
    where no call's engine said (an unknown is never counted as zero)."""
    known = [c for r in runs if r.recorder is not None for c in r.recorder.calls if c.get("cached_tokens") is not None]
    if not known:
        return None, None
    return sum(c["prefill_tokens"] for c in known), sum(c["cached_tokens"] for c in known)
