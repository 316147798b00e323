"""trainers/megatron_model.py: megatron-core's parallel state and this rank's GPTModel.

`setup_parallel` initialises torch.distributed (a private one-rank world when the caller
made none) and Megatron's TP x PP parallel state; `build_gpt` builds the GPTModel for a
supported HF family with the local layer spec, as this rank's pipeline stage of it;
`stage_of` says which part of the whole model that is. The CPU shim of DEPS-NOTES.md lives
here, applied only when no GPU is present: `torch.cuda.current_device` answers "cpu", the
no-op inference RNG tracker, and (while a PP stage is built) `Tensor.cuda` staying on the
CPU. Not the trainer (megatron.py) and not the name mapping (hf_megatron.py).
"""

from __future__ import annotations

import contextlib
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from gyre.workerd.modeldir import ModelConfig
from gyre.workerd.trainers.hf_megatron import Stage


@contextlib.contextmanager
def quiet_import():
    # megatron-core warns on import that Transformer Engine and Apex are missing.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def setup_parallel(tp: int = 1, pp: int = 1, *, seed: int = 0) -> None:
    """torch.distributed (a private one-rank world when the caller made none) and
    megatron-core's parallel state; the CPU shim when there is no GPU. Idempotent."""
    with quiet_import():
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        torch.cuda.current_device = lambda: "cpu"  # megatron-core places buffers there
    if not dist.is_initialized():
        if tp * pp != 1:
            raise RuntimeError(f"tensor-parallel size {tp} x pipeline-parallel size {pp} needs "
                               "torch.distributed initialised by the caller (one process per rank)")
        store = Path(tempfile.mkdtemp(prefix="gyre-megatron-")) / "store"  # no listening socket
        dist.init_process_group("nccl" if on_gpu else "gloo", init_method=f"file://{store}",
                                rank=0, world_size=1)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    elif (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()) != (tp, pp):
        raise RuntimeError(f"megatron parallel state has TP={ps.get_tensor_model_parallel_world_size()}, "
                           f"PP={ps.get_pipeline_model_parallel_world_size()}, asked for TP={tp}, PP={pp}")
    if on_gpu:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def teardown_parallel() -> None:
    """Undo `setup_parallel` (and a caller's process group): the process can build another."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def build_gpt(config: ModelConfig, *, dtype: torch.dtype = torch.float32):
    """megatron-core GPTModel with the local layer spec for a supported HF family: this
    rank's pipeline stage of it."""
    with quiet_import():  # its import and its own defaults trip its warnings
        from megatron.core import parallel_state as ps
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.transformer_config import TransformerConfig

        tc = TransformerConfig(
            num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
            ffn_hidden_size=config.intermediate_size, num_attention_heads=config.num_attention_heads,
            num_query_groups=config.num_key_value_heads, kv_channels=config.head_dim,
            normalization="RMSNorm", layernorm_epsilon=config.rms_norm_eps, qk_layernorm=config.qk_norm,
            gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
            add_qkv_bias=config.attention_bias, hidden_dropout=0.0, attention_dropout=0.0,
            params_dtype=dtype, bf16=dtype == torch.bfloat16,
            tensor_model_parallel_size=tp_size(),
            pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
            pipeline_dtype=dtype if ps.get_pipeline_model_parallel_world_size() > 1 else None,
            use_cpu_initialization=not torch.cuda.is_available(), perform_initialization=False,
            bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
            apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        )
        with _tensor_cuda_stays_on_cpu():
            model = GPTModel(tc, get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=config.qk_norm),
                             vocab_size=config.vocab_size, max_sequence_length=config.max_position_embeddings,
                             position_embedding_type="rope", rotary_base=int(config.rope_theta),
                             share_embeddings_and_output_weights=config.tie_word_embeddings,
                             pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
        return model


@contextlib.contextmanager
def _tensor_cuda_stays_on_cpu():
    """Part of the CPU shim, for building a PP stage: Megatron moves a tied embedding's
    copy to CUDA before summing it across the first and last stages."""
    if torch.cuda.is_available():
        yield
        return
    cuda = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = cuda


def stage_of(model) -> Stage:
    """Which part of the whole model this rank's GPTModel is."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return Stage()
    return Stage(first=model.pre_process, last=model.post_process,
                 offset=get_transformer_layer_offset(model.config), layers=len(model.decoder.layers))


def tp_size() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_world_size()


def pp_group():
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_group()


def tp_rank() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank()
