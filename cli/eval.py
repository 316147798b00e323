"""eval.py: `gyre eval`: pass@k of one model over a task source, as a table or JSON.

`--model` is a Hugging Face model directory, served as it is, or a gyre run directory:
its checkpoint (`checkpoints/latest`, or `--step`) is exported (cli/export.py's export_run,
the trainer's dtype, every rank joined: its logits are tested equal to the trainer's) into
RUN_DIR/model, served, and removed at the end (its README, naming the run, step and
version, kept as RUN_DIR/model.md). The export is the route because it needs no trainer
in the evaluation's cluster: a megatron checkpoint's TP x PP layout would otherwise have
to be rebuilt to load it. Everything is checked before the run directory is made (model,
checkpoint, task source, harness, sandbox). Not the runner or the estimator
(coordinator/evalrun.py, heldout.py).
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from gyre.cli.common import (
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
    EvalRunDirOpt,
    JsonOpt,
    ServeConfigOpt,
    ServeSetOpt,
    TaskHarnessOpt,
    TaskSandboxOpt,
    TimeoutOpt,
)
from gyre.cli.tasks import SandboxUrlOpt

EvalModelOpt = Annotated[Path | None, typer.Option(
    "--model", help="A Hugging Face model directory, or a gyre run directory (gyre up): its latest checkpoint's "
    "weights, or --step's (default: the tiny model).")]
EvalStepOpt = Annotated[int | None, typer.Option(
    "--step", help="With --model RUN_DIR: the checkpoint's step (default: the latest, checkpoints/latest).")]
EvalTasksOpt = Annotated[Path, typer.Option(
    "--tasks", help="The task source: a Harbor task folder or a folder of them, or a JSONL file (SWE-style or gyre).")]
EvalKOpt = Annotated[int | None, typer.Option(
    "-k", help="Samples per task: pass@k's k (default: the config's eval_k, else 1).")]
EvalThresholdOpt = Annotated[float | None, typer.Option(
    "--threshold", help="A valid reward at least this passes (default: the config's eval_pass_threshold, else 1.0).")]
EvalSolutionOpt = Annotated[bool, typer.Option(
    "--solution", help="Each task's own solution/solve.sh instead of a model and harness: checks the task source "
    "(pass@k 1.0 when every task is solvable and its tests score it).")]
EvalConcurrencyOpt = Annotated[int, typer.Option("--concurrency", help="Executions running at once (of k x tasks).")]


@dataclass(frozen=True, slots=True)
class ModelSource:
    """What --model names: a model directory served as it is, or a run's checkpoint."""

    path: Path | None  # as given, absolute; None: the tiny default (or none, with --solution)
    run_dir: Path | None = None  # a gyre run directory: `checkpoint` is served
    checkpoint: Path | None = None
    step: int | None = None
    version: int | None = None
    model_dir: Path | None = None  # the directory whose config, tokenizer and gyre.json apply


def eval_cmd(tasks: EvalTasksOpt, model: EvalModelOpt = None, step: EvalStepOpt = None,
             harness: TaskHarnessOpt = None, sandbox: TaskSandboxOpt = None, sandbox_url: SandboxUrlOpt = None,
             k: EvalKOpt = None, threshold: EvalThresholdOpt = None, set_: ServeSetOpt = None,
             solution: EvalSolutionOpt = False, run_dir: EvalRunDirOpt = None, as_json: JsonOpt = False,
             concurrency: EvalConcurrencyOpt = 8, timeout: TimeoutOpt = None,
             config: ServeConfigOpt = None) -> None:
    """pass@k of a model (a model directory, or a run's checkpoint) over a task source: each
    task k times, one row per task, then pass@k, pass@1 and the reward mean."""
    import uvloop

    from gyre.coordinator.evalrun import evaluate
    from gyre.coordinator.rundir import absolute
    from gyre.coordinator.sandbox.preflight import check_sandbox
    from gyre.coordinator.serve import serve_fields
    from gyre.coordinator.taskformats import load_task_source

    # 1) Everything checked before the run directory exists: a refused eval leaves nothing.
    #    Flags win over the run config's fields, which win over the defaults.
    k = flag_or_config(k, config=config, key="eval_k", option="-k", default=1,
                       check=lambda v: None if isinstance(v, int) and not isinstance(v, bool) else "must be an integer")
    threshold = flag_or_config(threshold, config=config, key="eval_pass_threshold", option="--threshold", default=1.0,
                               check=lambda v: None if isinstance(v, (int, float)) and not isinstance(v, bool)
                               else "must be a number")
    base_timeout = config_timeout(config)
    guard(_check_flags, k=k, threshold=threshold, concurrency=concurrency, solution=solution, model=model,
          step=step)
    check_timeout(timeout)
    if not tasks.exists():
        fail(FileNotFoundError(f"--tasks {tasks}: no such file or directory"))
    task_list = guard(load_task_source, path=tasks)
    source = guard(resolve_model, model=model, step=step)
    fields = guard(serve_fields, config=config, sets=set_ or [])
    sandbox, sandbox_url = sandbox_for(flag=sandbox, url=sandbox_url, config=config, tasks=task_list,
                                       source=str(tasks))
    guard(check_sandbox, backend=sandbox, url=sandbox_url, tasks=task_list)
    # An unknown or uninstalled harness is refused here (its sandbox_pip installed, once per spec).
    preset = harness_preset(harness, config, "process" if solution else sandbox)
    # 2) The run directory, the served model, the executions.
    lock, made = guard(_claim, run_dir=run_dir)
    out = lock.run_dir
    try:
        try:
            model_dir, about = guard(_serve_model, source=source, run_dir=out)
            if solution:  # the tiny default serves, but nothing calls it
                about["model"] = None
            about.update(harness="solution" if solution else preset.name, solution=solution, run_dir=str(out),
                         tasks_path=str(absolute(tasks)))
            settings = guard(_settings, model_dir=source.model_dir or model_dir, fields=fields)
        except BaseException:
            if made:
                shutil.rmtree(out, ignore_errors=True)
            raise
        (out / "config.json").write_text(json.dumps({"command": "eval", **about, "k": k, "threshold": threshold,
                                                     "sandbox": sandbox}, indent=2))

        def progress(r: dict) -> None:
            if not as_json:
                reward = "-" if r["score"] is None else f"{r['score']:.3f}"
                typer.echo(f"  {r['task']} #{r['sample']}: {r['status']} {reward}", err=True)

        try:
            report = guard(uvloop.run, main=evaluate(
                task_list, k=k, threshold=threshold, run_dir=out, about=about, preset=preset, model_dir=model_dir,
                sandbox=sandbox, sandbox_url=sandbox_url, solution=solution, concurrency=concurrency,
                timeout_s=timeout, default_timeout_s=base_timeout, settings=settings, on_result=progress))
        finally:
            _drop_export(source, out)
    finally:
        lock.release()
    if as_json:
        typer.echo(json.dumps(report))
    else:
        render(report)
    raise typer.Exit(1 if report["unscored"] else 0)


def _check_flags(*, k: int, threshold: float, concurrency: int, solution: bool, model: Path | None,
                 step: int | None) -> None:
    from gyre.coordinator.evalrun import EvalError

    if k < 1:
        raise EvalError(f"-k must be >= 1, got {k}")
    if not math.isfinite(threshold):
        raise EvalError(f"--threshold must be a finite number, got {threshold}")
    if concurrency < 1:
        raise EvalError(f"--concurrency must be >= 1, got {concurrency}")
    if solution and (model is not None or step is not None):
        raise EvalError("--solution runs each task's own solution/solve.sh: --model and --step are not used")
    if step is not None and model is None:
        raise EvalError("--step names a checkpoint of --model RUN_DIR (a gyre run directory)")


def is_run_dir(path: Path) -> bool:
    """A gyre run directory (checkpoints/, or a config.json gyre wrote), not a model directory."""
    if (path / "checkpoints").is_dir():
        return True
    try:
        recorded = json.loads((path / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(recorded, dict) and "model_type" not in recorded and (
        "model_dir" in recorded or "command" in recorded)


def resolve_model(*, model: Path | None, step: int | None) -> ModelSource:
    """What --model names, checked: a model directory gyre loads, or a run directory with
    the checkpoint asked for (and the run's model directory, whose config and tokenizer
    the export takes). Reads only."""
    from gyre.cli.export import pick_checkpoint, run_config, source_model_dir
    from gyre.coordinator.evalrun import EvalError
    from gyre.coordinator.rundir import absolute
    from gyre.workerd.modeldir import check_model_dir

    if model is None:
        return ModelSource(None)
    path = absolute(model)
    if not path.is_dir():
        raise EvalError(f"--model {model}: no such directory (a Hugging Face model directory or a gyre run directory)")
    if not is_run_dir(path):
        if step is not None:
            raise EvalError(f"--step names a checkpoint of a gyre run directory; {model} is a model directory")
        check_model_dir(path)
        return ModelSource(path, model_dir=path)
    recorded = run_config(path)  # refuses a `gyre serve` directory
    if "model_dir" not in recorded and recorded.get("command"):  # `gyre tasks run`, `gyre eval`
        raise EvalError(f"{path} is a `gyre {recorded['command']}` directory: it trained nothing and holds no "
                        "checkpoint; give a model directory or a `gyre up` run directory")
    folder, state = pick_checkpoint(path, step)
    base = source_model_dir(path, recorded)
    check_model_dir(base)
    return ModelSource(path, run_dir=path, checkpoint=folder, step=int(state.get("step", int(folder.name[5:]))),
                       version=state.get("version"), model_dir=base)


def _claim(*, run_dir: Path | None):
    """(the run directory's lock, whether this made it): --run-dir as given, else a fresh
    runs/eval-<timestamp> (-2, -3, ... when taken)."""
    from gyre.coordinator.rundir import absolute, claim, fresh

    if run_dir is None:
        return claim(fresh(default_run_dir("eval")), command="serve"), True
    made = not absolute(run_dir).exists()
    return claim(absolute(run_dir), command="serve"), made


def _serve_model(*, source: ModelSource, run_dir: Path) -> tuple[Path, dict]:
    """(the directory the engine loads, the report's head: model, step, version)."""
    from gyre.cli.export import export_run

    if source.run_dir is None:  # a model directory as it is, or the tiny default in the run directory
        served = model_or_tiny(source.path, run_dir, 0)
        return served, {"model": str(served), "step": None, "version": None}
    done = export_run(run_dir=source.run_dir, out=run_dir / "model", step=source.step)
    shutil.copyfile(done.out / "README.md", run_dir / "model.md")
    return done.out, {"model": str(source.run_dir), "step": done.step, "version": done.version,
                      "checkpoint": str(source.checkpoint), "trainer": done.trainer, "dtype": done.dtype}


def _settings(*, model_dir: Path, fields: dict) -> dict:
    from gyre.coordinator.serve import serve_settings

    return serve_settings(model_dir=model_dir, fields=fields)


def _drop_export(source: ModelSource, run_dir: Path) -> None:
    # The exported weights are a copy of the checkpoint (float32 SmolLM2: 540 MB): removed
    # once served; `gyre export RUN_DIR --step N OUT` writes one to keep.
    if source.run_dir is not None:
        shutil.rmtree(run_dir / "model", ignore_errors=True)


def render(report: dict) -> None:
    """One row per task (samples, passed, rewards, statuses), then pass@k, pass@1 and the
    reward mean; a task with no valid sample reads "unscored", never a fail."""
    from rich.console import Console
    from rich.table import Table

    what = "each task's solution" if report.get("solution") else report["model"]
    if report.get("step") is not None:
        what += f" at step {report['step']} (version {report['version']})"
    table = Table(title=f"{what}: {len(report['tasks'])} task(s) x {report['k']}; records in {report['run_dir']}")
    for col in ("task", "samples", "passed", "rewards", "statuses"):
        table.add_column(col)
    for row in report["tasks"]:
        table.add_row(row["task"], str(row["samples"]), str(row["passed"]) if row["samples"] else "unscored",
                      " ".join(f"{r:.3f}" for r in row["rewards"]) or "-",
                      ", ".join(f"{s} {n}" for s, n in sorted(row["statuses"].items())))
    Console().print(table)
    k, n = report["k"], len(report["tasks"])
    scored = f"{report['scored_tasks']} of {n} task(s) scored"
    typer.echo(f"pass@{k} {_num(report['pass_at_k'])} (threshold {report['threshold']:g}; {scored})")
    if k > 1:
        typer.echo(f"pass@1 {_num(report['pass_at_1'])}")
    samples = sum(row["samples"] for row in report["tasks"])
    typer.echo(f"reward mean {_num(report['reward_mean'])} over {samples} valid sample(s) of "
               f"{report['executions']} execution(s)")
    if report["unscored"]:
        typer.echo(f"unscored (no valid sample; not counted a fail): {', '.join(report['unscored'])}")


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"
