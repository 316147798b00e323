"""tensors.py: torch tensors <-> wire TensorFrames, zero-copy where the dtype allows.

Kept out of wire/ so that package never imports torch. Buffers received from ZeroMQ are
read-only: tensors made from them must be copied before being written to.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from gyre.workerd.wire import TensorFrame

_BY_NAME = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "int16": torch.int16,
    "int8": torch.int8, "uint8": torch.uint8, "uint16": torch.uint16, "bool": torch.bool,
}
_NAME = {v: k for k, v in _BY_NAME.items()}


def to_frame(name: str, t: torch.Tensor) -> TensorFrame:
    t = t.detach().contiguous().cpu()
    if t.dtype not in _NAME:
        raise TypeError(f"tensor {name!r} has unsupported dtype {t.dtype}")
    # numpy has no bfloat16: ship its bytes as int16 and name the real dtype.
    data = t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()
    return TensorFrame(name, _NAME[t.dtype], tuple(t.shape), data)


def to_frames(named: dict[str, torch.Tensor]) -> list[TensorFrame]:
    return [to_frame(k, v) for k, v in named.items()]


def from_frame(f: TensorFrame) -> torch.Tensor:
    """A tensor viewing the frame's buffer (read-only: clone before writing)."""
    dtype = _BY_NAME.get(f.dtype)
    if dtype is None:
        raise ValueError(f"tensor {f.name!r} has unknown dtype {f.dtype!r}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable": we never write
        if dtype == torch.bfloat16:
            t = torch.from_numpy(np.frombuffer(f.data, dtype=np.int16)).view(torch.bfloat16)
        else:
            empty = not len(memoryview(f.data).cast("B"))
            t = torch.empty(0, dtype=dtype) if empty else torch.frombuffer(f.data, dtype=dtype)
    expected = int(np.prod(f.shape)) if f.shape else 1
    if t.numel() != expected:
        raise ValueError(f"tensor {f.name!r}: {t.numel()} elements for shape {f.shape}")
    return t.reshape(f.shape)


def from_frames(frames: list[TensorFrame]) -> dict[str, torch.Tensor]:
    return {f.name: from_frame(f) for f in frames}
