"""transfer.py: the weight-transfer layer: how one cell's parameters reach other cells.

Two backends behind one seam (the coordinator picks with `weight_transfer`):

- `zmq`, the fallback that always works: the source's ExportWeights frames travel to the
  coordinator and on to each destination in LoadWeights (two copies over the link).
- `mooncake`: the source packs its parameters once per version into one buffer registered
  with a Mooncake Transfer Engine and hands out a small handle (session, address, length,
  manifest); each destination pulls it with one `transfer_sync_read` into its own registered
  buffer and loads from there. The bytes never pass through the coordinator, and the pull
  is served by the source's transfer threads, so a training core is not interrupted. On
  clusters that is RDMA; on CPU machines the `mooncake-transfer-engine-non-cuda` package
  (with Debian's `libibverbs1`) runs it over TCP. Mooncake listens on all interfaces.

- `BroadcastGroup`: a torch.distributed group of its own (a TCP rendezvous at
  master_address:master_port, a store prefixed with the group name), the core's trainer as
  rank 0. A publication is one broadcast per tensor from rank 0 in the order of its (name,
  dtype, shape) specs; each other member's workerd receives them (`recv`) and loads its
  trainer and engine from there. NCCL on GPUs, gloo on CPU; the fallback where Mooncake is
  missing.

Not the wire protocol (wire/) and not the policy of who sends what (the coordinator).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gyre.workerd.wire import GyreError

BACKENDS = ("zmq", "mooncake")
INSTALL_HINT = ("pip install mooncake-transfer-engine-non-cuda (CPU machines; plus `apt-get install libibverbs1`) "
                "or mooncake-transfer-engine (CUDA)")

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
           torch.int64: "int64", torch.int32: "int32", torch.uint8: "uint8"}
_BY_NAME = {v: k for k, v in _DTYPES.items()}


class TransferError(GyreError):
    """A transfer backend that cannot work here, or a transfer that failed."""


@dataclass
class Packed:
    buffer: torch.Tensor  # uint8, contiguous
    manifest: list[list]  # [name, dtype, shape, offset, nbytes]

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()


def pack(named: dict[str, torch.Tensor]) -> Packed:
    """Every tensor's bytes, back to back, 64-byte aligned, in one uint8 buffer."""
    manifest, offset = [], 0
    for name, t in named.items():
        if t.dtype not in _DTYPES:
            raise TransferError(f"tensor {name!r}: unsupported dtype {t.dtype}")
        n = t.numel() * t.element_size()
        manifest.append([name, _DTYPES[t.dtype], list(t.shape), offset, n])
        offset += -(-n // 64) * 64
    buf = torch.empty(offset, dtype=torch.uint8)
    for (_, _, _, off, n), t in zip(manifest, named.values()):
        buf[off:off + n].copy_(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8))
    return Packed(buf, manifest)


def unpack(buffer: torch.Tensor, manifest: list[list]) -> dict[str, torch.Tensor]:
    """Tensors viewing `buffer` (copy before the buffer is reused)."""
    out = {}
    for name, dtype, shape, off, n in manifest:
        if dtype not in _BY_NAME:
            raise TransferError(f"tensor {name!r}: unknown dtype {dtype!r}")
        out[name] = buffer[off:off + n].view(_BY_NAME[dtype]).reshape(shape)
    return out


class MooncakeTransfer:
    """One Transfer Engine per workerd, created on first use."""

    def __init__(self, host: str):
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise TransferError(f"weight_transfer = mooncake, but Mooncake does not import here ({e}): "
                                f"{INSTALL_HINT}") from None
        self.engine = TransferEngine()
        rc = self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise TransferError(f"Mooncake TransferEngine.initialize({host!r}, P2PHANDSHAKE, tcp) returned {rc}")
        self.host = host
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self._offer: tuple[int, Packed] | None = None  # (version, registered source buffer)
        self._sink: torch.Tensor | None = None  # registered receive buffer, reused while big enough

    def _register(self, buf: torch.Tensor) -> None:
        rc = self.engine.register_memory(buf.data_ptr(), buf.numel())
        if rc != 0:
            raise TransferError(f"Mooncake register_memory of {buf.numel()} bytes returned {rc}")

    def _unregister(self, buf: torch.Tensor) -> None:
        self.engine.unregister_memory(buf.data_ptr())

    def offer(self, named: dict[str, torch.Tensor], version: int) -> dict[str, Any]:
        """Make `named` (at `version`) pullable; the previous version's buffer is released."""
        if self._offer is None or self._offer[0] != version:
            packed = pack(named)
            self._register(packed.buffer)
            if self._offer is not None:
                self._unregister(self._offer[1].buffer)
            self._offer = (version, packed)
        packed = self._offer[1]
        return {"backend": "mooncake", "session": self.session, "addr": packed.buffer.data_ptr(),
                "nbytes": packed.nbytes, "manifest": packed.manifest, "version": version}

    def pull(self, handle: dict[str, Any]) -> tuple[dict[str, torch.Tensor], float]:
        """The handle's bytes into this node's receive buffer; (tensors viewing it, seconds)."""
        n = int(handle["nbytes"])
        if self._sink is None or self._sink.numel() < n:
            if self._sink is not None:
                self._unregister(self._sink)
            self._sink = torch.empty(n, dtype=torch.uint8)
            self._register(self._sink)
        t0 = time.perf_counter()
        rc = self.engine.transfer_sync_read(handle["session"], self._sink.data_ptr(), int(handle["addr"]), n)
        seconds = time.perf_counter() - t0
        if rc != 0:
            raise TransferError(f"Mooncake transfer_sync_read of {n} bytes from {handle['session']} returned {rc}")
        return unpack(self._sink[:n], handle["manifest"]), seconds


class BroadcastGroup:
    """One member of a weight-broadcast group (rank 0 sends, the others receive), built
    apart from the default process group (a TP cell's own) as SGLang's
    `init_custom_process_group` builds one. Construction blocks until every rank has
    joined; rank 0 hosts the TCP store, which listens on all interfaces."""

    def __init__(self, *, master_address: str, master_port: int, rank: int, world_size: int,
                 group_name: str = "gyre_weights", backend: str = "gloo", timeout_s: float = 300.0):
        from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world

        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside a group of {world_size}")
        timeout = timedelta(seconds=timeout_s)
        store, _, _ = next(dist.rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                           timeout=timeout))
        store.set_timeout(timeout)
        self.group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend),
                                                  dist.PrefixStore(group_name, store),
                                                  group_name=group_name, timeout=timeout)
        _world.pg_group_ranks[self.group] = {i: i for i in range(world_size)}
        self.rank, self.world_size, self.name = rank, world_size, group_name

    @staticmethod
    def specs(named: dict[str, torch.Tensor]) -> list[tuple[str, str, list[int]]]:
        """(name, dtype, shape) in broadcast order: what receivers allocate from."""
        return [(k, str(v.dtype).removeprefix("torch."), list(v.shape)) for k, v in named.items()]

    def send(self, named: dict[str, torch.Tensor]) -> int:
        """Rank 0: broadcast every tensor, in order; returns bytes sent."""
        if self.rank != 0:
            raise TransferError(f"rank {self.rank} of {self.name} receives; only rank 0 sends")
        works = [dist.broadcast(t.contiguous(), src=0, group=self.group, async_op=True) for t in named.values()]
        for w in works:
            w.wait()
        return sum(t.numel() * t.element_size() for t in named.values())

    def recv(self, specs: list[tuple[str, str, list[int]]], device: str = "cpu") -> dict[str, torch.Tensor]:
        """Other ranks: receive one publication described by `specs`."""
        out = {name: torch.empty(shape, dtype=getattr(torch, dtype), device=device) for name, dtype, shape in specs}
        works = [dist.broadcast(t, src=0, group=self.group, async_op=True) for t in out.values()]
        for w in works:
            w.wait()
        return out

    def close(self) -> None:
        dist.destroy_process_group(self.group)
