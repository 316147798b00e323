"""status.py: the coordinator's state as one JSON-able dict, for the live view and `gyre top`.

`snapshot` reads the counters, roles, routes, the batch in flight, the last step and the
running executions (`execution_rows`: each one's phase, the slowest first, and the counts by
phase); `Rates` keeps a short window of cumulative token counts sampled each tick, so
tokens/s is recent, not averaged over the run. A value nobody measured is None (the view
shows n/a), never 0. Served at `GET /gyre/status` on the proxy and drawn by cli/live.py.
Holds no secret (no keys, no prompts). Not a renderer.
"""

from __future__ import annotations

import heapq
import time
from collections import deque

WINDOW_S = 10.0
TIMELINE_KEEP = 64  # role changes kept per cell
EXECUTION_ROWS = 12  # the slowest running executions listed; the others are counted by phase
# The phases the view counts: the launcher's (buffer.PHASES), its "harness" told apart by the proxy.
SHOWN_PHASES = ("queued", "image", "sandbox", "harness", "model call", "tool", "verifier", "cleanup")


class Rates:
    """Tokens/s over the last WINDOW_S seconds, from cumulative counts the tick samples:
    rollout tokens generated, tokens trained (counted when a step ends, so a step's tokens
    land at once) and, where the tick passes it, prompt tokens the engines prefilled
    (computed, not reused). Generated tokens/s is truly 0 while every call is in prefill."""

    def __init__(self, window_s: float = WINDOW_S):
        self.window_s = window_s
        self.samples: deque[tuple[float, int, int, int | None]] = deque()

    def sample(self, t: float, rollout_tokens: int, trained_tokens: int, prefill_tokens: int | None = None) -> None:
        """Called by the coordinator's tick; `prefill_tokens`: the routes' `prefilled` summed."""
        self.samples.append((t, rollout_tokens, trained_tokens, prefill_tokens))
        while len(self.samples) > 2 and t - self.samples[1][0] >= self.window_s:
            self.samples.popleft()

    def per_second(self) -> tuple[float | None, float | None]:
        """(rollout, training) tokens/s; None until two samples span some time."""
        if len(self.samples) < 2 or self.samples[-1][0] <= self.samples[0][0]:
            return None, None
        (t0, r0, k0, _), (t1, r1, k1, _) = self.samples[0], self.samples[-1]
        return (r1 - r0) / (t1 - t0), (k1 - k0) / (t1 - t0)

    def prefill_per_second(self) -> float | None:
        """Prompt tokens prefilled per second; None until two samples with a count span some time."""
        if len(self.samples) < 2 or self.samples[-1][0] <= self.samples[0][0]:
            return None
        (t0, _, _, p0), (t1, _, _, p1) = self.samples[0], self.samples[-1]
        return None if p0 is None or p1 is None else (p1 - p0) / (t1 - t0)


def shown_phase(run, budgets) -> str:
    """The execution's phase as the view shows it: the launcher's, except while its harness
    runs: "model call" when it has a call in flight at the proxy (`budgets`: proxy/budget.py;
    at an engine or waiting for one), "tool" between calls, "harness" before its first."""
    if run.phase != "harness" or budgets is None:
        return run.phase
    if budgets.in_flight(run.id):
        return "model call"
    return "tool" if run.recorder is not None and run.recorder.calls else "harness"


def execution_rows(active, *, budgets, last_reward: dict, queued: int, wall: float,
                   keep: int = EXECUTION_ROWS) -> tuple[list[dict], dict[str, int]]:
    """The `keep` running executions that have run longest (first), and how many are in each
    phase (SHOWN_PHASES; `queued`: those waiting for a slot). One pass over the running
    ones; `wall`: time.time() now. A time not known yet (not started) is None."""
    phases = dict.fromkeys(SHOWN_PHASES, 0)
    phases["queued"] = queued
    rows = []
    for run in active:
        phase = shown_phase(run, budgets)
        phases[phase] = phases.get(phase, 0) + 1
        rows.append((run, phase, None if run.t_start is None else wall - run.t_start))
    out = []
    for run, phase, elapsed in heapq.nlargest(keep, rows, key=lambda r: -1.0 if r[2] is None else r[2]):
        out.append({
            "id": run.id, "task": str(run.task.id), "eval": run.group < 0, "phase": phase,
            "adopted": run.adopted,  # its harness outlived an earlier coordinator, taken back
            "phase_s": None if run.phase_t is None else round(wall - run.phase_t, 1),
            "calls": len(run.recorder.calls) if run.recorder is not None else 0,  # none before its harness
            "calls_in_flight": budgets.in_flight(run.id) if budgets is not None else None,
            "elapsed_s": None if elapsed is None else round(elapsed, 1),
            "last_reward": last_reward.get(run.task.id),  # the task's last valid outcome; None: none yet
        })
    return out, phases


def _restart(metrics) -> dict | None:
    ev = (getattr(metrics, "last", None) or {}).get("resume")  # the journal's, once metrics exist
    if ev is None:
        return None
    return {"step": ev.get("step"), "down_s": ev.get("down_s"), "adopted": ev.get("executions_adopted", 0),
            "restored": ev.get("executions_restored", 0), "redispatched": ev.get("executions_redispatched", 0)}


def snapshot(c, *, metrics, steps, cells, wl, buffer, executions, rates, probe, gc, table=None, link=None,
             proxy=None, launcher=None, stopping: bool = False) -> dict:
    """Everything the live view shows, as plain data (times: seconds since the run started),
    read from the run's config `c` and its owners (main.py's; those not made yet: None);
    `stopping`: a signal asked the run to stop."""
    counters = wl.c
    now = metrics.now() if metrics else 0.0
    batch = steps.in_flight()
    routes = table.routes if table else {}
    links = link.nodes if link else {}
    rows = []
    for i, role in enumerate(cells.roles):
        node = cells.nodes[i] if i < len(cells.nodes) else None
        route = routes.get(node)
        conn = links.get(node)
        history = cells.history[i]
        rows.append({
            "cell": i, "node": node, "nodes": 1, "role": role,  # while switching: the role it is moving to
            "switching": not cells.settled(i),
            "alive": None if conn is None else conn.alive,
            "running": route.inflight if route else 0,
            "accepting": route.accepting if route else False,
            "rollout_tokens": route.tokens if route else 0,
            "homes": len(route.homes) if route else 0,  # executions whose calls go here
            "hit_rate": None if route is None or route.hit_rate is None else round(route.hit_rate, 4),
            "cached_tokens": route.cached_tokens if route else 0,
            "prompt_tokens": route.prompt_tokens if route else 0,
            "awaiting_first_token": route.awaiting if route else 0,  # of `running`: queued or in prefill
            "prefilled_tokens": route.prefilled if route else 0,
            "claimed": batch.claimed.get(i, 0) if batch else 0,
            "in_role_s": round(now - history[-1][0], 1),
            "timeline": [[round(t, 2), r] for t, r in history[-TIMELINE_KEEP:]],
        })
    rollout_tps, train_tps = rates.per_second()
    # Prefill is unknown (None), not 0, until an engine has said what it reused.
    prefill_tps = rates.prefill_per_second() if any(r.prefill_reports for r in routes.values()) else None
    last = steps.reports[-1] if steps.reports else None
    wall = time.time()
    running, phases = execution_rows(executions.active.values(), budgets=proxy.budgets if proxy else None,
                                     last_reward=executions.last_reward, queued=counters.queued, wall=wall)
    return {
        "t": now, "wall": wall, "policy": c.policy, "run_dir": str(c.run_dir),
        "state": "finishing" if stopping or steps.steps_done >= c.steps else "running",
        "proxy": proxy.base_url if proxy else None,
        "steps": {"done": steps.steps_done, "target": c.steps},
        "version": steps.version, "trainer_version": steps.trainer_version,
        "burst": {"steps": steps.steps_in_burst, "mu": c.mu, "phi": c.phi,
                  "publications": steps.publications},
        "groups": {"per_step": c.groups_per_step, "size": c.group_size},  # B and N
        "waterlevel": {"queued": counters.queued, "running": counters.running, "finished": counters.f,
                       "d": counters.d, "p": counters.p, "f": counters.f, "level": counters.waterlevel},
        "ready_groups": buffer.ready_count,
        "step_in_flight": batch is not None,
        "last_step": None if last is None else {
            "step": last.step, "reward_mean": last.reward_mean, "reward_valid_frac": last.reward_valid_frac,
            "staleness_mean": last.staleness_mean, "loss": last.loss, "tokens_trained": last.tokens_trained,
            "seconds": last.seconds, "cells_training": last.cells_training, "trained": last.trained,
            "groups": last.groups, "note": last.note},
        "tokens_per_s": {"rollout": None if rollout_tps is None else round(rollout_tps, 1),
                         "training": None if train_tps is None else round(train_tps, 1),
                         "prefill": None if prefill_tps is None else round(prefill_tps, 1)},
        "rates_window_s": rates.window_s,
        # Model calls at the engines now (executions `running` may be in harness code instead).
        "calls": {"in_flight": sum(r.inflight for r in routes.values()),
                  "awaiting_first_token": sum(r.awaiting for r in routes.values())},
        "role_switches": cells.switches[-8:],
        # How late the event loop ran over the last window (ms): what a harness call waited.
        "loop_lag_ms": probe.lag_ms(since=probe.samples[-1][0] - WINDOW_S)
        if probe.samples else None,
        # The cycle collector: freezes so far, collections and the longest pause per generation.
        "gc": gc.status(),
        "statuses": dict(executions.status_counts),
        # This session's resume, if it is one: the restart's downtime and what it took back.
        "restart": _restart(metrics),
        "cells": rows,
        # The running executions that have run longest, and the count in each phase (queued first).
        "executions": running, "phases": phases,
        # Which engine serves which execution: decisions so far, the load bound, every home.
        "routing": table.status() if table else None,
        # Sandbox hosts where executions run in containers: state, running, building, failed.
        "sandbox_hosts": launcher.pool.rows() if launcher is not None
        and launcher.backend.needs_image else [],
    }
