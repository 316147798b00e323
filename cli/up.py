"""up.py: `gyre up`: build the run's config (file + flags), run the coordinator, print progress.

On a terminal it draws the live view (live.py); otherwise (or with --no-live) plain
lines: one per step and a status line every 10 s, then the role timeline (timeline.py).
Presentation only: the loop itself is coordinator/main.py.
"""

from __future__ import annotations

from pathlib import Path

from gyre.coordinator.config import CoordinatorConfig
from gyre.coordinator.main import Coordinator, StepReport


def _print_step(steps: int):
    def show(r: StepReport) -> None:
        reward = "n/a" if r.reward_mean is None else f"{r.reward_mean:.3f}"
        valid = "n/a" if r.reward_valid_frac is None else f"{r.reward_valid_frac:.2f}"
        print(f"step {r.step}/{steps}  version {r.version}  reward {reward}  valid {valid}  "
              f"staleness {r.staleness_mean:.2f}  groups {r.groups}  tokens {r.tokens_trained}  "
              f"cells_training {r.cells_training}  {r.seconds:.1f}s{_why_flat(r)}", flush=True)
    return show


def _why_flat(r: StepReport) -> str:
    """Why a step trained little or nothing (its diagnosis: coordinator/diagnosis.py)."""
    return f"  ({r.note})" if r.note else ""


def run_up(config: CoordinatorConfig, live: bool = False, resume: bool = False) -> int:
    """Run the coordinator; with `live`, draw the live view (live.py) while it runs;
    with `resume`, continue config.run_dir from its latest checkpoint. Returns the exit
    status: 0, or 128 + the signal that stopped the run (130 for Ctrl-C, 138 for the SIGUSR1 of
    `gyre restart`: its executions in containers were left running for the resume)."""
    import uvloop

    print(f"gyre up: policy {config.policy}, {config.cells} cells, {config.steps} steps of "
          f"B={config.groups_per_step} groups x N={config.group_size} executions, phi={config.phi} (batches "
          f"queued ahead), mu={config.mu} (steps per publication) -> {config.run_dir}", flush=True)
    if resume:
        print(f"resuming {config.run_dir} from its latest checkpoint", flush=True)
    coord = Coordinator(config, on_step=_print_step(config.steps), resume=resume, workers=inproc_workers(config))
    reports = uvloop.run(_run_with_view(coord, live))
    rewards = " ".join("n/a" if r.reward_mean is None else f"{r.reward_mean:.3f}" for r in reports)
    total = reports[-1].step if reports else coord.steps.steps_done
    print(f"done: step {total}/{config.steps} ({len(reports)} this session); reward by step: {rewards or '(none)'}",
          flush=True)
    write_timeline(config.run_dir)
    _print_outputs(config.run_dir, coord)
    _print_lost(coord)
    if coord.stop.signal is not None:
        left = len(coord.executions.handed_off)
        running = (f"; {left} execution{'s' if left != 1 else ''} left running in {'their' if left != 1 else 'its'} "
                   f"container{'s' if left != 1 else ''}, for the resume to adopt before "
                   f"{'their' if left != 1 else 'its'} deadline{'s' if left != 1 else ''}") if left else ""
        print(f"stopped at step {coord.steps.steps_done}/{config.steps}{running}; continue with: "
              f"gyre up --resume {shown(config.run_dir)}", flush=True)
        return 128 + coord.stop.signal
    return 0


def inproc_workers(config: CoordinatorConfig):
    """The in-process workers `workers = "inproc"` asks for (the coordinator takes them from here:
    of workerd it imports only the light modules tests/test_layering.py lists), or None."""
    if config.workers != "inproc":
        return None
    from gyre.workerd.inproc import InprocWorkers

    return InprocWorkers()


def shown(path: Path) -> str:
    """`path` relative to the working directory when it is below it (as a user typed it)."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _print_lost(coord: Coordinator) -> None:
    """Trained steps that no checkpoint holds (the final one failed: its error is above), in
    red: a --resume starts after the last checkpoint, so they are trained again."""
    from rich.console import Console

    saved = coord.steps.checkpointed_step or 0
    if coord.steps.steps_done <= saved:
        return
    lost = f"step {saved + 1}" if coord.steps.steps_done == saved + 1 else f"steps {saved + 1}-{coord.steps.steps_done}"
    Console(highlight=False, soft_wrap=True).print(
        f"lost: {lost} trained but not saved (the final checkpoint failed; its error is above); "
        f"a resume continues from {f'step {saved}' if saved else 'the start'}", style="bold red", markup=False)


def _print_outputs(run_dir: Path, coord: Coordinator) -> None:
    """Where the run's results are: the trained weights (the newest checkpoint) and the timeline;
    a run that trained no token says so, and why, instead of naming "trained" weights."""
    from gyre.coordinator.resume import step_dir

    saved = coord.steps.checkpointed_step
    if coord.steps.steps_done and not coord.steps.tokens_trained:
        _print_untrained(run_dir, coord.steps.steps_done, saved)
    elif saved:
        print(f"trained weights (step {saved}): {shown(step_dir(run_dir, saved) / 'trainer.pt')}", flush=True)
    print(f"role timeline: {shown(run_dir / 'timeline.svg')}; metrics: {shown(run_dir / 'metrics.jsonl')}",
          flush=True)


def _print_untrained(run_dir: Path, steps_done: int, saved: int | None) -> None:
    """No step of the run trained a token: the weights are the base model's. Why, over the
    run's steps (its step events, a resumed run's earlier sessions too: coordinator/diagnosis.py,
    as `gyre doctor` says it), in yellow."""
    from rich.console import Console

    from gyre.coordinator.diagnosis import merge, why
    from gyre.coordinator.metrics import counted_steps, read_events

    steps = counted_steps(read_events(run_dir / "metrics.jsonl").events)
    reason = why(merge(steps), sum(e.get("groups") or 0 for e in steps)) if steps else ""
    where = f" (the checkpoint of step {saved} holds them)" if saved else ""
    Console(highlight=False, soft_wrap=True).print(
        f"trained nothing: {steps_done} step{'s' if steps_done > 1 else ''} trained 0 tokens, so the weights "
        f"equal the base model's{where}" + (f": {reason}" if reason else "")
        + "; see docs/troubleshooting.md, \"Nothing trained\"", style="bold yellow", markup=False)


async def _run_with_view(coord: Coordinator, live: bool, console=None) -> list[StepReport]:
    """The run, with the live view (a terminal) or a plain status line every 10 s.

    While the live view is up, step lines (`print`) and log records go through its console
    (live.py `follow`). A run that ends (done, or stopped by Ctrl-C) lets the view draw
    its final state before it closes; a run that fails closes it at once. Either way the
    view's last frame stays on screen and the cursor is shown again before this returns."""
    import asyncio

    from rich.console import Console

    from gyre.cli.live import follow

    interval_s = 0.5 if live else 10.0
    task = asyncio.ensure_future(coord.run())

    async def get() -> dict:
        return coord.status()

    view = asyncio.ensure_future(follow(get, interval_s=interval_s, live=live,
                                        console=console if console is not None else Console(), until=task.done))
    try:
        reports = await task
        if live:  # the next round draws the finished state and ends the view
            await asyncio.wait({view}, timeout=interval_s + 5.0)
        return reports
    finally:
        view.cancel()  # a no-op when it has ended; the live view keeps its last frame on screen
        await asyncio.gather(view, return_exceptions=True)


def write_timeline(run_dir: Path) -> None:
    """The run's role timeline: printed as text, written as timeline.svg in the run dir."""
    from gyre.cli.timeline import result_from_metrics, role_timeline_svg, role_timeline_text

    result = result_from_metrics(run_dir / "metrics.jsonl")
    (run_dir / "timeline.svg").write_text(role_timeline_svg(result))
    print(role_timeline_text(result), flush=True)
