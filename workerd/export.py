"""export.py: a trainer checkpoint read back as whole Hugging Face tensors (for `gyre export`).

A CPU trainer's `trainer.pt` holds its model's state dict, already under HF names. A
megatron cell's checkpoint is one file per rank (megatron_state.ckpt_path: `trainer.pt`
for rank 0, `trainer.pt.tpR` for the other TP ranks, `trainer.pt.ppS.tpR` for every other
rank under PP), each its pipeline stage's TP shard under Megatron names; hf_megatron.to_hf
joins each stage's shards and renumbers its layers. Either way the result is checked
against the model's own names and shapes (model.py's CausalLM) before anyone writes it.
Plain torch in one process, no process group. Not the command (cli/export.py) and not a
writer of model directories.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gyre.workerd.modelconfig import ModelConfig, ModelDirError
from gyre.workerd.wire import GyreError

if TYPE_CHECKING:  # torch and the model load with the reading, not with the `gyre` command
    import torch


class ExportError(GyreError):
    """A run or checkpoint that cannot be exported; the message names the file and why."""


@dataclass(frozen=True, slots=True)
class TrainerWeights:
    """A checkpoint's model as whole HF-named tensors, with the version they are."""

    tensors: dict[str, torch.Tensor]
    version: int
    trainer: str  # "cpu", or "megatron TP=2 PP=2"


def rank_file(path: Path, stage: int, tp_rank: int, pp: int) -> Path:
    """The file of one rank of a megatron checkpoint at `path` (megatron_state.ckpt_path's
    naming, from the rank's coordinates instead of a live process group)."""
    if stage == 0 and tp_rank == 0:
        return path
    return Path(f"{path}.pp{stage}.tp{tp_rank}") if pp > 1 else Path(f"{path}.tp{tp_rank}")


def read_checkpoint(path: Path, config: ModelConfig) -> TrainerWeights:
    """The whole model of the checkpoint whose (rank 0) file is `path`, checked complete."""
    state = _load(path)
    if "tp" in state:  # megatron_state._save records the cell's shape; the CPU trainer does not
        tp, pp = int(state["tp"]), int(state["pp"])
        tensors, version = _megatron(path, state, config, tp, pp), int(state["version"])
        trainer = f"megatron TP={tp} PP={pp}"
    else:
        tensors, version, trainer = dict(state["model"]), int(state["version"]), "cpu"
    check_complete(tensors, config, path)
    return TrainerWeights(tensors, version, trainer)


def _load(path: Path) -> dict:
    import torch

    if not path.exists():
        raise ExportError(f"{path} does not exist")
    try:  # mmap: a rank's tensors are read as they are joined, not all held twice
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - torch's own reason, on one line with the file
        raise ExportError(f"{path} does not load as a trainer checkpoint: {str(e).splitlines()[0]}") from None
    if not isinstance(state, dict) or "model" not in state or "version" not in state:
        raise ExportError(f"{path} is not a gyre trainer checkpoint (no 'model' and 'version')")
    return state


def _megatron(path: Path, first: dict, config: ModelConfig, tp: int, pp: int) -> dict[str, torch.Tensor]:
    from gyre.workerd.trainers.hf_megatron import WHOLE, Stage, to_hf
    """Every rank's file, then each stage's TP shards joined into HF tensors."""
    files = [[rank_file(path, s, r, pp) for r in range(tp)] for s in range(pp)]
    missing = [f.name for row in files for f in row if not f.exists()]
    if missing:
        raise ExportError(f"megatron checkpoint {path.parent} is incomplete: {', '.join(missing)} missing "
                          f"(a TP={tp} x PP={pp} cell writes {tp * pp} files, one per rank)")
    per = config.num_hidden_layers // pp  # build_gpt splits the layers evenly over the stages
    out: dict[str, torch.Tensor] = {}
    versions: dict[str, int] = {}
    for s, row in enumerate(files):
        states = [first if f == path else _load(f) for f in row]
        for f, st in zip(row, states):
            if (st.get("tp"), st.get("pp")) != (tp, pp):
                raise ExportError(f"{f} was saved by a TP={st.get('tp')} x PP={st.get('pp')} cell, "
                                  f"{path.name} by a TP={tp} x PP={pp} one")
            versions[f.name] = int(st["version"])
        stage = WHOLE if pp == 1 else Stage(first=s == 0, last=s == pp - 1, offset=s * per, layers=per)
        try:
            out.update(to_hf([st["model"] for st in states], config, stage))
        except (ModelDirError, RuntimeError, KeyError) as e:  # a shard of another model or shape
            raise ExportError(f"megatron checkpoint {path.parent}, pipeline stage {s}: {e}") from None
    if len(set(versions.values())) > 1:
        raise ExportError(f"megatron checkpoint {path.parent} mixes versions: "
                          + ", ".join(f"{k} {v}" for k, v in versions.items()))
    return out


def check_complete(tensors: dict[str, torch.Tensor], config: ModelConfig, path: Path) -> None:
    import torch

    from gyre.workerd.model import CausalLM
    """Exactly the model's HF names and shapes (model.py's, built on the meta device); a
    tied model carries no lm_head.weight (the embedding is the output layer)."""
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    with torch.device("meta"):
        own = {k: tuple(v.shape) for k, v in CausalLM(config).state_dict().items()}
    missing, unexpected = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
    wrong = sorted(k for k in set(own) & set(tensors) if tuple(tensors[k].shape) != own[k])
    if missing or unexpected or wrong:
        what = [f"{label} {', '.join(names[:3])}" for label, names in
                (("missing", missing), ("unexpected", unexpected), ("other shapes", wrong)) if names]
        raise ExportError(f"checkpoint {path} does not fit the run's model ({config.architecture}): "
                          + "; ".join(what))
