"""main.py: the `gyre` command (typer). Commands only build a config and call into the
package; domain errors print as one `[error]` line (tracebacks with --debug)."""

from __future__ import annotations

import logging
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Annotated, Optional

import typer

from gyre.cli.options import (CellOpt, CoordinatorOpt, DebugOpt, DevicesOpt, HeartbeatOpt, ModelDirArg,
                              ModelKindArg, ModelOpt, NodeIdOpt, NodeRankOpt, RunDirOpt, SeedOpt, StepsOpt,
                              WelcomeTimeoutOpt)

app = typer.Typer(name="gyre", no_args_is_help=True, add_completion=False,
                  help="Online RL for LLM agents in black-box harnesses.")
_debug = False


def _version() -> str:
    try:
        return version("gyre")
    except PackageNotFoundError:
        return "0+unknown"


def _on_version(value: bool) -> None:
    if value:
        typer.echo(f"gyre {_version()}")
        raise typer.Exit()


@app.callback()
def root(
    version_: Annotated[Optional[bool], typer.Option("--version", callback=_on_version, is_eager=True,
                                                     help="Print the version and exit.")] = None,
    debug: DebugOpt = False,
) -> None:
    global _debug
    _debug = debug
    logging.basicConfig(level=logging.DEBUG if debug else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


@app.command("init-model")
def init_model(kind: ModelKindArg, out_dir: ModelDirArg, seed: SeedOpt = 0) -> None:
    """Write a model directory (config, tokenizer, chat template, safetensors)."""
    from gyre.workerd.modeldir import ModelDirError, init_tiny

    if kind != "tiny":
        _fail(ModelDirError(f"unknown model kind {kind!r} (built in: tiny)"))
    typer.echo(str(init_tiny(out_dir, seed=seed)))


@app.command()
def workerd(
    coordinator: CoordinatorOpt,
    cell: CellOpt = None,
    node_rank: NodeRankOpt = 0,
    node_id: NodeIdOpt = "",
    devices: DevicesOpt = "cpu",
    heartbeat: HeartbeatOpt = 1.0,
    welcome_timeout: WelcomeTimeoutOpt = 60.0,
) -> None:
    """Run this node's worker daemon (rollout engine + trainer) until stopped."""
    from gyre.workerd.config import WorkerConfig
    from gyre.workerd.server import serve

    config = WorkerConfig(coordinator=coordinator, cell=cell, node_rank=node_rank, node_id=node_id,
                          devices=tuple(d for d in devices.split(",") if d), heartbeat_s=heartbeat,
                          welcome_timeout_s=welcome_timeout)
    raise typer.Exit(serve(config))


@app.command()
def up(steps: StepsOpt = 5, run_dir: RunDirOpt = None, model: ModelOpt = None, seed: SeedOpt = 0) -> None:
    """Run RL on the embedded default. For now: a byte-preference loop on two local workerd
    processes (rollout cell + training cell); the harness-driven loop lands with the coordinator."""
    from gyre.coordinator.bootstrap import run_bootstrap

    _guard(run_bootstrap, steps=steps, run_dir=run_dir, model=model, seed=seed)


def _not_yet(name: str, issue: str) -> None:
    typer.echo(f"[error] `gyre {name}` is not built yet: it lands with the {issue} issue.", err=True)
    raise typer.Exit(2)


@app.command()
def serve() -> None:
    """Run the proxy + a local engine for any harness (not built yet)."""
    _not_yet("serve", "'Proxy and trajectory processor'")


@app.command()
def inspect() -> None:
    """Show recorded trajectory trees (not built yet)."""
    _not_yet("inspect", "'Proxy and trajectory processor'")


@app.command()
def top() -> None:
    """Attach a live view to a running coordinator (not built yet)."""
    _not_yet("top", "'Operating gyre on bare metal'")


@app.command()
def sim() -> None:
    """Simulate placement policies on a workload (not built yet)."""
    _not_yet("sim", "'Elastic scheduler'")


def _guard(fn, **kwargs):
    from gyre.workerd.wire import GyreError

    try:
        return fn(**kwargs)
    except GyreError as e:
        _fail(e)


def _fail(e: Exception) -> None:
    if _debug:
        raise e
    typer.echo(f"[error] {e}", err=True)
    raise typer.Exit(1) from None


def main() -> None:
    app()
