"""trainers/megatron.py: the megatron-core trainer, a GPTModel built from a HF model directory.

Same contract as trainers/cpu.py (trainers/base.py): GSPO micro-steps accumulate
gradients, `optimizer_step` reduces them across cells over the prefix groups, normalises,
clips and updates; weights go in and out by HF names (hf_megatron.py), so a checkpoint
loads and a publication reaches SGLang or the CPU engine without a conversion step.

    GPU   Megatron's DDP (grads in contiguous fp32 buffers) + its distributed optimizer,
          bf16 parameters; TP and PP from the caller's process group.
    CPU   Megatron's model and parallel state with torch.optim.AdamW, behind a small shim
          applied only when no GPU is present (DEPS-NOTES.md; megatron_model.py builds the
          model and parallel state): `torch.cuda.current_device` answers "cpu", the no-op
          inference RNG tracker, an explicit boolean causal mask.

Per-token log-probs are minus Megatron's per-token loss with labels; under TP its
vocab-parallel cross-entropy gathers them from the vocabulary shards.

Pipeline parallelism (PP > 1): each rank builds its stage of the GPTModel (the embedding
on the first, the final norm and output layer on the last) and a micro-step runs as a
GPipe schedule (pipeline.py) over `microbatches` chunks of its rows (2 x PP unless set):
the last stage takes the GSPO loss over all rows at once (one call of the shared loss, so
the micro-step's statistics are the same as unpipelined) and each chunk's gradient goes
back from there. The bubble is (PP - 1) / (chunks + PP - 1) of a micro-step
(bench/pipeline.py); every chunk's activations are held until the loss, as an unpipelined
micro-step holds them. Megatron's 1F1B schedule would hold only PP chunks' (the loss is a
sum over tokens, so per-chunk losses would do), but it is CUDA-bound and not used. Tied
embeddings are a parameter on the first stage and a copy on the last, their gradients
summed before every update (Megatron syncs the copy only when it builds the model);
clipping takes the norm over every stage, the copy counted once. A failure on some ranks
only is agreed over the cell (`_agree`) and raised on every rank, the step's gradients
dropped.

This module builds the trainer and runs its forward, micro-steps and update, and owns the
cell's agreement (`_agree`). Its other public methods hand over to one module per concept:
weights in and out by HF names to megatron_weights.py; role changes (`offload()` /
`onload()`, the state to host memory and back) and checkpoints to megatron_state.py. Not a
multi-process launcher: TP x PP > 1 needs one process per rank with torch.distributed
initialised by the caller (trainers/tp.py does it inside workerd).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F

# ModelDirError and to_megatron stay importable from here (megatron_weights.py is their user now).
from gyre.workerd.modeldir import ModelConfig, ModelDirError  # noqa: F401
from gyre.workerd.trainers import megatron_state, megatron_weights
from gyre.workerd.trainers.base import (
    MicroBatch,
    MicroStepStats,
    Trainer,
    backward_micro_step,
    step_or_drop,
    sum_and_normalise,
)
from gyre.workerd.trainers.hf_megatron import check_pp, check_tp, holds, is_tp_split, to_hf, to_megatron  # noqa: F401
from gyre.workerd.trainers.megatron_model import (
    build_gpt,
    pp_group,
    quiet_import,
    setup_parallel,
    stage_of,
    tp_rank,
    tp_size,
)
from gyre.workerd.trainers.megatron_tree import tree_logprobs
from gyre.workerd.trainers.pipeline import GPipe
from gyre.workerd.trainers.treebatch import TreeBatch
from gyre.workerd.weightfiles import iter_weights
from gyre.workerd.wire import EngineSpec, TrainerSpec

_ENGINE, _TRAINER = EngineSpec(), TrainerSpec()  # the options' defaults, written once (wire/messages.py)


def _scale_logits(temperature: float):
    def hook(module, args, out):
        if isinstance(out, tuple):  # ColumnParallelLinear returns (output, bias)
            return (out[0] / temperature, *out[1:])
        return out / temperature
    return hook


class MegatronTrainer(Trainer):
    def __init__(self, model_dir: str, config: ModelConfig, *, lr: float = _TRAINER.lr,
                 weight_decay: float = _TRAINER.weight_decay, grad_clip: float = _TRAINER.grad_clip, version: int = 0,
                 tp: int = 1, pp: int = 1, microbatches: int | None = None, offload: bool | None = None,
                 seed: int = _ENGINE.seed, temperature: float = _TRAINER.temperature):
        check_tp(config, tp)
        check_pp(config, pp)
        setup_parallel(tp, pp, seed=seed)
        self.config = config
        self.version = version
        self.grad_clip = grad_clip
        self.on_gpu = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.on_gpu else torch.device("cpu")
        self.offload_enabled = self.on_gpu if offload is None else offload
        self.tp, self.tp_rank = tp_size(), tp_rank()
        self.pp = pp
        self.dtype = torch.bfloat16 if self.on_gpu else torch.float32
        model = build_gpt(config, dtype=self.dtype).to(self.device)
        self.stage = stage_of(model)
        self.temperature = temperature
        if temperature != 1.0 and self.stage.last:
            # Log-probs of the distribution the engines sample: logits / T before Megatron's
            # (vocab-parallel) cross-entropy, by a hook on the output layer (GPTModel's forward
            # takes no temperature).
            model.output_layer.register_forward_hook(_scale_logits(temperature))
        # GPipe chunks per micro-step (at most one per row): 2 x PP leaves a bubble of 1/3 to 1/5.
        self.pipe = GPipe(self.stage, hidden=config.hidden_size, dtype=self.dtype, device=self.device,
                          chunks=2 * pp if microbatches is None else int(microbatches), run=self._forward,
                          set_input=model.set_input_tensor) if pp > 1 else None
        megatron_weights.load_into(self, model, dict(iter_weights(model_dir)))
        self.gpt = model  # the GPTModel itself (names without a DDP prefix)
        self._num_params = self._count_params()  # a collective under PP: every stage counts its own
        self._shapes = {k: v.shape for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
        self._pending: dict[str, torch.Tensor] | None = None  # weights loaded while offloaded
        if self.on_gpu:
            self.model, self.optimizer = self._megatron_ddp(model, lr, weight_decay, grad_clip)
        else:
            self.model = model.train()
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-15,
                                               weight_decay=weight_decay)
        self.micro_steps = 0
        self._host: list[tuple[torch.UntypedStorage, torch.Tensor]] | None = None  # while offloaded
        self._spare: list[torch.Tensor] = []  # host buffers of the last offload, reused by the next

    @staticmethod
    def _megatron_ddp(model, lr, weight_decay, grad_clip):
        with quiet_import():
            from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True), model)
        opt = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=lr, weight_decay=weight_decay, adam_beta1=0.9, adam_beta2=0.95,
            adam_eps=1e-15, clip_grad=grad_clip, bf16=True, params_dtype=torch.bfloat16,
            use_distributed_optimizer=True), [ddp])
        return ddp, opt

    def _is_copy(self, name: str) -> bool:
        """A last stage's copy of a tied embedding (the first stage holds the parameter)."""
        return name == "output_layer.weight" and self.config.tie_word_embeddings and not self.stage.first

    def _count_params(self) -> int:
        n = sum(p.numel() * (self.tp if is_tp_split(name) else 1)
                for name, p in self.gpt.named_parameters() if not self._is_copy(name))
        if self.pp == 1:
            return n
        total = torch.tensor(n, dtype=torch.int64, device=self.device)
        dist.all_reduce(total, group=pp_group())
        return int(total)

    @property
    def num_params(self) -> int:
        """The whole model's parameters (TP-split ones counted over every rank, norms once,
        every pipeline stage's)."""
        return self._num_params

    # --- forward ------------------------------------------------------------------------

    def _logprobs(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[R, T] -> log p(input_ids[t] | <t) at [R, T] (t = 0 is 0), float32 (one stage)."""
        return self._forward(input_ids.to(self.device))

    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        """This stage's forward of rows `ids`: log-probs on the last stage (on the host),
        hidden states [T, rows, hidden] on the others (the next stage's input)."""
        r, t = ids.shape
        positions = torch.arange(t, device=self.device).expand(r, t)
        mask = torch.ones(t, t, dtype=torch.bool, device=self.device).triu(1)[None, None]  # True: hidden
        labels = torch.roll(ids, -1, dims=1) if self.stage.last else None  # the last column's is never read
        out = self.model(ids, positions, mask, labels=labels)  # [R, T] loss, vocab-parallel under TP
        return F.pad(-out[:, :-1].float(), (1, 0)).cpu() if self.stage.last else out

    def _agree(self, failed: list[BaseException], payload=None, *, what: str, drop_grads: bool = False,
               passthrough: tuple[type[Exception], ...] = ()) -> list:
        """Every rank of the cell's (failure, payload) after a step of work that only some
        ranks may fail (a pipeline stage, or one TP rank, out of memory): a failure anywhere
        is raised on every rank (the failing rank's own exception there), after dropping the
        step's gradients if asked, so none is left half-made. Returns the payloads of this
        rank's pipeline column (its TP rank's on every stage), by stage. A failure of a type
        in `passthrough` is raised as that type, with its message, on every rank."""
        if self.tp * self.pp == 1:
            if failed:
                if drop_grads:
                    self._drop_grads()
                raise failed[0]
            return [payload]
        from megatron.core import parallel_state as ps

        group = ps.get_model_parallel_group()
        mine = None if not failed else (type(failed[0]).__name__, str(failed[0]))
        verdicts: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(verdicts, (mine, ps.get_pipeline_model_parallel_rank(), self.tp_rank, payload),
                               group=group)
        bad = [(stage, tp_rank, error) for error, stage, tp_rank, _ in verdicts if error is not None]
        if bad:
            if drop_grads:
                self._drop_grads()
            if failed:
                raise failed[0]
            stage, tp_rank, (kind, message) = bad[0]
            for cls in passthrough:
                if cls.__name__ == kind:
                    raise cls(message)
            where = f"pipeline stage {stage}" if self.tp == 1 else f"pipeline stage {stage}, TP rank {tp_rank}"
            dropped = " (this step's gradients were dropped on every rank)" if drop_grads else ""
            raise RuntimeError(f"{what} failed on {where}: {kind}: {message}{dropped}")
        return [p for _, p in sorted((stage, p) for _, stage, tp_rank, p in verdicts if tp_rank == self.tp_rank)]

    def train_micro_step(self, batch: MicroBatch | TreeBatch) -> MicroStepStats:
        megatron_state.need_onloaded(self)
        t0 = time.perf_counter()
        if isinstance(batch, TreeBatch) and self.pp == 1:  # each shared token computed once
            stats = backward_micro_step(tree_logprobs(self.model, batch, self.device).cpu(), batch, t0)
            self.micro_steps += 1
            return stats
        if isinstance(batch, TreeBatch):
            # A pipeline: the stages pass [T, rows, hidden] activations between them, so the
            # tree is expanded back into path rows (the wire still carried each token once).
            batch = batch.to_micro_batch()
        if self.pp == 1:
            stats = backward_micro_step(self._logprobs(batch.input_ids), batch, t0)
        else:
            stats = self._pipeline_micro_step(batch, t0)
        self.micro_steps += 1
        return stats

    def _pipeline_micro_step(self, batch: MicroBatch, t0: float) -> MicroStepStats:
        from gyre.workerd.loss import gspo_loss

        failed: list[BaseException] = []
        chunks = self.pipe.forward(batch.input_ids, grad=True, failed=failed)
        grads, summary = None, None
        if self.stage.last and not failed:
            try:
                logps = [y for _, y, _ in chunks]
                out = gspo_loss(torch.cat(logps), batch.behaviour_logprobs, batch.advantages, batch.loss_weights,
                                batch.target_mask, batch.exec_ids)
                grads = torch.autograd.grad(out.loss_sum, logps, materialize_grads=True)  # d loss / d each chunk
                summary = (out.loss_sum.item(), out.tokens, out.executions, out.mismatch)
            except Exception as e:  # noqa: BLE001
                failed.append(e)
        self.pipe.backward(chunks, grads, failed)
        loss, tokens, executions, mismatch = self._agree(failed, summary, what="micro-step", drop_grads=True)[-1]
        return MicroStepStats(loss, tokens, executions, mismatch, time.perf_counter() - t0)

    def current_logprobs(self, input_ids: torch.Tensor) -> torch.Tensor:
        with megatron_state.params_onloaded(self), torch.no_grad():
            if self.pp == 1:
                return self._logprobs(input_ids)
            from megatron.core import parallel_state as ps

            failed: list[BaseException] = []
            chunks = self.pipe.forward(input_ids, grad=False, failed=failed)
            logp = None
            if not failed:  # everything this rank allocates, before the agreement
                try:
                    logp = (torch.cat([y for _, y, _ in chunks]) if self.stage.last else
                            torch.zeros(input_ids.shape, dtype=torch.float32)).to(self.device)
                except Exception as e:  # noqa: BLE001
                    failed.append(e)
            self._agree(failed, what="log-probs")

            dist.broadcast(logp, src=ps.get_pipeline_model_parallel_last_rank(), group=pp_group())
            return logp.cpu()

    # --- update -------------------------------------------------------------------------

    def grads(self) -> dict[str, torch.Tensor]:
        """This rank's accumulated gradients by Megatron name (the main fp32 grads on GPU)."""
        out = {}
        for name, p in self.gpt.named_parameters():
            g = getattr(p, "main_grad", None) if self.on_gpu else p.grad
            out[name] = torch.zeros_like(p, dtype=torch.float32) if g is None else g
        return out

    def optimizer_step(self, num_executions: int, reducer=None, apply: bool = True) -> float:
        if num_executions < 1:
            raise ValueError(f"num_executions must be >= 1, got {num_executions}")
        megatron_state.need_onloaded(self)
        if self.on_gpu:
            return self._gpu_step(num_executions, reducer, apply)
        sum_and_normalise(list(self.gpt.parameters()), num_executions, reducer)
        self._sync_tied_embedding(lambda p: p.grad)
        return step_or_drop(self, self._clip(list(self.gpt.named_parameters())), apply)

    def _sync_tied_embedding(self, grad_of) -> None:
        """Under PP a tied embedding is a parameter on the first stage and a copy on the
        last; both take the sum of their gradients, so both make the same update."""
        from megatron.core import parallel_state as ps

        if self.pp == 1 or not self.config.tie_word_embeddings or not (self.stage.first or self.stage.last):
            return
        weight = self.gpt.shared_embedding_or_output_weight()
        dist.all_reduce(grad_of(weight), group=ps.get_embedding_group())

    def _clip(self, params: list[tuple[str, torch.nn.Parameter]]) -> float:
        """Global-norm clipping over the whole model: TP-sharded gradients are summed across
        the TP group, replicated ones counted once, every pipeline stage's added (a tied
        embedding's copy left out). Same formula as torch's clip_grad_norm_."""
        if self.tp == 1 and self.pp == 1:
            return float(torch.nn.utils.clip_grad_norm_([p for _, p in params], self.grad_clip))
        from megatron.core import parallel_state as ps

        sharded = torch.zeros((), dtype=torch.float64)
        replicated = torch.zeros((), dtype=torch.float64)
        for name, p in params:
            if self._is_copy(name):
                continue
            sq = p.grad.double().pow(2).sum()
            if is_tp_split(name):
                sharded += sq
            else:
                replicated += sq
        if self.tp > 1:
            dist.all_reduce(sharded, group=ps.get_tensor_model_parallel_group())
        total = sharded + replicated
        if self.pp > 1:
            dist.all_reduce(total, group=pp_group())
        norm = float(total.sqrt())
        coef = min(1.0, self.grad_clip / (norm + 1e-6))
        for _, p in params:
            p.grad.mul_(coef)
        return norm

    def _gpu_step(self, num_executions: int, reducer, apply: bool) -> float:
        try:
            self.model.finish_grad_sync()
            grad_buffers = [b.grad_data for b in self.model.buffers + self.model.expert_parallel_buffers]
            if reducer is not None:
                reducer.all_reduce(grad_buffers)
            self._sync_tied_embedding(lambda p: p.main_grad)
            # Checked after the reduction, so every cell of the group reaches the same verdict
            # (a cell refusing before it would leave the others waiting in the all-reduce),
            # and agreed over the cell's ranks (each holds its own part of the model).
            finite = torch.tensor(float(all(bool(torch.isfinite(g).all()) for g in grad_buffers)),
                                  device=self.device)
            if self.tp * self.pp > 1:
                from megatron.core import parallel_state as ps

                dist.all_reduce(finite, op=dist.ReduceOp.MIN, group=ps.get_model_parallel_group())
            if not bool(finite):
                raise RuntimeError("non-finite gradients: step skipped, gradients dropped")
            for g in grad_buffers:
                g.div_(num_executions)
            if apply:
                ok, norm, _ = self.optimizer.step()  # clips to clip_grad, updates, gathers params
                if not ok or norm is None or not math.isfinite(norm):
                    raise RuntimeError(f"megatron optimizer step failed (grad norm {norm})")
                self.version += 1
            else:
                norm = self._norm_only(grad_buffers)
            return float(norm)
        finally:  # a failed step leaves no gradients behind to add to the next
            self._drop_grads()

    def _drop_grads(self) -> None:
        if self.on_gpu:
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)
        self.micro_steps = 0

    @staticmethod
    def _norm_only(buffers: list[torch.Tensor]) -> float:
        return float(torch.sqrt(sum(g.double().pow(2).sum() for g in buffers)))

    # --- weights by HF name (megatron_weights.py) ---------------------------------------

    def export_weights(self) -> dict[str, torch.Tensor]:
        """Whole HF-named tensors on the host (every TP rank gathers them; under PP the
        first stage's ranks do, the others return {}); a snapshot."""
        if self._pending is not None:
            return megatron_weights.gather_stages(self, lambda: {
                k: v for k, v in self._pending.items() if k != "model.embed_tokens.weight" or self.stage.first})
        with megatron_state.params_onloaded(self):
            return megatron_weights.gather_stages(
                self, lambda: to_hf(megatron_weights.shards(self), self.config, self.stage))

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        """Load HF-named weights (the whole model's; each stage takes its part). While
        offloaded (a rollout cell following publications) they are checked and this
        stage's part is kept on the host, to be copied in at `onload`."""
        hf = dict(named)
        if self._host is not None:
            nbytes = megatron_weights.check(self, hf)
            self._pending = {k: v.to("cpu", copy=True) for k, v in hf.items() if holds(k, self.config, self.stage)}
        else:
            nbytes = megatron_weights.load_into(self, self.gpt, hf)
            if self.on_gpu:  # the distributed optimizer's fp32 main copy follows the new weights
                self.optimizer.reload_model_params()
        self.version = version
        return nbytes

    # --- role changes and checkpoints (megatron_state.py) -------------------------------

    def offload(self) -> int:
        """Copy parameters, gradients and optimizer state to host memory and free their
        storages (a role change to rollout); returns bytes freed. No-op when disabled."""
        return megatron_state.offload(self)

    def onload(self) -> None:
        """Undo `offload` (a role change to training): same storages, same bytes; then the
        weights published while offloaded, if any."""
        megatron_state.onload(self)

    def save_checkpoint(self, path: str) -> None:
        """This rank's file of the checkpoint at `path` (megatron_state.ckpt_path), written atomically."""
        megatron_state.save_checkpoint(self, path)

    def load_checkpoint(self, path: str) -> None:
        """Restore from this rank's file, once every rank of the cell has checked its own."""
        megatron_state.load_checkpoint(self, path)
