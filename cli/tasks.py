"""tasks.py: `gyre tasks check` and `gyre tasks run`: a task source validated, or run once."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import typer

from gyre.cli.common import (
    check_model,
    check_timeout,
    config_timeout,
    default_run_dir,
    fail,
    flag_or_config,
    guard,
    harness_preset,
    model_or_tiny,
    sandbox_for,
)
from gyre.cli.options import (
    JsonOpt,
    ModelOpt,
    ServeConfigOpt,
    ServeSetOpt,
    TaskHarnessOpt,
    TaskSandboxOpt,
    TasksRunDirOpt,
    TimeoutOpt,
)

tasks_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                        help="Task sources (Harbor folders, SWE-style or gyre JSONL): check them, run them once.")

TaskPathArg = Annotated[Path, typer.Argument(help="A Harbor task folder, a folder of them, or a JSONL file (SWE-style rows or gyre tasks).")]
SandboxUrlOpt = Annotated[str | None, typer.Option("--sandbox-url", help="The engine's Docker-compatible endpoint (default: gyre's own podman service; docker's socket).")]
SolutionOpt = Annotated[bool, typer.Option("--solution", help="Run each task's own solution/solve.sh instead of a harness: checks that the task is solvable and its tests score it.")]
ConcurrencyOpt = Annotated[int, typer.Option("--concurrency", help="Tasks running at once.")]
KeepOpt = Annotated[str | None, typer.Option("--keep-sandbox", help="Keep sandboxes afterwards: never, on_failure or always (default: the config's keep_sandbox, else never).")]


@tasks_app.command("check")
def check(path: TaskPathArg, as_json: JsonOpt = False) -> None:
    """Validate a task source and list what it holds (errors name the file and field)."""
    from gyre.coordinator.taskformats import describe, load_task_source

    tasks = guard(load_task_source, path=path)
    rows = [describe(t) for t in tasks]
    if as_json:
        typer.echo(json.dumps({"path": str(path), "tasks": rows}, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{path}: {len(rows)} task(s)")
    table.add_column("task", no_wrap=True)
    for col in ("format", "image", "agent s", "verifier", "limits", "solution"):
        table.add_column(col)
    for r in rows:
        limits = " ".join(f"{r[k]:g}{unit}" for k, unit in (("cpus", "cpu"), ("memory_mb", "M"),
                                                             ("storage_mb", "M disk")) if r.get(k))
        timeout = r.get("agent_timeout_s")
        table.add_row(r["task"], r["format"], "Dockerfile" if r.get("build") else r.get("image") or "-",
                      f"{timeout:g}" if timeout else "-", r["verifier"], limits or "-", "yes" if r["solution"] else "no")
    Console().print(table)
    for r in rows:
        if r.get("unknown_keys"):
            typer.echo(f"{r['task']}: ignored unknown key(s) {', '.join(r['unknown_keys'])}")
        if r.get("allow_internet"):
            typer.echo(f"{r['task']}: asks for the internet (allow_internet = true): runs only with "
                       "sandbox_internet = true")
        if r.get("cpus") and r["cpus"] > (os.cpu_count() or 1):  # a sandbox host may have more: not an error
            typer.echo(f"{r['task']}: asks for {r['cpus']:g} CPUs; this machine has {os.cpu_count()}: podman "
                       "refuses such a container here")


@tasks_app.command("run")
def run(path: TaskPathArg, harness: TaskHarnessOpt = None, sandbox: TaskSandboxOpt = None,
        solution: SolutionOpt = False, as_json: JsonOpt = False, model: ModelOpt = None, run_dir: TasksRunDirOpt = None,
        config: ServeConfigOpt = None, concurrency: ConcurrencyOpt = 2, timeout: TimeoutOpt = None,
        sandbox_url: SandboxUrlOpt = None, keep_sandbox: KeepOpt = None, set_: ServeSetOpt = None) -> None:
    """Run every task once (no training) and print each one's status and score."""
    import uvloop

    from gyre.coordinator.launcher import KEEP
    from gyre.coordinator.rundir import absolute, claim, fresh
    from gyre.coordinator.serve import serve_fields, serve_settings
    from gyre.coordinator.taskformats import load_task_source
    from gyre.coordinator.taskrun import run_tasks

    keep_sandbox = flag_or_config(keep_sandbox, config=config, key="keep_sandbox", option="--keep-sandbox",
                                  default="never", check=lambda v: None if v in KEEP else f"must be one of "
                                  f"{', '.join(KEEP)}")
    if concurrency < 1:
        fail(ValueError("--concurrency must be >= 1"))
    check_timeout(timeout)
    base_timeout = config_timeout(config)
    tasks = guard(load_task_source, path=path)
    sandbox, sandbox_url = sandbox_for(flag=sandbox, url=sandbox_url, config=config, tasks=tasks, source=str(path))
    preset = harness_preset(harness, config, "process" if solution else sandbox)  # --solution runs no harness
    if model is not None:
        guard(check_model, model_dir=model)
    fields = guard(serve_fields, config=config, sets=set_ or [])
    # The default name, made here: unique even within a second (as eval's and serve's).
    run_dir = absolute(run_dir) if run_dir else guard(fresh, path=default_run_dir("tasks"))
    lock = guard(claim, run_dir=run_dir, command="serve")
    try:
        model_dir = model_or_tiny(absolute(model) if model else None, run_dir, 0)
        settings = guard(serve_settings, model_dir=model_dir, fields=fields)
        (run_dir / "config.json").write_text(json.dumps({
            "command": "tasks run", "path": str(absolute(path)), "harness": preset.name, "sandbox": sandbox,
            "solution": solution, "model": str(model_dir), "timeout_s": timeout, "execution_timeout_s": base_timeout,
            "keep_sandbox": keep_sandbox}, indent=2))

        def progress(r: dict) -> None:
            if not as_json:
                score = "-" if r["score"] is None else f"{r['score']:.3f}"
                typer.echo(f"  {r['task']}: {r['status']} {score}", err=True)

        results = guard(uvloop.run, main=run_tasks(
            tasks, preset=preset, model_dir=model_dir, run_dir=run_dir, sandbox=sandbox, sandbox_url=sandbox_url,
            solution=solution, concurrency=concurrency, timeout_s=timeout, default_timeout_s=base_timeout,
            settings=settings, keep_sandbox=keep_sandbox, on_result=progress))
    finally:
        lock.release()
    if as_json:
        typer.echo(json.dumps({"tasks": [{k: r[k] for k in ("task", "status", "score", "ref", "execution")}
                                         for r in results]}))
    else:
        _table(results, run_dir)
    ok = all(r["status"] in ("completed", "timed_out", "harness_error") for r in results)
    raise typer.Exit(0 if ok else 1)


def _table(results: list[dict], run_dir: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{len(results)} task(s); records in {run_dir}")
    for col in ("task", "status", "score", "calls", "ref"):
        table.add_column(col)
    for r in results:
        table.add_row(r["task"], r["status"], "-" if r["score"] is None else f"{r['score']:.3f}", str(r["calls"]),
                      (r["ref"] or "")[:60])
    Console().print(table)
    scored = [r["score"] for r in results if r["score"] is not None]
    if scored:
        typer.echo(f"mean score {sum(scored) / len(scored):.3f} over {len(scored)} scored of {len(results)}")
