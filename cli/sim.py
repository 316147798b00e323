"""sim.py: `gyre sim` and `gyre sim compare`: the placement policies on a simulated cluster.

Thin: options in, `gyre.coordinator.sim` out, printed as a table (or one JSON object).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated

import typer

sim_app = typer.Typer(help="Simulate placement policies on a workload (virtual clock, the real policy code).",
                      invoke_without_command=True, no_args_is_help=False, rich_markup_mode=None)

WorkloadOpt = Annotated[str, typer.Option("--workload", help="Preset (nl2repo, deepswe, terminalbench) or a "
                                                           "metrics.jsonl of a real run.")]
SimPolicyOpt = Annotated[str, typer.Option("--policy", help="elastic, colocate, async (the paper's Async baseline: "
                                                        "a fixed split, full batches) or async-streaming (a fixed "
                                                        "split, a step from the first ready group).")]
PhiOpt = Annotated[float, typer.Option("--phi", help="Boundary-dispatch lead phi (batches).")]
MuOpt = Annotated[int, typer.Option("--mu", help="Steps per burst mu.")]
CellsOpt = Annotated[int | None, typer.Option("--cells", help="Override the workload's cell count.")]
CellNodesOpt = Annotated[int | None, typer.Option("--cell-nodes", help="Override nodes per cell.")]
StandaloneOpt = Annotated[int, typer.Option("--standalone", help="Executions a never-training rollout pool serves.")]
SimStepsOpt = Annotated[int, typer.Option("--steps", help="Optimizer steps to simulate.")]
SimSeedOpt = Annotated[int, typer.Option("--seed", help="Random seed.")]
SimJsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]
EdOpt = Annotated[float, typer.Option("--ed", help="Matched mean staleness E[d] = phi + (mu-1)/2.")]
SeedsOpt = Annotated[int, typer.Option("--seeds", help="Number of seeds (0..n-1) to average over.")]
TimelineOpt = Annotated[Path | None, typer.Option("--timeline", help="Write the role timeline as SVG here.")]
TrainingCellsOpt = Annotated[int | None, typer.Option(
    "--training-cells", help="Cells that only train, for a fixed split (async, async-streaming); default: the "
                             "split that balances the workload's rollout and training time.")]


def _fail(message: str) -> None:
    typer.echo(f"[error] {message}", err=True)
    raise typer.Exit(1)


def _check(**values) -> None:
    """One-line errors for options out of range (the simulator would divide by them)."""
    minimum = {"steps": 1, "mu": 1, "seeds": 1, "cells": 1, "cell_nodes": 1, "phi": 0, "standalone": 0, "ed": 0,
               "training_cells": 1}
    for name, value in values.items():
        if value is not None and value < minimum[name]:
            _fail(f"--{name.replace('_', '-')} must be >= {minimum[name]}, got {value}")


def _check_policy(policy: str) -> None:
    from gyre.coordinator.policies import POLICIES

    if policy not in POLICIES:
        _fail(f"--policy must be one of {', '.join(POLICIES)}, got {policy!r}")


def _workload(name: str, cells: int | None, cell_nodes: int | None):
    from gyre.coordinator.sim import PRESETS, workload_from_metrics
    from gyre.workerd.wire import GyreError

    if name in PRESETS:
        w = PRESETS[name]
    elif Path(name).exists():
        try:
            w = workload_from_metrics(name)
        except (ValueError, KeyError, OSError, GyreError) as e:
            _fail(f"workload {name}: cannot read it as a gyre metrics.jsonl ({type(e).__name__}: {e})")
    else:
        _fail(f"unknown workload {name!r}: a preset ({', '.join(PRESETS)}) or a metrics.jsonl")
    changes = {k: v for k, v in (("cells", cells), ("cell_nodes", cell_nodes)) if v is not None}
    return dataclasses.replace(w, **changes) if changes else w


@sim_app.callback()
def sim(ctx: typer.Context, workload: WorkloadOpt = "nl2repo", policy: SimPolicyOpt = "elastic",
        phi: PhiOpt = 0.5, mu: MuOpt = 3, cells: CellsOpt = None, cell_nodes: CellNodesOpt = None,
        standalone: StandaloneOpt = 0, steps: SimStepsOpt = 20, seed: SimSeedOpt = 0, as_json: SimJsonOpt = False,
        timeline: TimelineOpt = None, training_cells: TrainingCellsOpt = None) -> None:
    """Simulate one policy (or, with `compare`, every policy at matched staleness)."""
    if ctx.invoked_subcommand is not None:
        ctx.obj = {"workload": workload, "cells": cells, "cell_nodes": cell_nodes, "standalone": standalone}
        return
    from gyre.cli.timeline import role_timeline_svg, role_timeline_text
    from gyre.coordinator.sim import simulate
    from gyre.workerd.wire import GyreError

    _check_policy(policy)
    _check(steps=steps, mu=mu, phi=phi, cells=cells, cell_nodes=cell_nodes, standalone=standalone,
           training_cells=training_cells)
    w = _workload(workload, cells, cell_nodes)
    from gyre.coordinator.policies import POLICIES

    if training_cells is not None and not POLICIES[policy].fixed_split:
        _fail(f"--training-cells sets a fixed split (async, async-streaming); {policy} moves cells between roles")
    try:
        r = simulate(w, policy=policy, phi=phi, mu=mu, steps=steps, seed=seed, standalone=standalone,
                     async_training_cells=training_cells)
    except (ValueError, GyreError) as e:  # SimError and the simulator's own argument checks
        _fail(str(e))
    if timeline is not None:
        timeline.write_text(role_timeline_svg(r))
    if as_json:
        typer.echo(json.dumps({"workload": w.name, "policy": policy, "phi": phi, "mu": mu, "steps": r.steps,
                               "hours": r.hours, "staleness_mean": r.staleness_mean,
                               "training_share": r.per_cell_training_share, "switches": r.switches,
                               "mean_waterlevel": r.mean_waterlevel, "training_cells": r.async_training_cells,
                               "assumed": list(w.assumed)}))
        return
    split = f" training cells {r.async_training_cells}" if r.async_training_cells else ""
    scale, unit = time_unit(r.hours)
    typer.echo(f"{w.name}: {policy} phi={phi} mu={mu}{split}, {r.steps} steps in {r.hours * scale:.2f} {unit}; "
               f"staleness {r.staleness_mean:.2f}; {r.switches} role switches")
    _say_assumed(w)
    typer.echo(role_timeline_text(r))


def time_unit(hours: float) -> tuple[float, str]:
    """(factor, unit) to print `hours` in: h from an hour, min from a minute, else s."""
    if hours >= 1.0:
        return 1.0, "h"
    if hours >= 1 / 60:
        return 60.0, "min"
    return 3600.0, "s"


def _say_assumed(w) -> None:
    """The terms a recorded run did not measure (workloads.workload_from_metrics), one line each."""
    for term in w.assumed:
        typer.echo(f"assumed, not measured in {w.name}: {term}")


FromOpt = Annotated[list[Path] | None, typer.Option(
    "--from", help="Real runs' directories (bench/coordinator.py --keep DIR writes them; a shell glob such as "
                   "--from DIR/* works): each run's own policy, (phi, mu) and split replayed on their pooled "
                   "workload, the predicted seconds per step and ratios to elastic beside the measured.")]
HostModelOpt = Annotated[bool, typer.Option(
    "--host-model", help="With --from: fit and apply the host model (cells sharing one machine's cores: each "
                         "execution started together with others takes longer to start up). Off: independent "
                         "cells, as GPU cells are.")]
MoreRunsArg = Annotated[list[Path] | None, typer.Argument(help="More run directories, after --from.",
                                                          show_default=False)]


@sim_app.command("compare")
def compare_cmd(ctx: typer.Context, runs: MoreRunsArg = None, workload: Annotated[str | None, typer.Option(
                    "--workload", help="Preset or metrics.jsonl (default: the one given to `gyre sim`).")] = None,
                cells: CellsOpt = None, cell_nodes: CellNodesOpt = None,
                standalone: Annotated[int | None, typer.Option("--standalone", help="Standalone pool size.")] = None,
                ed: EdOpt = 1.5, steps: SimStepsOpt = 20, seeds: SeedsOpt = 3, as_json: SimJsonOpt = False,
                from_: FromOpt = None, host_model: HostModelOpt = False) -> None:
    """Every policy at matched mean staleness, each at its best (phi, mu) (and split); speedups of elastic.
    With --from: real runs replayed, measured against predicted."""
    from gyre.coordinator.sim import compare
    from gyre.workerd.wire import GyreError

    if runs and not from_:
        _fail(f"{runs[0]}: run directories are given with --from (gyre sim compare --from DIR/*)")
    if from_:
        _check(seeds=seeds)
        _replay([*from_, *(runs or [])], seeds=seeds, as_json=as_json, host=host_model)
        return
    if host_model:
        _fail("--host-model is fitted from real runs: give them with --from")

    o = ctx.obj or {}
    cells = cells if cells is not None else o.get("cells")
    cell_nodes = cell_nodes if cell_nodes is not None else o.get("cell_nodes")
    pool = standalone if standalone is not None else o.get("standalone", 0)
    _check(steps=steps, seeds=seeds, ed=ed, cells=cells, cell_nodes=cell_nodes, standalone=pool)
    w = _workload(workload or o.get("workload", "nl2repo"), cells, cell_nodes)
    if w.cells < 2:
        _fail(f"compare needs at least 2 cells (async splits them into training and rollout); {w.name} has {w.cells}")
    try:
        out = compare(w, ed=ed, steps=steps, seeds=list(range(seeds)), standalone=pool)
    except (ValueError, GyreError) as e:  # SimError and the simulator's own argument checks
        _fail(str(e))
    if as_json:
        typer.echo(json.dumps({**out, "assumed": list(w.assumed)}))
        return
    typer.echo(f"{w.name}, E[d]={ed}, {steps} steps, seeds {out['seeds']}")
    _say_assumed(w)
    # One unit for the table, from its shortest time: a minute-scale run is not 0.04 h vs 0.05 h.
    scale, unit = time_unit(min(p["hours"] for p in out["policies"].values()))
    typer.echo(f"{'policy':<16}{'phi':>5}{'mu':>4}{'t':>3}{unit:>9}{'staleness':>11}  training share per cell")
    for name, p in out["policies"].items():
        share = " ".join(f"{x:.2f}" for x in p["training_share"])
        t = p.get("training_cells", "-")
        typer.echo(f"{name:<16}{p['phi']:>5g}{p['mu']:>4}{t:>3}{p['hours'] * scale:>9.2f}"
                   f"{p['staleness_mean']:>11.2f}  {share}")
    sp = out["speedup"]
    typer.echo(f"elastic speedup: {sp['vs_async']:.2f}x vs async (the paper's Async baseline, full batches), "
               f"{sp['vs_async_streaming']:.2f}x vs async-streaming (A3), {sp['vs_colocate']:.2f}x vs colocate")
    typer.echo("each policy at its fastest (phi, mu) with phi + (mu-1)/2 = E[d] (t: training cells of a fixed split)")


def _replay(paths: list[Path], *, seeds: int, as_json: bool, host: bool) -> None:
    """`compare --from`: coordinator/replay.py's table."""
    from gyre.coordinator.replay import replay
    from gyre.workerd.wire import GyreError

    dirs = [p for p in paths if (p / "metrics.jsonl").is_file()]
    skipped = [str(p) for p in paths if p not in dirs]
    if not dirs:
        _fail(f"--from: no run directory (a folder with metrics.jsonl) among {', '.join(map(str, paths))}")
    try:
        out = replay(dirs, seeds=list(range(seeds)), host=host)
    except (ValueError, KeyError, OSError, GyreError) as e:
        _fail(f"--from: {type(e).__name__}: {e}" if not isinstance(e, GyreError) else f"--from: {e}")
    if as_json:
        typer.echo(json.dumps({**out, "skipped": skipped}))
        return
    if skipped:
        typer.echo(f"skipped {len(skipped)} path(s) that are not run directories: {', '.join(skipped)}")
    w = out["workload"]
    typer.echo(f"{len(dirs)} runs pooled: {w['groups']} groups of {w['group_size']}, {w['cells']} cells, "
               f"training {w['train_h_all'] * 3600 * w['cells']:.2f} cell-s a step, switches "
               f"{w['switch_to_train_s']:.3g} s / {w['switch_to_rollout_s']:.3g} s, publication "
               f"{w['publish_s']:.3g} s; seeds {out['seeds']}")
    typer.echo(f"host model: {w['host_start_s']:.3f} s of start-up per execution started together" if host else
               "host model off (independent cells; --host-model fits one for cells sharing a machine's cores)")
    for term in w["assumed"]:
        typer.echo(f"assumed, not measured in any run: {term}")
    typer.echo(f"{'run':<28}{'policy':<16}{'phi':>5}{'mu':>4}{'t':>3}{'measured s/step':>17}{'predicted':>11}"
               f"{'error':>8}")
    for r in out["runs"]:
        t = r["training_cells"] if r["training_cells"] is not None else "-"
        typer.echo(f"{Path(r['run_dir']).name:<28}{r['policy']:<16}{r['phi']:>5g}{r['mu']:>4}{t:>3}"
                   f"{r['measured_s_per_step']:>17.2f}{r['predicted_s_per_step']:>11.2f}{r['error']:>+8.1%}")
    if "elastic" not in out["policies"]:
        typer.echo("no elastic run: no ratios to elastic")
        return
    typer.echo(f"{'policy':<16}{'measured s/step':>17}{'predicted':>11}{'vs elastic, measured':>22}"
               f"{'predicted':>11}{'ratio error':>13}")
    for name, p in out["policies"].items():
        typer.echo(f"{name:<16}{p['measured']:>17.2f}{p['predicted']:>11.2f}{p['measured_vs_elastic']:>21.2f}x"
                   f"{p['predicted_vs_elastic']:>10.2f}x{p['ratio_error']:>+13.1%}")
