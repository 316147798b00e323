"""main.py: the coordinator: startup -> run (a 100 ms tick) -> shutdown, in one event loop.

It owns the waterlevel counters, the dispatch queue, the trajectory buffer, the cells'
roles and the proxy. Each tick: (1) launch queued executions into rollout capacity,
(2) publish weights at burst end and refill the dispatch queue, (3) ask the placement
policy for roles and start a transition (or satellite joins) if they differ, (4) start a
training step when training cells and ready groups allow, (5) decide whether the run is done.
Long operations run as tasks the tick starts and watches; an exception in any of them
ends the run (a half-alive coordinator is worse than a restart). Not the workers' logic
and not the proxy's: both are driven through their interfaces.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import time
from collections import deque
from dataclasses import dataclass

from gyre.coordinator import health, resume
from gyre.coordinator.buffer import Group, Run, TrajectoryBuffer
from gyre.coordinator.config import CoordinatorConfig
from gyre.coordinator.launcher import Launcher, launch_spec, open_sandboxes
from gyre.coordinator.link import WorkerCallTimeout, WorkerDeadError, WorkerError
from gyre.coordinator.sandbox import SandboxError
from gyre.coordinator.local import LocalCluster
from gyre.coordinator.metrics import Metrics
from gyre.coordinator.training import Batch, init_broadcast, memcpy_seconds, push_core_weights
from gyre.coordinator.policies import POLICIES, Snapshot
from gyre.coordinator.routing import LinkBackend, RoutingTable
from gyre.coordinator.status import Rates, snapshot
from gyre.coordinator.taskformats import load_task_source
from gyre.coordinator.tasks import TaskSource, default_tasks
from gyre.coordinator.waterlevel import Waterlevel
from gyre.proxy.chat import ChatTokenizer
from gyre.proxy.server import ProxyConfig, ProxyServer
from gyre.workerd import wire
from gyre.workerd.wire import GyreError

log = logging.getLogger("gyre.coordinator")
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



class InfraFailures(GyreError):
    """Executions keep failing before the agent's work could be assessed: the run stops."""

class Coordinator:
    def __init__(self, config: CoordinatorConfig, *, on_step=None, resume: bool = False):
        from gyre.coordinator.runconfig import with_model_defaults

        self.c = config = with_model_defaults(config)  # lr, output limits, context: per model
        self.resume = resume  # continue RUN_DIR from its latest checkpoint (resume.py)
        tasks = load_task_source(config.tasks_path) if config.tasks_path else default_tasks()
        self.tasks = TaskSource(tasks, seed=config.seed)
        self.policy = POLICIES[config.policy]
        self.wl = Waterlevel()
        self.buffer = TrajectoryBuffer(config.min_valid)
        self.queue: deque[Run] = deque()
        self.runs: dict[str, asyncio.Task] = {}
        self.roles = ["rollout"] * config.cells if config.policy != "async" else [
            "training" if c < config.async_training_cells else "rollout" for c in range(config.cells)]
        self.version = 0  # published policy version
        self.trainer_version = 0
        self.steps_done = 0
        self.steps_in_burst = 0
        self.publications = 0
        self.groups_dispatched = 0
        self.step_task: asyncio.Task | None = None
        self.batch: Batch | None = None
        self._core_cache: tuple | None = None  # (trainer version, bytes, frames) of the core's weights
        self._core_offer: dict | None = None  # Mooncake: the core's handle for the trainer version
        self._broadcast: dict | None = None  # broadcast: the group's weight specs, while the group is whole
        self.last_transfer: str | None = None  # the path the last push of weights took (zmq | mooncake | broadcast)
        self.side_task: asyncio.Task | None = None  # a transition or a publication
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
        self.tokens_trained = 0
        self.dead: set[int] = set()  # cells whose worker died; excluded until a worker re-registers
        self.no_reducer: set[int] = set()  # rejoined cells: they roll out, they cannot reduce gradients
        self._rejoins: dict[int, str] = {}  # dead cell -> the ready replacement node, not yet brought in
        self.cluster: LocalCluster | None = None
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
                               engine={"seed": c.seed, "max_running": c.engine_max_running, **c.engine_options},
                               backends=(c.engine_backend, c.trainer_backend),
                               keys_dir=c.keys_dir, spawn=c.workers == "local", call_timeout_s=c.worker_call_timeout_s,
                               start_timeout_s=c.topology_timeout_s if c.workers == "external" else 120.0)
        self._install_signal_handlers()
        cluster.on_rejoin = self._on_rejoin
        async with cluster:
            self.cluster = cluster
            self.link = cluster.link
            self.nodes = [cluster.node_of_cell(i) for i in range(c.cells)]
            await self._startup()
            try:
                while not await self.tick():
                    await asyncio.sleep(TICK_S)
            finally:
                await self._shutdown()
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
            log.warning("signal %d: shutting down (again to force)", sig)
            self.should_exit = True

        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, on_signal, sig)
            except (NotImplementedError, RuntimeError):  # not the main thread (tests)
                return

    async def _startup(self) -> None:
        c = self.c
        self.table = RoutingTable()
        self.table.set_nodes(self.nodes)
        for node, role in zip(self.nodes, self.roles):
            self.table.routes[node].accepting = role == "rollout"
        proxy_cfg = ProxyConfig(host=c.proxy_host, port=c.proxy_port, default_max_tokens=c.default_max_tokens,
                                max_tokens_cap=c.max_tokens_cap, max_context=c.max_context,
                                temperature=c.rollout_temperature, top_p=c.rollout_top_p)
        self.proxy = ProxyServer(ChatTokenizer(c.model_dir), LinkBackend(self.link, self.table), proxy_cfg,
                                 run_dir=c.run_dir)
        await self.proxy.start()
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
            await init_broadcast(self)
        if self.resume:
            await resume.restore(self)
        else:
            self._dispatch(c.initial_groups)
        gc.freeze()  # start-up objects out of the collector's way: full GCs were the proxy's p99
        log.info("coordinator up: %d cells, policy %s, proxy %s", c.cells, c.policy, self.proxy.base_url)

    async def _shutdown(self) -> None:
        for t in (self.step_task, self.side_task):
            if t is not None and not t.done():
                t.cancel()
        for run_id, task in list(self.runs.items()):
            task.cancel()
        await asyncio.gather(*self.runs.values(), return_exceptions=True)
        if getattr(self, "sandboxes", None) is not None:
            await self.sandboxes.close()
        await self.proxy.stop()
        # Each live worker's peak memory, for the summary (a dead one has no answer: None).
        stats = await asyncio.gather(*(self.link.request(n, wire.Stats(req_id=self.link.new_req_id()), timeout=10)
                                       for n in self.nodes), return_exceptions=True)
        self.peak_rss = [s.peak_rss_bytes if isinstance(s, wire.WorkerStats) else None for s in stats]

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
                          pending_groups=sorted(g.id for g in self.buffer.groups.values() if g.state != "consumed"),
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
        """One reconciliation pass; returns True when the run is finished."""
        if self.fatal is not None:
            raise self.fatal
        if self.should_exit:
            return True
        for task in (self.step_task, self.side_task, *self.runs.values()):
            if task is not None and task.done() and not task.cancelled() and task.exception():
                raise task.exception()  # a failed step, transition or launch ends the run
        self.rates.sample(self.metrics.now(), sum(r.tokens for r in self.table.routes.values()), self.tokens_trained)
        self._watch_workers()
        health.start_rejoin(self)
        self._launch()
        self._publish_if_burst_done()
        self._place()  # the policy is asked before a step starts (e.g. right after a publication)
        self._train()
        return self.steps_done >= self.c.steps and self._idle(self.step_task) and self._idle(self.side_task)

    @staticmethod
    def _idle(task: asyncio.Task | None) -> bool:
        return task is None or task.done()

    def trainable(self) -> int:
        """Cells 0..k-1 that may train: alive and in the reducer's world, as a prefix (the
        prefix process groups need it). Cells after a gap roll out only."""
        k = 0
        while k < len(self.roles) and k not in self.dead and k not in self.no_reducer:
            k += 1
        return k

    def _wanted_roles(self) -> list[str]:
        """The policy over the trainable prefix; every other live cell rolls out; a dead
        cell keeps its last role (nothing can be asked of it)."""
        k = self.trainable()
        want = list(self.policy(self.snapshot(k))) if k else []
        for cell in range(k, len(self.roles)):
            want.append(self.roles[cell] if cell in self.dead else "rollout")
        self._pause_or_resume(want)
        return want

    def _pause_or_resume(self, want: list[str]) -> None:
        """A batch in flight that waits for groups while no live cell rolls out would wait
        forever (a rollout cell died, or replacements of dropped groups need rollout): its
        cells pause in rollout, keeping their accumulated gradients, and resume once there
        is something to train and the other rollout cells cover the waterlevel."""
        batch = self.batch if not self._idle(self.step_task) else None
        if batch is None:
            return
        slots = self.c.exec_slots_per_cell
        members = set(batch.participants)
        level = self.wl.c.waterlevel
        others = sum(slots for c, r in enumerate(want) if r == "rollout" and c not in self.dead and c not in members)
        paused = all(self.roles[c] == "rollout" for c in members)
        if not paused:
            starving = not batch.packing_done and not batch.pending and level > 0
            if starving and others == 0:
                for c in members:
                    want[c] = "rollout"
            return
        ready = bool(batch.pending) or batch.packing_done
        for c in members:
            want[c] = "training" if ready and others >= level else "rollout"

    def snapshot(self, k: int | None = None) -> Snapshot:
        """The policy's view of cells 0..k-1 (default: all); rollout capacity outside the
        prefix counts as a standalone pool."""
        k = len(self.roles) if k is None else k
        c = self.wl.c
        batch = self.batch if not self._idle(self.step_task) else None
        outside = sum(self.c.exec_slots_per_cell for cell in range(k, len(self.roles))
                      if cell not in self.dead)
        return Snapshot(roles=tuple(self.roles[:k]), queued=c.queued, running=c.running,
                        ready_groups=self.buffer.ready_count, groups_per_step=self.c.groups_per_step,
                        mu=self.c.mu, steps_in_burst=self.steps_in_burst, step_in_flight=batch is not None,
                        async_training_cells=self.c.async_training_cells,
                        capacity=(self.c.exec_slots_per_cell,) * k, standalone=outside,
                        window_open=batch.window_open if batch else False,
                        unclaimed=batch.unclaimed if batch else 0)

    # 1) launch
    def _launch(self) -> None:
        capacity = self.c.exec_slots_per_cell * sum(
            r == "rollout" and i not in self.dead for i, r in enumerate(self.roles))
        waiting: list[Run] = []  # their task's image is still building: no slot is taken for that
        while self.queue and self.wl.c.running < capacity and self.steps_done < self.c.steps:
            run = self.queue.popleft()
            if self.launcher.image_state(run.task) == "building":
                waiting.append(run)
                continue
            self.wl.launch(run.tracked)
            self.runs[run.id] = asyncio.create_task(self._execute(run), name=f"gyre-exec-{run.id}")
        self.queue.extendleft(reversed(waiting))

    async def _execute(self, run: Run) -> None:
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

    def _close(self, run: Run) -> None:
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
            self._dispatch(1)
        self.changed.set()

    def _dispatch(self, n_groups: int) -> None:
        c = self.c
        for _ in range(n_groups):
            task = self.tasks.next_task()
            gid = self.groups_dispatched
            self.groups_dispatched += 1
            group = Group(gid, task, self.version, c.group_size)
            for i, tracked in enumerate(self.wl.dispatch(c.group_size + c.oversample)):
                run = Run(f"g{gid:05d}-{i:02d}", gid, i, task, tracked, self.version)
                group.runs.append(run)
                self.queue.append(run)
            self.buffer.add(group)
            self._journal_group(group)

    def _journal_group(self, group: Group) -> None:
        self.metrics.emit("dispatch", group=group.id, task=group.task.id, version=group.version,
                          runs=[r.id for r in group.runs])

    # 2) placement
    def _place(self) -> None:
        if not self._idle(self.side_task):
            return
        want = self._wanted_roles()
        if want == self.roles:
            return
        if self._idle(self.step_task):
            self.side_task = asyncio.create_task(self._transition(want), name="gyre-transition")
            return
        # A batch is in flight: its participants pause or resume (see _pause_or_resume);
        # other cells only join it (rollout -> training).
        members = set(self.batch.participants)
        moves = {c: new for c, (old, new) in enumerate(zip(self.roles, want)) if old != new and c in members}
        if moves:
            self.side_task = asyncio.create_task(
                self._transition([moves.get(c, r) for c, r in enumerate(self.roles)]), name="gyre-pause")
            return
        joins = [c for c, (old, new) in enumerate(zip(self.roles, want)) if old == "rollout" and new == "training"]
        if joins:
            self.side_task = asyncio.create_task(self._join(joins), name="gyre-join")

    async def _set_role(self, cell: int, new: str) -> None:
        old, node = self.roles[cell], self.nodes[cell]
        t0 = time.monotonic()
        if new == "training":
            self.table.routes[node].accepting = False  # no new requests; running ones are handed back
        reply, _ = await self.link.call(node, wire.SetRole(req_id=self.link.new_req_id(), role=new))
        if new == "rollout":
            self.table.routes[node].accepting = True  # every node has a route since start-up
        self.roles[cell] = new
        if self.batch is not None:
            async with self.batch.cond:
                self.batch.cond.notify_all()  # a paused participant may claim again
        self.record_role(cell, old, new)
        self.metrics.emit("role", cell=cell, **{"from": old, "to": new}, seconds=round(time.monotonic() - t0, 4),
                          worker_seconds=round(reply.seconds, 4))

    async def _transition(self, want: list[str]) -> None:
        for cell, (old, new) in enumerate(zip(self.roles, want)):
            if old != new and cell not in self.dead:
                try:
                    await self._set_role(cell, new)
                except WorkerDeadError as e:  # the health watch excludes the cell
                    log.warning("role change of cell %d to %s: %s", cell, new, e)

    async def _join(self, cells: list[int]) -> None:
        """Satellites join the batch in flight: switch, pull the core's (fixed) weights, claim."""
        for cell in cells:
            try:
                await self._set_role(cell, "training")
            except WorkerDeadError as e:
                log.warning("cell %d could not join: %s", cell, e)
                continue
            t0 = time.monotonic()
            nbytes = await push_core_weights(self, [cell], engine=False, version=self.trainer_version)
            if not self.link.nodes[self.nodes[cell]].alive:
                continue  # died while pulling: never a participant
            joined = await self.batch.join(cell)
            self.metrics.emit("join", cell=cell, joined=joined, seconds=round(time.monotonic() - t0, 4),
                              bytes=nbytes, step=self.steps_done + 1)

    # 3) training
    def _train(self) -> None:
        if not (self._idle(self.step_task) and self._idle(self.side_task)):
            return
        if self.steps_done >= self.c.steps or self.steps_in_burst >= self.c.mu:
            return
        cells = [i for i, r in enumerate(self.roles[:self.trainable()]) if r == "training"]
        if not cells:
            return
        # Colocate trains on a full batch; the others stream from the first ready group.
        need = self.c.groups_per_step if self.c.policy == "colocate" else 1
        if self.buffer.ready_count >= need:
            self.step_task = asyncio.create_task(self._step(cells), name="gyre-step")

    async def _step(self, cells: list[int]) -> None:
        t0 = time.monotonic()
        if cells != list(range(len(cells))):
            raise RuntimeError(f"training cells {cells} are not a prefix 0..k-1 (prefix groups)")
        self.batch = Batch(self, cells)
        res = await self.batch.run()
        version_before = self.trainer_version
        self.trainer_version = res.version
        self.steps_done += 1
        self.steps_in_burst += 1
        satellites = [c for c in res.participants if c != 0]
        if satellites and self.steps_in_burst < self.c.mu:  # they train the next step of the burst too
            await push_core_weights(self, satellites, engine=False, version=res.version)
        self._report(res.groups, res.executions, res.results, version_before, len(res.participants),
                     time.monotonic() - t0)

    def _report(self, groups, executions, results, version_before, n_cells, seconds) -> None:
        runs = [r for g in groups for r in g.runs if r.status != "cancelled"]
        valid = [r.reward for r in runs if r.valid and r.reward is not None]
        staleness = [version_before - g.version for g in groups]
        rep = StepReport(step=self.steps_done, version=self.trainer_version,
                         reward_mean=sum(valid) / len(valid) if valid else None,
                         reward_valid_frac=len(valid) / len(runs) if runs else None,
                         staleness_mean=sum(staleness) / len(staleness), groups=len(groups),
                         executions=executions, tokens_trained=sum(r.tokens for r in results),
                         cells_training=n_cells, loss=sum(r.loss for r in results), seconds=round(seconds, 3))
        self.reports.append(rep)
        self.tokens_trained += rep.tokens_trained
        # Engine/trainer gap over the step's targets (token-weighted mean of b - l): near zero
        # when the engines run the trainer's weights; a health signal for GPU backends.
        tokens = sum(r.tokens for r in results)
        mismatch = sum(r.mismatch_kl * r.tokens for r in results) / tokens if tokens else None
        self.metrics.emit("step", **rep.__dict__, mismatch=mismatch, staleness=staleness,
                          group_ids=[g.id for g in groups],
                          waterlevel=self.wl.c.waterlevel,
                          counters={"d": self.wl.c.d, "p": self.wl.c.p, "f": self.wl.c.f},
                          statuses=dict(self.status_counts))
        if self.on_step is not None:
            self.on_step(rep)

    # 4) publication
    def _publish_if_burst_done(self) -> None:
        burst_done = self.steps_in_burst >= self.c.mu or (self.steps_done >= self.c.steps and self.steps_in_burst)
        if burst_done and self._idle(self.step_task) and self._idle(self.side_task):
            self.side_task = asyncio.create_task(self._publish(), name="gyre-publish")

    async def _publish(self) -> None:
        """The core's weights to every engine: its own engine copies its trainer; the other
        cells get the core's export (engines and trainers, so a later join starts level)."""
        t0 = time.monotonic()
        version = self.trainer_version
        core = self.nodes[0]
        await self.link.call(core, wire.LoadWeights(req_id=self.link.new_req_id(), version=version))
        nbytes = await push_core_weights(self, [i for i in range(1, len(self.nodes)) if i not in self.dead],
                                         engine=True, version=version)
        self.version = version
        self.steps_in_burst = 0
        self.publications += 1
        self.metrics.emit("publish", version=version, seconds=round(time.monotonic() - t0, 4), bytes=nbytes,
                          engines=len(self.nodes), transfer=(self.last_transfer if nbytes else None)
                          or self.c.weight_transfer,
                          memcpy_seconds=round(memcpy_seconds(nbytes), 5) if nbytes else None)
        if self.steps_done < self.c.steps:
            self._dispatch(self.c.dispatch_target(self.publications) - self.c.dispatch_target(self.publications - 1))
        if self.c.checkpoint_every and self.steps_done % self.c.checkpoint_every == 0 and self.steps_done:
            await resume.checkpoint(self)
