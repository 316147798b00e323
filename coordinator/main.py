"""main.py: the coordinator: startup -> run (a 100 ms tick) -> shutdown, in one event loop.

The run's state has owners (executions.py: the executions; cells.py: the cells; steps.py:
versions, steps, the batch in flight and publications); the Coordinator builds them, enters
the rollout and execution stacks (stack.py: workers, routes, proxy; sandboxes, launcher),
and each tick reads the owners into a
`schedule.State`, asks `schedule.decide` (the rules live there, shared with `gyre sim`) and
hands each decision to its owner: launch queued executions, start a publication, start each
cell's role switch (in parallel), let cells join the batch in flight, start a step; the run
ends when the scheduler says it is done. Long operations run as tasks the tick watches; an
exception in any of them ends the run (a half-alive coordinator is worse than a restart).
Not the scheduling rules, the workers' logic or the proxy's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time

from gyre.coordinator import report, resume
from gyre.coordinator.buffer import TrajectoryBuffer
from gyre.coordinator.cells import Cells
from gyre.coordinator.config import CoordinatorConfig
from gyre.coordinator.executions import Executions, InfraFailures
from gyre.coordinator.gcpolicy import GcPolicy
from gyre.coordinator.heldout import HeldOut, rounds_in
from gyre.coordinator.launcher import Launcher, launch_spec
from gyre.coordinator.link import WorkerCallTimeout, WorkerDeadError, WorkerError
from gyre.coordinator.local import LocalCluster
from gyre.coordinator.loopprobe import LoopProbe
from gyre.coordinator.metrics import Metrics
from gyre.coordinator.policies import POLICIES
from gyre.coordinator.presence import Presence, StopRequest
from gyre.coordinator.publisher import WeightPublisher
from gyre.coordinator.report import StepReport
from gyre.coordinator.resume import Checkpoints
from gyre.coordinator.routing import RoutingTable
from gyre.coordinator.sandbox import BACKENDS, SandboxError, backend_class
from gyre.coordinator.schedule import BatchView, State, decide
from gyre.coordinator.stack import execution_stack, rollout_stack, run_routes, run_workers
from gyre.coordinator.status import Rates, snapshot
from gyre.coordinator.steps import Steps
from gyre.coordinator.taskformats import load_task_source
from gyre.coordinator.tasks import TaskSource, default_tasks
from gyre.coordinator.trackers import Trackers
from gyre.coordinator.waterlevel import Waterlevel
from gyre.proxy.server import ProxyServer
from gyre.workerd import wire
from gyre.workerd.wire import GyreError

log = logging.getLogger("gyre.coordinator")
# bench/scale.py, SmolLM2's tokenizer, 128 executions, a step packed while serving: loop lag
# while packing p99 / max 32.3 / 32.3 ms at 5 ms, 21.3 / 22.8 ms at 0.5 ms.
SWITCH_INTERVAL_S = 0.0005
TICK_S = 0.1


class Coordinator:
    def __init__(self, config: CoordinatorConfig, *, on_step=None, resume: bool = False, workers=None):
        """`workers`: with `workers = "inproc"`, the workers to run in this process
        (gyre.workerd.inproc.InprocWorkers(): of workerd the coordinator imports only the light modules
        tests/test_layering.py lists)."""
        from gyre.coordinator.runconfig import with_model_defaults

        if (workers is not None) != (config.workers == "inproc"):
            raise ValueError('workers = "inproc" and the in-process workers come together '
                             '(Coordinator(config, workers=InprocWorkers())); other kinds start their own')
        self._inproc = workers
        self.c = config = with_model_defaults(config)  # lr, output limits, context: per model
        self.resume = resume  # continue RUN_DIR from its latest checkpoint (resume.py)
        tasks = load_task_source(config.tasks_path) if config.tasks_path else default_tasks()
        self.tasks = TaskSource(tasks, seed=config.seed)
        # Held-out evaluation rounds (heldout.py): never trained, on the slots training leaves free.
        self.heldout = HeldOut(load_task_source(config.eval_tasks_path), k=config.eval_k,
                               threshold=config.eval_pass_threshold,
                               first_round=rounds_in(config.run_dir) if resume else 0) if config.eval_every else None
        self.wl = Waterlevel()
        self.buffer = TrajectoryBuffer(config.min_valid)
        # The cells: roles, nodes, deaths, rejoins, switches and the timeline (cells.py).
        self.cells = Cells(list(POLICIES[config.policy].initial_roles(config.cells, config.async_training_cells)),
                           now=lambda: self.metrics.now())
        # The run's executions: queue, tasks, statuses, dispatch, closes (executions.py).
        self.executions = Executions(config, self.wl, self.buffer, self.tasks, self.heldout,
                                     version=lambda: self.steps.version)
        self.probe = LoopProbe()  # the event loop's lateness: every harness call waits on it
        # Training's progress: versions, steps, the batch in flight, publications (steps.py).
        self.steps = Steps(config, buffer=self.buffer, wl=self.wl, cells=self.cells, executions=self.executions,
                           heldout=self.heldout, probe=self.probe, checkpoint=lambda: self.checkpoints.save(),
                           on_step=on_step)
        # The run's checkpoints: saved at publications and at the end, restored on a resume (resume.py).
        self.checkpoints = Checkpoints(config, steps=self.steps, executions=self.executions, cells=self.cells,
                                       buffer=self.buffer, tasks=self.tasks, heldout=self.heldout)
        self.side_task: asyncio.Task | None = None  # a publication or a rejoin: weights on the move
        self.metrics: Metrics | None = None
        self.stop = StopRequest()  # what SIGINT, SIGTERM or SIGUSR1 asked: a stop at the next tick (presence.py)
        self.rates = Rates()
        self.gc = GcPolicy(config.gc_freeze_every_s)  # long-lived objects out of full collections
        self.cluster: LocalCluster | None = None
        # Set once the run starts (run, _startup): the workers, routes, proxy and sandboxes.
        self.link = None  # the cluster's WorkerLink
        self.weights: WeightPublisher | None = None  # the core's weights to the other cells
        self.table: RoutingTable | None = None
        self.proxy: ProxyServer | None = None
        self.sandboxes = None  # the sandbox host pool (launcher.open_sandboxes)
        self.launcher: Launcher | None = None
        self.presence = Presence(config.run_dir)  # coordinator.json: the status URL, the pid, a heartbeat

    def status(self) -> dict:
        """The live view's data (GET /gyre/status, `gyre top`)."""
        return snapshot(self.c, metrics=self.metrics, steps=self.steps, cells=self.cells, wl=self.wl,
                        buffer=self.buffer, executions=self.executions, rates=self.rates, probe=self.probe,
                        gc=self.gc, table=self.table, link=self.link, proxy=self.proxy, launcher=self.launcher,
                        stopping=self.stop.requested)

    # --- lifecycle ----------------------------------------------------------------------

    async def run(self) -> list[StepReport]:
        c = self.c
        # Before anything starts (no run of placeholder zeros): the harness's command where it
        # runs, on this host unless a container runs the preset's sandbox_command.
        why = c.preset().missing(contained=c.sandbox in BACKENDS and backend_class(c.sandbox).needs_image)
        if why is not None:
            raise GyreError(why)
        if c.weight_transfer == "mooncake" and c.keys_dir is not None:
            log.warning("weight_transfer = mooncake with CURVE keys: Mooncake's transfer engine listens on every "
                        "interface without authentication; keep it on a private network")
        c.run_dir.mkdir(parents=True, exist_ok=True)
        t0, restored = None, None
        if self.resume:
            restored = resume.read(c.run_dir)  # fails before anything starts
            self.checkpoints.counts(restored)  # the view shows the run's step while the workers load
            t0 = time.monotonic() - restored.last_t  # times continue from the journal's last
        (c.run_dir / "config.json").write_text(json.dumps(c.to_json(), indent=2))
        trackers = Trackers(c.trackers, c.tracker_options, c.run_dir, c.to_json()) if c.trackers else None
        self.metrics = self.executions.metrics = Metrics(c.run_dir / "metrics.jsonl", t0=t0, trackers=trackers)
        # This session's t = 0 on the wall clock (calls.jsonl's times are wall-clock stamps).
        self.metrics.emit("start", t0_wall=round(self.metrics.t0_wall, 4), resumed=restored is not None)
        cluster = run_workers(c, self.cells.roles, self._inproc,
                              resume_version=self.steps.trainer_version if restored is not None else None)
        cluster.on_rejoin = self.cells.on_rejoin
        self.table = self.cells.table = run_routes(c)
        self.stop.install()
        try:
            async with rollout_stack(cluster, c.serving(), run_dir=c.run_dir, table=self.table) as rollout:
                self.cluster, self.link, self.proxy = cluster, rollout.link, rollout.proxy
                cells = self.cells
                cells.nodes = rollout.nodes
                self.weights = WeightPublisher(c, self.link, cells.nodes, cluster, cells.dead)
                cells.link, cells.weights, cells.metrics = self.link, self.weights, self.metrics
                for owner in (self.steps, self.checkpoints):
                    owner.link, owner.weights, owner.metrics = self.link, self.weights, self.metrics
                self.checkpoints.proxy = self.proxy  # its records synced at a checkpoint, then released
                async with execution_stack(self.proxy, launch_spec(c), run_dir=c.run_dir, config=c,
                                           remote_relay=self._remote_relay) as executor:
                    self.sandboxes, self.launcher = executor.sandboxes, executor.launcher
                    self.executions.launcher = self.launcher
                    await self._startup(restored)
                    ended = False
                    try:
                        while not await self.tick():
                            await asyncio.sleep(TICK_S)
                        ended = True
                    finally:
                        peak_rss = await self._shutdown(
                            save=ended or isinstance(self.executions.fatal, InfraFailures))
                        report.summary(self.metrics, steps=self.steps, cells=self.cells, executions=self.executions,
                                       buffer=self.buffer, wl=self.wl, table=self.table, peak_rss=peak_rss)
        finally:
            self.metrics.close()  # also on a failed run: held events written, trackers closed
        return self.steps.reports

    async def _startup(self, restored: resume.Restored | None) -> None:
        """Inside the stacks (the workers ready, the proxy listening, the sandboxes open): the
        status endpoint, the tasks checked, the reducer and transfers joined, then the first
        dispatch or, with `restored`, the resume."""
        c = self.c
        self.proxy.status_provider = self.status
        self.presence.write(f"{self.proxy.base_url}/gyre/status")
        for task in [*self.tasks.tasks, *(self.heldout.tasks if self.heldout else ())]:
            self.launcher.images.check(task)  # a task this sandbox cannot run fails the start, named
        # Gradient reduction: every cell joins one gloo world with prebuilt prefix groups.
        init = c.reducer_init or self.cluster.reducer_init(c.run_dir)
        link = self.link
        if c.weight_transfer == "mooncake":  # fail at start-up, named, where Mooncake cannot run
            await asyncio.gather(*(link.request(n, wire.InitTransfer(
                backend="mooncake", host=self.cluster.transfer_host(n, c.transfer_host)))
                for n in self.cells.nodes))
        await asyncio.gather(*(link.request(n, wire.InitReducer(
            rank=i, world_size=c.cells, init_method=init))
            for i, n in enumerate(self.cells.nodes)))
        if c.weight_transfer == "broadcast" and len(self.cells.nodes) > 1:
            await self.weights.init_broadcast()
        # Start-up done: the workers ready, the proxy listening; what comes next is the run's.
        self.metrics.emit("ready", startup_s=round(self.metrics.now() - (restored.last_t if restored else 0.0), 4))
        if restored is not None:
            await self.checkpoints.restore(restored, kept=self.cluster.kept_cells())
            self.executions.launch_adopted()  # harnesses that outlived the earlier coordinator
        else:
            self.executions.dispatch(c.initial_groups)
            if self.heldout is not None:  # the base model's score, to compare the trained one's with
                self.heldout.dispatch(step=0, version=0)
        # Packing and evaluators run in threads; each time the loop wakes while one holds the
        # GIL it waits up to the switch interval (CPython's 5 ms) for every callback it runs.
        await self.sandboxes.sweep()  # an earlier coordinator's sandboxes of this run not adopted
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        self.gc.start()  # start-up objects out of the collector's way, then every gc_freeze_every_s
        self.probe.start()
        log.info("coordinator up: %d cells, policy %s, proxy %s", c.cells, c.policy, self.proxy.base_url)

    async def _shutdown(self, save: bool) -> list[int | None]:
        """Stop the run's own work (the stacks then stop the sandboxes, the proxy and the
        workers); with `save` (the run ended, or was stopped by a signal or by failing
        sandboxes, its workers fine) the trained steps not yet checkpointed are saved.
        Returns each cell's peak memory (None: a dead worker's), for the summary."""
        await self.probe.stop()
        await self.gc.stop()
        await self.steps.settle()
        if self.side_task is not None and not self.side_task.done():
            self.side_task.cancel()  # a publication: the next start loads the checkpoint's weights everywhere
        await self.executions.cancel_all(handoff=self.stop.handoff)
        self.cluster.hand_off = self.stop.handoff  # and the workerds, with their weights (local.py)
        if save:
            await self.checkpoints.save_final()
        # Each live worker's peak memory, for the summary (a dead one has no answer: None).
        stats = await asyncio.gather(*(self.link.request(n, wire.Stats(), timeout=10)
                                       for n in self.cells.nodes), return_exceptions=True)
        return [s.peak_rss_bytes if isinstance(s, wire.WorkerStats) else None for s in stats]

    async def _remote_relay(self, node: str, pid: int, proxy_port: int):
        """A proxy listener in a sandbox on `node`'s host, made by its workerd (relays.py):
        (the port inside, an async close)."""
        if node not in self.link.nodes:
            raise SandboxError(f"sandbox host's node {node!r} is not a connected workerd")
        link = self.link
        try:
            opened = await link.request(node, wire.OpenRelay(pid=pid, proxy_port=proxy_port),
                                        timeout=30)
        except (WorkerError, WorkerDeadError, WorkerCallTimeout) as e:
            raise SandboxError(f"node {node} could not make the sandbox's proxy listener: {e}") from None

        async def close() -> None:
            await link.request(node, wire.CloseRelay(relay=opened.relay), timeout=30)

        return opened.port, close

    # --- the tick -----------------------------------------------------------------------

    async def tick(self) -> bool:
        """One pass: the scheduler's decisions (schedule.py) for what the coordinator holds
        now, carried out; returns True when the run is finished."""
        if self.executions.fatal is not None:  # too many infrastructure failures in a row
            raise self.executions.fatal
        if self.stop.requested:
            return True
        self.presence.beat()
        # The workers' health first: a task failed by a worker's death (a send to a dead node
        # fails at once) ends the run as that death, journaled and named, not as the bare error.
        self.cells.watch(self.c.worker_timeout_s, training=self.steps.training)
        for task in (self.steps.step_task, self.side_task, *self.cells.switch_tasks.values(),
                     *self.steps.join_tasks.values(),
                     *self.executions.runs.values()):
            if task is not None and task.done() and not task.cancelled() and task.exception():
                raise task.exception()  # a failed step, switch, publication or launch ends the run
        self.cells.sample_slots(self.wl.c.running)
        routes = self.table.routes.values()
        self.rates.sample(self.metrics.now(), sum(r.tokens for r in routes), self.steps.tokens_trained,
                          prefill_tokens=sum(r.prefilled for r in routes))
        if self.cells.rejoins and self._idle(self.side_task) and self._idle(self.steps.step_task):
            cell, node = self.cells.rejoins.popitem()  # weights on the move: never beside a step or publication
            self.side_task = asyncio.create_task(self.cells.rejoin(cell, node, self.steps.trainer_version),
                                                 name=f"gyre-rejoin-{cell}")
        d = decide(self.schedule_state())
        self.executions.launch(d.launch)
        self.executions.launch_eval(d.launch_eval)
        if d.publish:
            self.side_task = asyncio.create_task(self.steps.publish(), name="gyre-publish")
        for cell, role in d.switches:
            self.cells.start_switch(cell, role, batch=lambda: self.steps.batch)
        for cell in d.joins:
            self.steps.start_join(cell)
        if d.start_step:
            self.steps.start(list(d.start_step))
        return d.done and not self.steps.join_tasks

    @staticmethod
    def _idle(task: asyncio.Task | None) -> bool:
        return task is None or task.done()

    def schedule_state(self) -> State:
        """What the scheduler decides over, read from the coordinator's own objects."""
        c, counters = self.c, self.wl.c
        steps = self.steps
        batch = steps.in_flight()
        view = None
        if batch is not None:
            view = BatchView(members=(*batch.participants, *sorted(steps.join_tasks)), window_open=batch.window_open,
                             unclaimed=batch.unclaimed, pending=bool(batch.pending), packing_done=batch.packing_done)
        return State(policy=c.policy, roles=tuple(self.cells.roles), capacity=(c.exec_slots_per_cell,) * c.cells,
                     queued=counters.queued, running=counters.running, ready_groups=self.buffer.ready_count,
                     groups_per_step=c.groups_per_step, mu=c.mu, steps=c.steps, steps_done=steps.steps_done,
                     steps_in_burst=steps.steps_in_burst, async_training_cells=c.async_training_cells,
                     switching=self.cells.switching(),
                     busy=frozenset(batch.busy) if batch is not None else frozenset(),
                     dead=frozenset(self.cells.dead), no_reducer=frozenset(self.cells.no_reducer), batch=view,
                     transfer=not self._idle(self.side_task),
                     eval_queued=len(self.heldout.queue) if self.heldout else 0,
                     eval_running=len(self.heldout.running) if self.heldout else 0)
