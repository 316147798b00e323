"""weightfiles.py: a model directory's safetensors, by Hugging Face name.

Which files hold the weights (`weight_files`, through the shard index when there is one)
and every tensor in them (`iter_weights`). Below both modeldir.py, which checks a
directory whole, and model.py, which loads a `CausalLM` from one, so neither of those
imports the other for it. Standard library at import; safetensors only while streaming.
Not the name mapping (hf_megatron.py) and not the config (coordinator/modeldir.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from gyre.coordinator.modeldir import require


def weight_files(model_dir: str | Path) -> list[Path]:
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [require(root / n, "a weight shard named by the index") for n in names]
    return [require(root / "model.safetensors", "the model weights")]


def iter_weights(model_dir: str | Path) -> Iterator[tuple[str, object]]:
    """Yield (hf_name, torch.Tensor) for every tensor in the directory's safetensors."""
    from safetensors import safe_open

    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
