"""wire/weights.py: the messages that move weights beside ExportWeights / LoadWeights:
Mooncake pulls (InitTransfer, OfferWeights, PullWeights) and the broadcast group
(InitBroadcast, WeightSpecs, PrepareBroadcast, BroadcastWeights, ReceiveWeights), with
their replies. Standard library only.
"""

from __future__ import annotations

from typing import Any

from gyre.workerd.wire.messages import _msg

# --- coordinator -> workerd: weight transfer beside ExportWeights/LoadWeights ------------


@_msg
class InitTransfer:
    """Start the weight-transfer backend (only "mooncake" for now) listening on `host`."""

    req_id: int = 0  # assigned by the link (WorkerLink.call)
    backend: str
    host: str


@_msg
class OfferWeights:
    """Make the trainer's parameters at `version` pullable by other nodes (Mooncake)."""

    req_id: int = 0  # assigned by the link (WorkerLink.call)
    version: int


@_msg
class PullWeights:
    """Pull another node's offer into this node's engine and/or trainer."""

    req_id: int = 0  # assigned by the link (WorkerLink.call)
    handle: dict[str, Any]  # WeightOffer.handle, opaque to the coordinator
    engine: bool
    trainer: bool


@_msg
class InitBroadcast:
    """Join the weight-broadcast group (blocks until every cell joined; the core is rank 0)."""

    req_id: int = 0  # assigned by the link (WorkerLink.call)
    master_address: str
    master_port: int
    rank: int
    world_size: int


@_msg
class WeightSpecs:
    """The name, dtype and shape of every trainer parameter, in broadcast order."""

    req_id: int = 0  # assigned by the link (WorkerLink.call)


@_msg
class PrepareBroadcast:
    """The core exports (and checks) `version` before any receiver enters the collective."""

    req_id: int = 0  # assigned by the link (WorkerLink.call)
    version: int


@_msg
class BroadcastWeights:
    """The core sends the prepared `version` to every other member."""

    req_id: int = 0  # assigned by the link (WorkerLink.call)
    version: int


@_msg
class ReceiveWeights:
    """A member receives the core's broadcast of `version` (tensors as the core's
    `TensorSpecs` lists them) into its engine and/or trainer."""

    req_id: int = 0  # assigned by the link (WorkerLink.call)
    version: int
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    engine: bool
    trainer: bool


@_msg
class TransferReady:
    req_id: int
    session: str  # this node's Mooncake session ("host:port")


@_msg
class WeightOffer:
    req_id: int
    version: int
    nbytes: int
    handle: dict[str, Any]  # opaque: what a PullWeights on another node needs


@_msg
class BroadcastJoined:
    req_id: int
    rank: int
    backend: str  # "nccl" | "gloo"


@_msg
class TensorSpecs:
    req_id: int
    names: list[str]
    dtypes: list[str]  # torch dtype names ("float32", "bfloat16", ...)
    shapes: list[list[int]]


@_msg
class WeightsSent:
    req_id: int
    version: int
    nbytes: int
    seconds: float


@_msg
class WeightsReceived:
    """Pulled or received weights are loaded: `transfer_seconds` on the wire, `seconds` in all."""

    req_id: int
    version: int
    nbytes: int
    transfer_seconds: float
    seconds: float
