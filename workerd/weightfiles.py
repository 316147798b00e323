"""weightfiles.py: a model directory's safetensors, by Hugging Face name.

Which files hold the weights (`weight_files`, through the shard index when there is one),
every tensor in them (`iter_weights`) and the dtype they are stored in (`weights_dtype`).
Below both modeldir.py, which checks a directory whole, and model.py, which loads a
`CausalLM` from one, so neither of those imports the other for it. Standard library at
import; safetensors only while streaming. Not the name mapping (hf_megatron.py) and not
the config (modelconfig.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

from gyre.workerd.modelconfig import ModelDirError, require


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


# safetensors' dtype codes for the floating types a model directory stores its weights in.
_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


def weights_dtype(model_dir: str | Path) -> str:
    """The torch dtype name most of the directory's floating-point elements are stored in
    ("bfloat16", "float32", ...), read from the safetensors headers alone (no tensor loaded)."""
    count: dict[str, int] = {}
    for path in weight_files(model_dir):
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, entry in header.items():
            if name != "__metadata__" and (dtype := _DTYPES.get(entry["dtype"])) is not None:
                count[dtype] = count.get(dtype, 0) + math.prod(entry["shape"])
    if not count:
        raise ModelDirError(f"model directory {model_dir} has no floating-point weights")
    return max(count, key=count.__getitem__)
