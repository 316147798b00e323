"""inspect.py: `gyre inspect RUN_DIR`: the run's summary, then one row per execution; with
`--execution ID` that execution's folded trajectory tree (roots, branch points, leaves) and
admission stats. Outcomes come from config.json and metrics.jsonl (a torn line skipped), or
tasks.json (`gyre tasks run`, `gyre eval`) or an execution's summary.json (`gyre serve`), trees
from each execution's nodes.jsonl / calls.jsonl. Pure rendering from the recorded files: it
changes nothing, and reads a live run as it stands.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import orjson
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.tree import Tree as RichTree

from gyre.coordinator.metrics import read_events
from gyre.coordinator.rundir import live_coordinator, state
from gyre.coordinator.sandbox.reaper import adoptable_until
from gyre.proxy.admission import admit
from gyre.proxy.records import Recorded, load_run
from gyre.proxy.tree import Tree


def admission_stats(rec: Recorded, j_max: int | None) -> dict:
    """Admitted trajectories and their tokens: targets, the path-expanded forward pass
    (`forward_tokens`, as `packing = "paths"` computes it), and the tree form's (each node on
    an admitted path once: `forward_tokens_tree`, equal to the unique admitted tokens)."""
    trajectories = admit(rec.tree, rec.leaf_roles, j_max=j_max)
    unique = sum(len(rec.tree.nodes[n].tokens) for n in {n for t in trajectories for n in t.path})
    expanded = sum(rec.tree.nodes[t.path[-1]].end for t in trajectories)
    return {"trajectories": len(trajectories),
            "admitted_tokens": sum(t.target_tokens(rec.tree) for t in trajectories),
            "forward_tokens": expanded, "forward_tokens_tree": unique,
            "unique_admitted_tokens": unique, "expanded_tokens": expanded}


def summary(rec: Recorded, j_max: int) -> dict:
    """One execution's record: its tree, calls (`status`: the calls' statuses counted) and
    admission. Its outcome (`execution_status`, `reward`, ...) is added by inspect_run."""
    s = rec.tree.stats()
    s["tree_expanded_tokens"] = s.pop("expanded_tokens")  # every leaf's path; `expanded_tokens` is training's
    admitted = admission_stats(rec, j_max)
    # What training at this J_max forwards, tree form against path rows (the run's default J_max).
    training = {k: admitted[k] for k in ("forward_tokens_tree", "unique_admitted_tokens", "expanded_tokens")}
    return {"execution": rec.id, "calls": len(rec.calls), **s, "leaf_roles": _count(rec.leaf_roles.values()),
            "status": _count(c["status"] for c in rec.calls), **prefill_stats(rec.calls), **training,
            f"admission_j{j_max}": admitted, "admission_all": admission_stats(rec, None)}


def prefill_stats(calls: list[dict]) -> dict:
    """The engines' prefill over these calls: prompt tokens reused (prefix cache, handed-over
    KV) and computed, and the hit rate; None where no call's engine said (records from before
    the cache have no such fields)."""
    known = [c for c in calls if c.get("cached_tokens") is not None]
    cached = sum(c["cached_tokens"] for c in known) if known else None
    prefill = sum(c["prefill_tokens"] for c in known) if known else None
    total = (cached or 0) + (prefill or 0)
    return {"cached_tokens": cached, "prefill_tokens": prefill,
            "cache_hit_rate": round(cached / total, 4) if known and total else None}


def _count(items) -> dict:
    out: dict = {}
    for i in items:
        out[i] = out.get(i, 0) + 1
    return out


# --- the run: config.json and metrics.jsonl ------------------------------------------------


@dataclass
class RunLog:
    """What a run directory's own files say: `command` "up", "serve", "tasks run" or "eval",
    `state` (for `gyre up` runs) finished / stopped / running / crashed (for `tasks run` and
    `eval`: finished, or interrupted before its tasks.json), and metrics.jsonl's events, the last of each
    kind per execution or step (a resumed run may redo both)."""

    command: str
    state: str | None = None
    steps_done: int | None = None
    steps_target: int | None = None
    steps_unsaved: int = 0  # of steps_done, those after the newest intact checkpoint (a resume redoes them)
    outcomes: dict[str, dict] = field(default_factory=dict)  # execution id -> its `execution` event
    scored: dict[str, dict] = field(default_factory=dict)  # execution id -> its tasks.json result (tasks run, eval)
    groups: dict[str, int] = field(default_factory=dict)  # execution id -> group (`dispatch` events)
    steps: dict[int, dict] = field(default_factory=dict)  # step -> its `step` event
    summary: dict | None = None  # the closing `summary` event, if the run closed after its last step
    restarts: list[dict] = field(default_factory=list)  # each `resume` event: a session that continued the run
    skipped_lines: int = 0  # lines of metrics.jsonl that were no whole JSON object (a torn one)


def read_run_log(run_dir: Path) -> RunLog:
    config = json_file(run_dir / "config.json")
    if config is None or config.get("command") == "serve":  # `gyre serve` keeps no metrics
        log = RunLog("serve")
    elif config.get("command") in ("tasks run", "eval"):  # no steps: its tasks.json says when it ended
        log = RunLog(config["command"], "finished" if (run_dir / "tasks.json").exists() else "interrupted")
    else:
        s = state(run_dir)  # the authority `gyre up --resume` reads; "crashed": no closing summary
        running = s.kind == "crashed" and live_coordinator(run_dir)
        log = RunLog("up", "running" if running else s.kind, s.steps_done + s.unsaved, s.steps_target, s.unsaved)
    tasks = (json_file(run_dir / "tasks.json") or {}).get("tasks")
    for r in tasks if isinstance(tasks, list) else []:  # `gyre tasks run` and `gyre eval` write it at the end
        if isinstance(r, dict) and isinstance(r.get("execution"), str):
            log.scored[r["execution"]] = r
    journal = read_events(run_dir / "metrics.jsonl")
    log.skipped_lines = len(journal.bad)
    for ev in journal.events:
        kind = ev.get("event")
        if kind == "execution" and ev.get("id") is not None:
            log.outcomes[ev["id"]] = ev
        elif kind == "dispatch":
            log.groups.update({rid: ev.get("group") for rid in ev.get("runs") or []})
        elif kind == "step" and ev.get("step") is not None:
            log.steps[int(ev["step"])], log.summary = ev, None
        elif kind == "summary":
            log.summary = ev
        elif kind == "resume":
            log.restarts.append(ev)
    return log


def json_file(path: Path) -> dict | None:
    try:
        obj = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None
    return obj if isinstance(obj, dict) else None


def outcome(run_dir: Path, log: RunLog, ex_id: str) -> dict:
    """An execution's status, reward and validity as the run recorded them. With no
    `execution` event it has none yet: never a made-up reward, only a status saying why."""
    ev = log.outcomes.get(ex_id)
    if ev is not None:
        return {"execution_status": ev.get("status"), "reward": ev.get("reward"), "valid": ev.get("valid"),
                "group": ev.get("group", log.groups.get(ex_id)), "adopted": bool(ev.get("adopted"))}
    scored = log.scored.get(ex_id)
    if scored is not None:
        return {"execution_status": scored.get("status"), "reward": scored.get("score"), "valid": scored.get("valid"),
                "group": None}
    served = json_file(run_dir / "executions" / ex_id / "summary.json")
    if served is not None:  # `gyre serve --harness` ran it once; "score" only where a task scored it
        return {"execution_status": served.get("status"), "reward": served.get("score"),
                "valid": served.get("valid"), "group": None}
    if (run_dir / "executions" / f"{ex_id}-r1").is_dir():
        status = "redone"  # in flight at a crash; the resumed run dispatched it again (resume.redo_id)
    elif log.state in ("crashed", "stopped") and adoptable_until(run_dir / "executions" / ex_id) is not None:
        status = "left running"  # its harness may still run in its container: `gyre up --resume` adopts it
    else:
        status = {"running": "running", "crashed": "interrupted"}.get(log.state or "", "unknown")
    return {"execution_status": status, "reward": None, "valid": None, "group": log.groups.get(ex_id)}


def run_summary(run_dir: Path, log: RunLog, outcomes: dict[str, dict], calls: list[dict]) -> dict:
    """The run as a whole: progress, executions by status, rewards, tokens trained, prefill.
    `reward_mean` is over the valid executions with a reward, as a step's `reward_mean` is."""
    rewards = [o["reward"] for o in outcomes.values() if o["valid"] is not False and o["reward"] is not None]
    last = log.steps[max(log.steps)] if log.steps else None
    trained = (log.summary or {}).get("tokens_trained")
    if trained is None and log.steps:
        trained = sum(s.get("tokens_trained") or 0 for s in log.steps.values())
    return {"run_dir": str(run_dir), "command": log.command, "state": log.state,
            "steps_done": log.steps_done, "steps_target": log.steps_target, "steps_unsaved": log.steps_unsaved,
            "executions": len(outcomes), "execution_status": _count(o["execution_status"] for o in outcomes.values()),
            "rewarded": len(rewards), "reward_mean": sum(rewards) / len(rewards) if rewards else None,
            "last_step": None if last is None else {k: last.get(k) for k in ("step", "reward_mean", "tokens_trained")},
            "tokens_trained": trained, "calls": len(calls), **prefill_stats(calls),
            "unrecorded": sorted(i for i in outcomes if not (run_dir / "executions" / i).is_dir()),
            "skipped_lines": log.skipped_lines,
            # Each session that continued the run: its step, downtime and what it took back (issue 34).
            "restarts": [{"step": r.get("step"), "down_s": r.get("down_s"),
                          "adopted": r.get("executions_adopted", 0), "restored": r.get("executions_restored", 0),
                          "redispatched": r.get("executions_redispatched", 0),
                          # workers that outlived it with their weights (None: a gyre that did not say)
                          "workers_kept": r.get("workers_kept"), "checkpoint_loaded": r.get("checkpoint_loaded")}
                         for r in log.restarts]}


# --- rendering ----------------------------------------------------------------------------


def render_run(run: dict) -> list[str]:
    """The summary's lines: progress, executions by status, rewards and tokens, prefill."""
    if run["command"] == "serve":
        head = f"[bold]{escape(run['run_dir'])}[/]: gyre serve run"
    elif run["command"] in ("tasks run", "eval"):
        head = f"[bold]{escape(run['run_dir'])}[/]: gyre {run['command']}, {run['state']}"
    else:
        target = "?" if run["steps_target"] is None else run["steps_target"]
        head = f"[bold]{escape(run['run_dir'])}[/]: {run['state']}, step {run['steps_done']}/{target}"
        if run.get("steps_unsaved"):
            saved = run["steps_done"] - run["steps_unsaved"]
            head += (f" ([red]{run['steps_unsaved']} not saved[/]: no intact checkpoint holds them; "
                     f"a resume starts from step {saved})")
    by_status = ", ".join(f"{escape(str(k))} {v}" for k, v in sorted(run["execution_status"].items(),
                                                                      key=lambda kv: (-kv[1], str(kv[0]))))
    never = f" ({len(run['unrecorded'])} never started)" if run["unrecorded"] else ""
    n = run["executions"]
    lines = [head, f"{n} execution{'' if n == 1 else 's'}{never}: {by_status or 'none yet'}"]
    reward = f"reward mean {_reward(run['reward_mean'])} ({run['rewarded']} scored)"
    if run["last_step"] is not None:
        reward += f"; step {run['last_step']['step']}: {_reward(run['last_step']['reward_mean'])}"
    if run["command"] == "up":
        lines.append(reward + f"; {_num(run['tokens_trained'])} tokens trained")
    elif run["rewarded"]:  # a `gyre serve --task` run, scored by its task's tests
        lines.append(reward)
    lines.append(f"{run['calls']} calls: prompt tokens reused {_num(run['cached_tokens'])}, computed "
                 f"{_num(run['prefill_tokens'])}, cache hits {_pct(run['cache_hit_rate'])}")
    for r in run.get("restarts") or ():
        down = "unknown" if r["down_s"] is None else f"{r['down_s']:.1f} s"
        lines.append(f"resumed at step {r['step']}: down {down}, {r['adopted']} running execution(s) adopted"
                     f"{' (* below)' if r['adopted'] else ''}, {r['restored']} closed restored, "
                     f"{r['redispatched']} run again"
                     + (f"; {r['workers_kept']} worker(s) kept their weights" if r.get("workers_kept") else ""))
    if run["skipped_lines"]:
        lines.append(f"[yellow]{run['skipped_lines']} torn line(s) in metrics.jsonl skipped[/]")
    return lines


def render_rows(rows: list[dict]) -> Table:
    """One row per execution: its outcome, then its calls and tree."""
    # No vertical rules, one space between columns and two-line headers: a row fits in 80
    # columns (a pipe, a CI log), `leaf roles` last, where it may wrap.
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, padding=0, header_style="bold")
    t.add_column("execution", no_wrap=True)
    t.add_column("group", justify="right")
    t.add_column("status", no_wrap=True)
    for col in ("reward", "valid", "calls", "policy\ntokens", "external\ntokens", "cache\nhits"):
        t.add_column(col, justify="right", no_wrap=True)
    t.add_column("leaf roles")
    for s in rows:
        valid = {True: "yes", False: "no"}.get(s["valid"], "n/a")
        roles = ", ".join(f"{k} {v}" for k, v in sorted(s["leaf_roles"].items(), key=lambda kv: (-kv[1], kv[0])))
        name = escape(s["execution"]) + ("*" if s.get("adopted") else "")  # ran on through a restart
        t.add_row(name, _num(s["group"]), escape(str(s["execution_status"])),
                  _reward(s["reward"]), valid, str(s["calls"]), str(s["policy_tokens"]), str(s["external_tokens"]),
                  _pct(s["cache_hit_rate"]), escape(roles) or "-")
    return t


def render_tree(rec: Recorded) -> RichTree:
    tree = rec.tree
    view = RichTree(f"[bold]{escape(rec.id)}[/] ({len(rec.calls)} calls)")
    for rid in tree.roots.values():
        _fold(tree, rid, view, rec.leaf_roles)
    return view


def _fold(tree: Tree, start: int, parent_view: RichTree, roles: dict[int, str]) -> None:
    """Follow the single-child chain from `start`; add one line for it, recurse at a branch."""
    policy = external = calls = 0
    n = start
    while True:
        node = tree.nodes[n]
        if node.policy:
            policy += len(node.tokens)
        else:
            external += len(node.tokens)
        calls += node.kind == "output"
        if len(node.children) != 1:
            break
        n = next(iter(node.children.values()))
    node = tree.nodes[n]
    label = f"{calls} outputs, [green]{policy} policy[/] / [dim]{external} external[/] tokens"
    if not node.children:
        label = f"[bold]{roles.get(n, '?')}[/] leaf: " + label + f" (path {node.end} tokens)"
    else:
        label = f"branch after {node.end} tokens: " + label
    branch = parent_view.add(label)
    for child in node.children.values():
        _fold(tree, child, branch, roles)


def render_admission(s: dict, j_max: int) -> Table:
    """One execution's tree and admission figures."""
    t = Table(show_header=True, header_style="bold")
    for col in ("nodes", "roots", "leaves", "unique tokens", "expanded tokens",
                f"admitted @J={j_max}", "admitted @all", "cache hits"):
        t.add_column(col, justify="right")
    t.add_row(str(s["nodes"]), str(s["roots"]), str(s["leaves"]), str(s["unique_tokens"]),
              str(s["tree_expanded_tokens"]), str(s[f"admission_j{j_max}"]["admitted_tokens"]),
              str(s["admission_all"]["admitted_tokens"]), _pct(s["cache_hit_rate"]))
    return t


def inspect_run(run_dir: Path, *, execution: str | None, as_json: bool, j_max: int, console: Console) -> dict:
    """{"run": the run's summary, "executions": one summary per execution (or only
    `execution`'s)}; printed unless `as_json`. Trees are shown for `--execution`, or where
    the run has a single execution (a `gyre serve --harness` run)."""
    records = load_run(run_dir)
    log = read_run_log(run_dir)
    outcomes = {i: outcome(run_dir, log, i) for i in sorted({r.id for r in records} | set(log.outcomes))}
    run = run_summary(run_dir, log, outcomes, [c for r in records for c in r.calls])
    chosen = [r for r in records if execution is None or r.id == execution]
    if execution is not None and not chosen:
        raise no_execution(run_dir, execution, [r.id for r in records])
    rows = [{**summary(r, j_max), **outcomes[r.id]} for r in chosen]
    if not as_json:
        if execution is None:
            for line in render_run(run):
                console.print(line, soft_wrap=True)  # a long run path is not cut mid-line
        if rows:
            console.print(render_rows(rows))
        if execution is not None or len(records) == 1:
            for rec, s in zip(chosen, rows):
                console.print(render_tree(rec))
                console.print(render_admission(s, j_max))
        elif records:
            console.print("[dim]one execution's trajectory tree: gyre inspect RUN_DIR --execution ID[/]")
    return {"run": run, "executions": rows}


def no_execution(run_dir: Path, execution: str, ids: list[str]) -> FileNotFoundError:
    """The one-line error for an execution the run does not hold, naming some that it does."""
    named = ", ".join(ids) if len(ids) <= 6 else f"{', '.join(ids[:3])}, ..., {ids[-1]}"
    listed = f"{len(ids)} recorded: {named}; gyre inspect {run_dir} lists them" if ids else "none recorded yet"
    return FileNotFoundError(f"no execution {execution!r} in {run_dir} ({listed})")


def _reward(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3f}"


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1%}"


def _num(v: int | None) -> str:
    return "n/a" if v is None else str(v)
