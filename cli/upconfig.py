"""upconfig.py: how `gyre up` (and `gyre config show`) turn a config file, `--set` items and
named flags into the run's CoordinatorConfig: the order they win in, the default run
directory and model, the sandbox picked when none is named, `--ed`'s matched (phi, mu), and,
for `--resume`, the run's own config (a moved run directory's model) and whether any step is
left to do. Errors print as one `[error]` line (common.fail, guard). Not the commands
themselves (main.py) nor the config's fields and checks (coordinator/runconfig.py).
"""

from __future__ import annotations

from pathlib import Path

import typer

from gyre.cli.common import check_model, default_run_dir, fail, guard


def moved_model(run_dir: Path) -> Path | None:
    """The model directory of a run directory that was moved or copied, where the model was
    inside it (the embedded default's RUN_DIR/model): config.json names the old path."""
    from gyre.coordinator.runconfig import load_config_file

    recorded = guard(load_config_file, path=run_dir / "config.json")
    try:
        old_run, old_model = Path(recorded["run_dir"]), Path(recorded["model_dir"])
        inside = old_model.relative_to(old_run)
    except (KeyError, TypeError, ValueError):
        return None
    return run_dir / inside if old_run != run_dir else None


def resumable(run_dir: Path, target: int, extended: bool) -> bool:
    """Whether the run has steps left to do; one that has not says so (before any worker
    starts) and how to extend it. Not an error: the systemd unit starts a finished run again
    at every boot, and must not be restarted for it. Finished means saved: steps trained
    after the last intact checkpoint (rundir.state) are left to do."""
    from gyre.coordinator.rundir import state, unsaved

    s = state(run_dir)
    if s.unsaved:  # its summary counted them, but no checkpoint has them: not finished
        typer.echo(f"run directory {run_dir}: {unsaved(s)} trained but never saved (the save failed, or its "
                   f"checkpoint is torn); resuming from step {s.steps_done}")
    if s.kind == "finished" and target <= s.steps_done:
        more = f" with N > {s.steps_done}" if extended else ""
        typer.echo(f"run directory {run_dir} holds a finished run ({s.steps_done}/{s.steps_target} steps): nothing "
                   f"to resume; extend it with `gyre up --resume {run_dir} --steps N`{more}")
        return False
    return True


def fresh_run_dir(cfg):
    """The default run directory, created: runs/up-<timestamp>, or -2, -3, ... when that one
    is taken (two `gyre up` started in the same second)."""
    import dataclasses

    from gyre.coordinator.rundir import fresh

    new = guard(fresh, path=cfg.run_dir)
    if new == cfg.run_dir:
        return cfg
    model = new / "model" if cfg.model_dir == cfg.run_dir / "model" else cfg.model_dir
    return dataclasses.replace(cfg, run_dir=new, model_dir=model)


def matched(cfg, ed: float, sets: list[str]):
    """`up --ed E`: the policy's matched (phi, mu) at mean staleness E (sim.matched_settings)."""
    import dataclasses

    from gyre.coordinator.sim import matched_settings

    if given := [x.split("=", 1)[0] for x in sets if x.split("=", 1)[0].strip() in ("phi", "mu")]:
        fail(ValueError(f"--ed sets phi and mu; --set {given[0]}=... too: give one"))
    try:
        phi, mu = matched_settings(ed)[cfg.policy]
    except ValueError as e:
        fail(ValueError(f"--ed: {e}"))
    return dataclasses.replace(cfg, phi=phi, mu=mu)


def resolve_config(path, sets: list[str], **flags):
    """(config, file values, overrides): file < --set < named flags. Nothing is created: the
    run directory defaults to runs/up-<timestamp> and the model to RUN_DIR/model (written
    later, once the run directory is claimed); both are made absolute."""

    from gyre.coordinator.runconfig import build_config, load_config_file, parse_sets

    file_values = guard(load_config_file, path=path) if path else {}
    overrides = {**guard(parse_sets, items=sets),
                 **{k: v for k, v in flags.items() if v is not None and k in ("steps", "policy", "seed", "sandbox",
                                                                             "tasks_path", "harness")}}
    run_dir = flags.get("run_dir") or overrides.get("run_dir") or file_values.get("run_dir")
    model = flags.get("model") or overrides.get("model_dir") or file_values.get("model_dir")
    run_dir = Path(run_dir) if run_dir else default_run_dir("up")
    if model:
        guard(check_model, model_dir=Path(model))  # fail early, with the missing file named
    overrides.update(run_dir=run_dir, model_dir=Path(model) if model else Path(run_dir) / "model")
    picked = {} if "sandbox" in overrides or "sandbox" in file_values else picked_sandbox(file_values, overrides)
    return guard(build_config, file_values=file_values, overrides={**overrides, **picked}), file_values, overrides


def picked_sandbox(file_values: dict, overrides: dict) -> dict:
    """{"sandbox": NAME} by the rule every command applies when none is named (podman, else
    docker, for tasks that run in an image; else process: sandbox/preflight.py), over the
    run's task sources (tasks_path, eval_tasks_path); {} when there are none, or one cannot
    be read (preflight says why, as it would)."""
    from gyre.coordinator.sandbox.preflight import default_sandbox
    from gyre.coordinator.taskformats import load_task_source
    from gyre.workerd.wire import GyreError

    values = {**file_values, **overrides}
    sources = [values[k] for k in ("tasks_path", "eval_tasks_path") if values.get(k)]
    try:
        tasks = [t for source in sources for t in load_task_source(Path(source))]
    except GyreError:
        return {}
    if not tasks:
        return {}
    return {"sandbox": guard(default_sandbox, tasks=tasks, source=" and ".join(map(str, sources)),
                             url=values.get("sandbox_url"), url_flag="--set sandbox_url=URL")}
