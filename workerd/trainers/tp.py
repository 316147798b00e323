"""trainers/tp.py: a model-parallel (TP x PP) megatron-core cell inside one workerd.

`TensorParallelTrainer` is rank 0 of the cell (TP rank 0 of the first pipeline stage), in
the workerd's own process; ranks 1..tp*pp-1 are child processes (spawned, never forked)
that run the same `MegatronTrainer` calls in the same order, SPMD style: every call goes to
the children first, then runs here, then their answers are collected (an error on any rank
is raised here, naming the rank). Megatron orders the ranks TP first: rank r is TP rank
r % tp of stage r // tp. Rank 0 answers for the cell (log-probs and micro-step stats come
to it from the last stage, exported weights are gathered at the first). Gradient reduction
across cells pairs rank r of every cell (the same part of the same model): each rank joins
its own copy of the coordinator's reducer world (`init_reducer`).

On GPUs rank r uses `cuda:r` of the visible devices (CUDA_VISIBLE_DEVICES picks them). Not a launcher of
workerds and not a scheduler: the worker calls it exactly as it calls a one-rank trainer.
"""

from __future__ import annotations

import tempfile
import traceback
from collections.abc import Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed
import torch.multiprocessing as mp

from gyre.workerd.modeldir import ModelConfig
from gyre.workerd.trainers.base import MicroBatch, MicroStepStats, Trainer


class RankError(RuntimeError):
    """A rank of the cell failed a call, or died."""


def rank_init_method(init_method: str, rank: int) -> str:
    """The reducer world of cell rank `rank`: a file beside the coordinator's, or the next ports."""
    if rank == 0:
        return init_method
    if init_method.startswith("file://"):
        return f"{init_method}.tp{rank}"
    if init_method.startswith("tcp://"):
        host, port = init_method[len("tcp://"):].rsplit(":", 1)
        return f"tcp://{host}:{int(port) + rank}"
    raise ValueError(f"cannot derive cell rank {rank}'s rendezvous from {init_method!r}")


def comm_failure(e: BaseException) -> bool:
    """Whether `e` is the cell's own process group failing (a timed-out or broken send, recv
    or collective), after which its ranks cannot be trusted to be in step. gloo raises plain
    RuntimeErrors for these, so their messages are read; a failed cross-cell reduction
    (ReducerError: another cell's trouble) is not one."""
    from gyre.workerd.reducer import ReducerError

    if isinstance(e, ReducerError):
        return False
    if isinstance(e, torch.distributed.DistError):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(s in text for s in (
        "Timed out waiting", "timed out", "pair closure", "Connection closed by peer", "Connection reset by peer",
        "NCCL error", "NCCL communicator"))


def _rank_main(rank: int, tp: int, pp: int, store: str, model_dir: str, config: ModelConfig, options: dict,
               threads: int, start_timeout_s: float, conn) -> None:
    """A child rank: join the cell's group, build the trainer, then serve calls until told to stop."""
    import torch.distributed as dist

    from gyre.workerd.trainers.megatron import MegatronTrainer

    torch.set_num_threads(threads)  # as many as the workerd was given, not one per core
    try:
        if torch.cuda.is_available():
            torch.cuda.set_device(rank)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", init_method=store,
                                rank=rank, world_size=tp * pp, timeout=timedelta(seconds=start_timeout_s))
        trainer = MegatronTrainer(model_dir, config, tp=tp, pp=pp, **options)
        reducer = None
        conn.send(("ready", None))
    except BaseException as e:  # noqa: BLE001 - reported to rank 0, which raises it
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"))
        return
    while True:
        try:
            method, args, kwargs = conn.recv()
        except EOFError:
            return  # rank 0 is gone
        try:
            if method == "stop":
                conn.send(("ok", None))
                return
            if method == "init_reducer":
                from gyre.workerd.reducer import GradReducer

                reducer = GradReducer(**kwargs)
                result = None
            elif method == "set_participants":
                reducer.participants = kwargs["participants"]
                result = None
            else:
                if method == "optimizer_step":
                    kwargs = {**kwargs, "reducer": reducer}
                result = getattr(trainer, method)(*args, **kwargs)
                if method in ("export_weights", "current_logprobs", "grads"):
                    result = None  # rank 0 answers for the cell
            conn.send(("ok", result))
        except BaseException as e:  # noqa: BLE001
            conn.send(("broken" if comm_failure(e) else "error",
                       f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"))


class TensorParallelTrainer(Trainer):
    def __init__(self, model_dir: str, config: ModelConfig, *, tp: int, pp: int = 1, start_timeout_s: float = 300.0,
                 **options: Any):
        import torch.distributed as dist

        from gyre.workerd.trainers.hf_megatron import check_pp, check_tp
        from gyre.workerd.trainers.megatron import MegatronTrainer

        check_tp(config, tp)
        check_pp(config, pp)
        world = tp * pp
        if dist.is_initialized():
            raise RankError("torch.distributed is already initialised in this process: a TP cell owns it")
        if torch.cuda.is_available() and torch.cuda.device_count() < world:
            raise RankError(f"tensor-parallel size {tp} x pipeline-parallel size {pp} needs {world} GPUs; "
                            f"{torch.cuda.device_count()} visible")
        self.tp, self.pp = tp, pp
        self._replies: list[Any] = []  # the children's answers to the last call
        self._broken: str | None = None
        self._store_dir = Path(tempfile.mkdtemp(prefix="gyre-tp-"))
        store = f"file://{self._store_dir / 'store'}"
        ctx = mp.get_context("spawn")
        self._conns, self._procs = [], []
        try:
            for rank in range(1, world):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_rank_main, args=(rank, tp, pp, store, str(model_dir), config, options,
                                                                 torch.get_num_threads(), start_timeout_s, child),
                                   daemon=True, name=f"gyre-tp-rank-{rank}")
                self._conns.append(parent)
                proc.start()
                child.close()
                self._procs.append(proc)
            if torch.cuda.is_available():
                torch.cuda.set_device(0)
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", init_method=store,
                                    rank=0, world_size=world, timeout=timedelta(seconds=start_timeout_s))
            self.local = MegatronTrainer(model_dir, config, tp=tp, pp=pp, **options)
            self._collect("start-up", timeout=start_timeout_s)
        except BaseException as e:
            # A child's own failure (a bad device, out of memory) is why rank 0 timed out in a
            # collective: its report, already sent, goes with the error.
            for note in self._child_errors(timeout=5):
                e.add_note(note)
            self.close()
            raise
        self.reducer = None

    # --- the SPMD call --------------------------------------------------------------------

    def _collect(self, what: str, timeout: float | None = None) -> list[Any]:
        """Every rank's reply to `what` (all are read, so replies never shift onto the next
        call); then the first failure is raised. A rank that times out or dies breaks the
        cell: its later calls fail at once."""
        if self._broken:
            raise RankError(self._broken)
        out, errors = [], []
        for rank, (conn, proc) in enumerate(zip(self._conns, self._procs), start=1):
            try:
                if not conn.poll(timeout):
                    self._broken = (f"cell rank {rank} did not answer {what} within {timeout} s "
                                    f"(alive: {proc.is_alive()}, exit code {proc.exitcode})")
                    continue
                status, value = conn.recv()
            except (EOFError, OSError):
                self._broken = f"cell rank {rank} died during {what} (exit code {proc.exitcode})"
                continue
            if status == "broken":  # its side of the cell's group failed: the cell cannot go on
                self._broken = f"cell rank {rank}'s process group failed during {what}: {value}"
            elif status == "error":
                errors.append(f"cell rank {rank} failed {what}: {value}")
            out.append(value)
        if self._broken:
            self.close()
            raise RankError(self._broken)
        if errors:
            raise RankError(errors[0])
        return out

    def _send(self, method: str, args: tuple = (), kwargs: dict | None = None) -> None:
        if self._broken:
            raise RankError(self._broken)
        for rank, conn in enumerate(self._conns, start=1):
            try:
                conn.send((method, args, kwargs or {}))
            except (BrokenPipeError, OSError):
                self._broken = f"cell rank {rank} is gone (exit code {self._procs[rank - 1].exitcode})"
                self.close()
                raise RankError(self._broken) from None

    def _all(self, method: str, *args, **kwargs):
        self._send(method, args, kwargs)
        return self._here(method, lambda: getattr(self.local, method)(*args, **kwargs))

    def _child_errors(self, timeout: float) -> list[str]:
        """The error reports the children have sent (or send within `timeout` in all), read off."""
        import time

        notes = []
        deadline = time.monotonic() + timeout
        for rank, conn in enumerate(self._conns, start=1):
            try:
                if conn.poll(max(0.0, deadline - time.monotonic())):
                    status, value = conn.recv()
                    if status == "error":
                        notes.append(f"cell rank {rank}: {value}")
            except (EOFError, OSError):
                notes.append(f"cell rank {rank} died")
        return notes

    def _here(self, method: str, fn):
        """Rank 0's share of a call the children were sent; then their answers. When rank
        0 fails, the children are given a bounded time (a collective may wait on rank 0),
        and their errors go with rank 0's. A failed communication between the ranks (a
        timed-out or broken collective) breaks the cell: its group cannot be trusted."""
        try:
            result = fn()
        except BaseException as e:
            try:
                self._collect(method, timeout=60)
            except RankError as children:
                e.add_note(str(children))
            if comm_failure(e) and not self._broken:
                self._broken = f"the cell's process group failed during {method}: {e}"
                try:
                    self.close()
                except Exception as closing:  # noqa: BLE001 - the first error is the one to raise
                    e.add_note(f"closing the cell also failed: {closing}")
            raise
        self._replies = self._collect(method)
        return result

    # --- the trainer contract -------------------------------------------------------------

    @property
    def version(self) -> int:
        return self.local.version

    @property
    def config(self) -> ModelConfig:
        return self.local.config

    @property
    def num_params(self) -> int:
        return self.local.num_params

    def train_micro_step(self, batch: MicroBatch) -> MicroStepStats:
        return self._all("train_micro_step", batch)

    def current_logprobs(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._all("current_logprobs", input_ids)

    def optimizer_step(self, num_executions: int, reducer=None, apply: bool = True) -> float:
        self._send("optimizer_step", (num_executions,), {"apply": apply})  # children use their own reducers
        return self._here("optimizer_step",
                          lambda: self.local.optimizer_step(num_executions, reducer=reducer, apply=apply))

    def export_weights(self) -> dict[str, torch.Tensor]:
        return self._all("export_weights")

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        return self._all("load_weights", list(named), version)

    def offload(self) -> int:
        """Bytes freed on every rank of the cell."""
        return self._all("offload") + sum(self._replies)

    def onload(self) -> None:
        self._all("onload")

    def save_checkpoint(self, path: str) -> None:
        self._all("save_checkpoint", path)

    def load_checkpoint(self, path: str) -> None:
        self._all("load_checkpoint", path)

    def grads(self) -> dict[str, torch.Tensor]:
        return self._all("grads")

    # --- cross-cell reduction ---------------------------------------------------------------

    def init_reducer(self, *, rank: int, world_size: int, init_method: str):
        """Rank r of this cell joins the reducer world of cell rank r; returns rank 0's."""
        from gyre.workerd.reducer import GradReducer

        for r, conn in enumerate(self._conns, start=1):  # each child its own world's rendezvous
            conn.send(("init_reducer", (), {"rank": rank, "world_size": world_size,
                                            "init_method": rank_init_method(init_method, r)}))
        self.reducer = self._here("init_reducer", lambda: GradReducer(rank=rank, world_size=world_size,
                                                                       init_method=init_method))
        return self.reducer

    def set_participants(self, participants: int) -> None:
        self._send("set_participants", (), {"participants": participants})
        self._collect("set_participants")

    def close(self) -> None:
        """Stop the children and leave this process as it was before the cell (so a new
        Welcome can build another): Megatron's parallel state, the process group, the store."""
        import shutil


        for conn in self._conns:
            try:
                conn.send(("stop", (), {}))
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []
        from gyre.workerd.trainers.megatron_model import teardown_parallel

        teardown_parallel()
        shutil.rmtree(self._store_dir, ignore_errors=True)
