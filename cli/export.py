"""export.py: `gyre export RUN_DIR [--step N] OUT`, a run's checkpoint as a Hugging Face directory.

Picks the checkpoint (`checkpoints/latest`, or `--step`), reads the trainer's files into
whole HF tensors (workerd/export.py: the CPU trainer's or every megatron rank's), and
writes model.safetensors in the trainer's dtype (or `--dtype`) beside that
directory's config, tokenizer, chat template, generation config and gyre.json, plus a
README naming the run, step and version. Everything goes into a fresh `OUT.tmp-*` folder
renamed to OUT at the end: a failed export leaves no OUT. Not the reader of trainer files
(workerd/export.py) and not the registration (cli/main.py).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from gyre.cli.common import guard, gyre_version
from gyre.coordinator.resume import CHECKPOINTS, checkpoint_steps, intact, step_dir
from gyre.workerd.export import ExportError

ExportRunDirArg = Annotated[Path, typer.Argument(help="A gyre run directory (gyre up) with a checkpoint.")]
ExportOutArg = Annotated[Path, typer.Argument(
    help="The Hugging Face directory to write; must not exist, or be empty.")]
ExportStepOpt = Annotated[int | None, typer.Option(
    "--step", help="The checkpoint's step (default: the latest, checkpoints/latest).")]
ExportDtypeOpt = Annotated[str | None, typer.Option(
    "--dtype", help="The safetensors dtype: float32, bfloat16 or float16 (default: the trainer's: every update kept).")]

# What a model directory holds besides its weights, copied as they are (config.json is
# copied with its dtype set to the export's).
COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
          "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model",
          "generation_config.json", "gyre.json")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True, slots=True)
class Exported:
    out: Path
    step: int
    version: int
    trainer: str
    dtype: str
    rounding: str | None = None  # what a narrower dtype than the trainer's lost, or None
    unchanged: bool = False  # every element equals the base model's: no step changed the weights


def export(run_dir: ExportRunDirArg, out: ExportOutArg, step: ExportStepOpt = None,
           dtype: ExportDtypeOpt = None) -> None:
    """Write a run's checkpoint as a Hugging Face model directory: model.safetensors,
    config.json, the tokenizer and chat template, and a README naming the run and step."""
    done = guard(export_run, run_dir=run_dir, out=out, step=step, dtype=dtype)
    typer.echo(f"{done.out}: step {done.step} (version {done.version}) of {run_dir}, "
               f"{done.trainer} trainer, {done.dtype}")
    if done.unchanged:
        typer.echo(f"note: the weights equal the base model's: no step up to step {done.step} changed them "
                   f"(gyre doctor {run_dir} says why)", err=True)
    if done.rounding:
        typer.echo(f"note: {done.rounding}", err=True)


def export_run(*, run_dir: Path, out: Path, step: int | None = None, dtype: str | None = None) -> Exported:
    """The command's work: every check before anything is written, then one rename."""
    from gyre.coordinator.rundir import absolute
    from gyre.workerd.export import read_checkpoint
    from gyre.workerd.modelconfig import load_config
    from gyre.workerd.weightfiles import weights_dtype

    if dtype is not None and dtype not in DTYPES:
        raise ExportError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} exists and is not an empty directory: export into a new one "
                          "(nothing is overwritten)")
    recorded = run_config(run_dir)
    folder, state = pick_checkpoint(run_dir, step)
    model_dir = source_model_dir(run_dir, recorded)
    config = load_config(model_dir)
    weights = read_checkpoint(folder / "trainer.pt", config)
    # The trainer's dtype unless asked: a narrower one drops the updates below its resolution
    # (SmolLM2 at lr 1e-6 after 2 steps: 100% of the elements changed in float32, 0.41% in bfloat16).
    held = {str(t.dtype).removeprefix("torch.") for t in weights.tensors.values()}
    dtype = dtype or (held.pop() if len(held) == 1 and next(iter(held)) in DTYPES else weights_dtype(model_dir))
    total, moved, kept = against_base(weights.tensors, model_dir, dtype)
    done = Exported(out=out, step=int(state.get("step", _step_of(folder))), version=weights.version,
                    trainer=weights.trainer, dtype=dtype, rounding=rounding(weights.tensors, dtype, total, moved, kept),
                    unchanged=bool(total) and not moved)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{out.name}.tmp-", dir=out.parent))
    try:
        _write(tmp, weights.tensors, config.tie_word_embeddings, dtype)
        _copy_model_files(model_dir, tmp, dtype)
        (tmp / "README.md").write_text(readme(absolute(run_dir), folder, model_dir, config.architecture, done))
        tmp.chmod(0o777 & ~_umask())  # mkdtemp makes it 0700; a model directory is for others too
        try:
            tmp.replace(out)  # onto a missing or empty directory: atomic
        except OSError as e:  # OUT was made (and filled) while the export ran
            raise ExportError(f"{out} could not be replaced ({e.strerror}): nothing is overwritten") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return done


# --- which checkpoint ---------------------------------------------------------------------


def _step_of(folder: Path) -> int:
    return int(folder.name.removeprefix("step-"))


def run_config(run_dir: Path) -> dict:
    """The run's config.json, as `gyre up` wrote it (a `gyre serve` directory trains nothing)."""
    path = run_dir / "config.json"
    if not path.exists():
        raise ExportError(f"{run_dir} has no config.json: not a gyre run directory")
    try:
        recorded = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ExportError(f"{path} does not read: {e}") from None
    if not isinstance(recorded, dict) or recorded.get("command") == "serve":
        raise ExportError(f"{run_dir} is not a `gyre up` run directory (gyre serve trains nothing): "
                          "there is no checkpoint to export")
    return recorded


def pick_checkpoint(run_dir: Path, step: int | None) -> tuple[Path, dict]:
    """(folder, state.json) of `step`'s checkpoint, or of the latest one."""
    steps = checkpoint_steps(run_dir)
    if not steps:
        raise ExportError(f"run {run_dir} has no checkpoint yet: a run saves one every checkpoint_every steps "
                          "and at its end (runs from before gyre did so, and runs that trained no step, have "
                          f"none); `gyre up --resume {run_dir} --steps N` trains on and saves one")
    available = ", ".join(map(str, steps))
    if step is None:
        pointer = run_dir / CHECKPOINTS / "latest"
        name = pointer.read_text().strip() if pointer.exists() else f"step-{steps[-1]:06d}"
        step = _step_of(Path(name)) if name.removeprefix("step-").isdigit() else -1
        if step not in steps:
            raise ExportError(f"{pointer} names {name!r}, not a complete checkpoint; choose one with "
                              f"--step (available: {available})")
    elif step not in steps:
        raise ExportError(f"run {run_dir} has no checkpoint of step {step} (available: {available})")
    folder = step_dir(run_dir, step)
    state, why = intact(folder, needs=())  # a torn one is named, never a torch traceback
    if state is None:
        whole = [s for s in steps if s != step and intact(step_dir(run_dir, s), ())[0] is not None]
        raise ExportError(f"{why}; choose an intact one with --step (intact: {', '.join(map(str, whole)) or 'none'})")
    return folder, state


def source_model_dir(run_dir: Path, recorded: dict) -> Path:
    """The run's model directory (config.json's `model_dir`): its config and tokenizer are
    the export's."""
    if not recorded.get("model_dir"):
        raise ExportError(f"{run_dir / 'config.json'} names no model_dir: not a `gyre up` run directory")
    model_dir = Path(recorded["model_dir"])
    if not (model_dir / "config.json").exists():
        raise ExportError(f"the run's model directory {model_dir} is gone (or has no config.json): the export "
                          "takes its config and tokenizer from there")
    return model_dir


# --- writing ------------------------------------------------------------------------------


def _write(tmp: Path, tensors: dict, tied: bool, dtype: str) -> None:
    import torch
    from safetensors.torch import save_file

    target = getattr(torch, dtype)
    # A copy of each (to(copy=True)): to_hf's q/k/v are views of one fused tensor, and
    # safetensors refuses tensors that share storage. Popped as they go: one copy at a time.
    out = {}
    for name in sorted(tensors):
        t = tensors.pop(name)
        if not (tied and name == "lm_head.weight"):  # tied: the embedding is the output layer
            out[name] = t.to(target, copy=True).contiguous()
    save_file(out, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "model.safetensors").chmod(0o666 & ~_umask())  # safetensors writes it 0600


def against_base(tensors: dict, model_dir: Path, dtype: str) -> tuple[int, int, int]:
    """(elements compared, elements that differ from the base model's in the trainer's dtype,
    those that still differ in `dtype`)."""
    import torch

    from gyre.workerd.weightfiles import iter_weights

    target = getattr(torch, dtype)
    total = moved = kept = 0
    for name, base in iter_weights(model_dir):
        if (t := tensors.get(name)) is not None and t.shape == base.shape:
            total += t.numel()
            moved += int((t != base.to(t.dtype)).sum())
            kept += int((t.to(target) != base.to(target)).sum())
    return total, moved, kept


def rounding(tensors: dict, dtype: str, total: int, moved: int, kept: int) -> str | None:
    """What storing the trainer's weights in a narrower `dtype` loses, measured (against_base):
    the share of elements that differ from the base model's, in the trainer's dtype and in
    `dtype`. A small learning rate's updates (SmolLM2's 1e-6) are mostly below bfloat16's
    resolution."""
    import torch

    target = getattr(torch, dtype)
    held = {t.dtype for t in tensors.values()}
    if len(held) != 1 or (held := held.pop()).itemsize <= target.itemsize:
        return None
    if not total or moved == kept:
        return None
    name = str(held).removeprefix("torch.")
    return (f"the trainer held {name}: {100 * moved / total:.2f}% of the elements differ from the base model's "
            f"there, {100 * kept / total:.2f}% in {dtype}; --dtype {name} keeps every update")


def _copy_model_files(model_dir: Path, tmp: Path, dtype: str) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    for key in ("torch_dtype", "dtype"):  # transformers 4 reads the first, 5 writes the second
        if key in config or key == "torch_dtype" and "dtype" not in config:
            config[key] = dtype
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in COPIED:
        if (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, tmp / name)


def readme(run_dir: Path, folder: Path, model_dir: Path, architecture: str, done: Exported) -> str:
    """What the directory is: the run, the step, the version; the source model's own notes
    on where its weights come from (SmolLM2's dequantised Q4_1 release) carried over."""
    notes = []
    source = model_dir / "README.md"
    if source.is_file():  # paragraphs, not headings, that say where the weights come from
        notes = [p.strip() for p in source.read_text().split("\n\n")
                 if not p.lstrip().startswith("#") and ("Q4_1" in p or "dequantis" in p)]
    lines = [f"# {run_dir.name} at step {done.step} (gyre export)", "",
             f"Exported by gyre {gyre_version()} (`gyre export`) from the run directory `{run_dir}`, checkpoint "
             f"`{CHECKPOINTS}/{folder.name}`: step {done.step}, weight version {done.version}, trained by the "
             f"{done.trainer} trainer.", "",
             f"- Weights: `model.safetensors`, {done.dtype}" + (f" ({done.rounding})." if done.rounding else ".")
             + (" They equal the base model's: no step of the run changed them." if done.unchanged else ""),
             f"- Base model: `{model_dir}` ({architecture}); its config, tokenizer, chat template and "
             "generation config are copied unchanged (the config's dtype aside).", ""]
    if notes:
        quoted = "\n>\n".join("\n".join(f"> {line}" for line in note.splitlines()) for note in notes)
        lines += ["## Where the base model's weights come from", "", "From the base model's README:", "", quoted, ""]
    return "\n".join(lines)


def _umask() -> int:
    mask = os.umask(0o022)  # the only way to read it; set back at once (the command runs no other thread)
    os.umask(mask)
    return mask
