"""The megatron-core trainer on CPU (the shim of DEPS-NOTES.md): HF <-> Megatron names,
TP shards and PP stages round-trip exactly; on the same micro-steps its log-probs, GSPO
loss, gradients and update equal the CPU torch trainer's; TP=2, PP=2 and TP=2 x PP=2 over
gloo in separate processes give the same log-probs, gradients and update; offload frees
every storage and onload restores the bytes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gyre.workerd.model import load_model
from gyre.workerd.modeldir import ModelDirError, init_tiny, load_config
from gyre.workerd.trainers.cpu import CpuTrainer
from gyre.workerd.trainers.hf_megatron import Stage, holds, to_hf, to_megatron
from tests.workerd.test_loss import assert_non_finite_gradients_are_dropped, make_rows, micro_batch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'gyre[test]')")

FAMILIES = {
    # Qwen2: QKV bias, GQA (4 heads, 2 groups), tied embeddings: the embedded default.
    "qwen2": dict(),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", tie_word_embeddings=False),
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", tie_word_embeddings=False,
                  num_key_value_heads=4),
}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    out = {}
    for name, over in FAMILIES.items():
        d = init_tiny(tmp_path_factory.mktemp(name), seed=5, overrides={**over, "num_hidden_layers": 2})
        model = load_model(d)
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():  # biases and norms away from their init, so misplacing one shows
            for pname, p in model.named_parameters():
                if pname.endswith(".bias") or pname.endswith("norm.weight"):
                    p.add_(0.3 * torch.randn(p.shape, generator=g))
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in model.hf_state_dict().items()}, str(d / "model.safetensors"))
        out[name] = d
    return out


def hf_weights(d) -> dict[str, torch.Tensor]:
    return load_model(d).hf_state_dict()


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("tp", [1, 2])
def test_names_and_values_round_trip_exactly(family_dirs, family, tp):
    d = family_dirs[family]
    config, hf = load_config(d), hf_weights(d)
    shards = [to_megatron(hf, config, rank=r, tp=tp) for r in range(tp)]
    back = to_hf(shards, config)
    assert set(back) == set(hf)
    assert all(torch.equal(back[k], hf[k]) for k in hf)
    again = [to_megatron(back, config, rank=r, tp=tp) for r in range(tp)]
    for a, b in zip(shards, again):
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    if tp == 2:  # every rank holds half of each split tensor, and the halves differ
        qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
        heads = config.num_attention_heads + 2 * config.num_key_value_heads
        assert shards[0][qkv].shape[0] * 2 == heads * config.head_dim
        assert not torch.equal(shards[0][qkv], shards[1][qkv])


def test_fused_qkv_is_grouped_per_kv_head(family_dirs):
    """Megatron's layout: for each KV group, its query heads, then its key, then its value."""
    config, hf = load_config(family_dirs["qwen2"]), hf_weights(family_dirs["qwen2"])
    fused = to_megatron(hf, config)["decoder.layers.0.self_attention.linear_qkv.weight"]
    d, per = config.head_dim, config.num_attention_heads // config.num_key_value_heads
    q, k, v = (hf[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    group1 = fused[(per + 2) * d: 2 * (per + 2) * d]
    assert torch.equal(group1[: per * d], q[per * d: 2 * per * d])
    assert torch.equal(group1[per * d: (per + 1) * d], k[d: 2 * d])
    assert torch.equal(group1[(per + 1) * d:], v[d: 2 * d])


@pytest.mark.parametrize("family", ["qwen2", "llama"])  # tied and untied embeddings
@pytest.mark.parametrize("tp", [1, 2])
def test_pipeline_stages_cover_the_model_once(family_dirs, family, tp):
    """Each stage's shards hold its own layers numbered from 0 (the embedding on the first,
    the norm and output layer on the last, a tied embedding's copy there too); the stages'
    HF tensors put back together are the model, exactly, each name from one stage."""
    d = family_dirs[family]
    config, hf = load_config(d), hf_weights(d)
    stages = [Stage(first=True, last=False, offset=0, layers=1), Stage(first=False, last=True, offset=1, layers=1)]
    back: dict[str, torch.Tensor] = {}
    for stage in stages:
        shards = [to_megatron(hf, config, rank=r, tp=tp, stage=stage) for r in range(tp)]
        layers = {k.split(".")[2] for k in shards[0] if k.startswith("decoder.layers.")}
        assert layers == {"0"}
        assert ("embedding.word_embeddings.weight" in shards[0]) == stage.first
        assert ("decoder.final_layernorm.weight" in shards[0]) == stage.last
        mine = to_hf(shards, config, stage)
        assert not set(mine) & set(back)
        assert set(mine) == {k for k in hf if holds(k, config, stage)} - (
            {"model.embed_tokens.weight"} if not stage.first else set())
        back.update(mine)
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)
    last = to_megatron(hf, config, tp=1, stage=stages[1])
    source = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    assert torch.equal(last["output_layer.weight"], hf[source])
    with pytest.raises(ModelDirError, match="the model has 2 layers"):
        to_megatron({**hf, "model.layers.2.mlp.down_proj.weight": torch.zeros(1)}, config, stage=stages[1])


def test_unknown_or_incomplete_weights_are_named(family_dirs):
    config, hf = load_config(family_dirs["qwen2"]), hf_weights(family_dirs["qwen2"])
    with pytest.raises(ModelDirError, match="model.layers.0.self_attn.rotary.weight"):
        to_megatron({**hf, "model.layers.0.self_attn.rotary.weight": torch.zeros(1)}, config)
    partial = {k: v for k, v in hf.items() if k != "model.layers.1.self_attn.k_proj.weight"}
    with pytest.raises(ModelDirError, match="layer 1 weight: q, k and v"):
        to_megatron(partial, config)
    with pytest.raises(ModelDirError, match="num_key_value_heads=2 is not divisible by tensor-parallel size 4"):
        to_megatron(hf, config, tp=4)


# --- the trainer, in this process (TP=1) ------------------------------------------------


@pytest.fixture(scope="module")
def megatron_module():
    from gyre.workerd.trainers import megatron

    megatron.setup_parallel(1)
    return megatron


@pytest.mark.parametrize("family", list(FAMILIES))
def test_built_model_has_the_mapped_names_and_shapes(megatron_module, family_dirs, family):
    config = load_config(family_dirs[family])
    model = megatron_module.build_gpt(config)
    own = {k: tuple(v.shape) for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    mapped = {k: tuple(v.shape) for k, v in to_megatron(hf_weights(family_dirs[family]), config).items()}
    assert own == mapped


def _trainers(megatron_module, d, lr=1e-3):
    meg = megatron_module.MegatronTrainer(str(d), load_config(d), lr=lr)
    cpu = CpuTrainer(load_model(d), lr=lr)
    return meg, cpu


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logprobs_loss_grads_and_update_equal_the_cpu_trainer(megatron_module, family_dirs, family):
    meg, cpu = _trainers(megatron_module, family_dirs[family])
    ids, mask, behaviour, exec_of_row, adv = make_rows(11)
    assert torch.allclose(meg.current_logprobs(ids), cpu.current_logprobs(ids), atol=2e-5)
    counts = {i: int(mask[[r for r in range(5) if exec_of_row[r] == i]].sum()) for i in adv}
    for rows in ([0, 1, 2], [3, 4]):  # execution 0 split over two micro-steps
        batch = micro_batch(rows, ids, mask, behaviour, exec_of_row, adv, counts)
        a, b = meg.train_micro_step(batch), cpu.train_micro_step(batch)
        assert (a.tokens, a.executions) == (b.tokens, b.executions)
        assert a.loss == pytest.approx(b.loss, rel=1e-4, abs=1e-6)
    grads = to_hf([meg.grads()], meg.config)
    cpu_grads = {k: p.grad for k, p in cpu.model.named_parameters()}
    assert set(grads) == set(cpu_grads)
    scale = max(float(g.abs().max()) for g in cpu_grads.values())
    assert scale > 0
    for k, g in cpu_grads.items():
        assert torch.allclose(grads[k], g, atol=1e-4 * scale), k
    na, nb = meg.optimizer_step(3), cpu.optimizer_step(3)
    assert na == pytest.approx(nb, rel=1e-4)
    assert meg.version == cpu.version == 1
    after, ref = meg.export_weights(), cpu.export_weights()
    moved = 0
    for k, w in ref.items():
        # Adam's first step moves every element by about lr; elements whose gradient is
        # noise-level may go either way, so the bound is a few lr, and most must agree.
        assert torch.allclose(after[k], w, atol=3e-3), k
        moved += int((after[k] - w).abs().le(1e-5).sum())
    assert moved > 0.99 * sum(w.numel() for w in ref.values())


def test_load_weights_then_export_is_exact_and_checkpoint_round_trips(megatron_module, family_dirs, tmp_path):
    d = family_dirs["qwen3"]
    meg = megatron_module.MegatronTrainer(str(d), load_config(d), lr=1e-3)
    other = {k: v + 0.25 for k, v in hf_weights(d).items()}
    nbytes = meg.load_weights(other.items(), version=7)
    assert nbytes == sum(v.numel() * v.element_size() for v in other.values())
    out = meg.export_weights()
    assert meg.version == 7 and all(torch.equal(out[k], other[k]) for k in other)
    meg.save_checkpoint(str(tmp_path / "ckpt" / "trainer.pt"))
    fresh = megatron_module.MegatronTrainer(str(d), load_config(d), lr=1e-3)
    fresh.load_checkpoint(str(tmp_path / "ckpt" / "trainer.pt"))
    assert fresh.version == 7
    assert all(torch.equal(fresh.export_weights()[k], other[k]) for k in other)
    bad = {**other, "model.norm.weight": torch.zeros(3)}
    with pytest.raises(ModelDirError, match="decoder.final_layernorm.weight' has shape"):
        meg.load_weights(bad.items(), version=8)
    with pytest.raises(ModelDirError, match="weights missing for megatron parameters"):
        meg.load_weights([("model.norm.weight", torch.zeros(3))], version=8)
    assert meg.version == 7 and all(torch.equal(meg.export_weights()[k], other[k]) for k in other)  # untouched


def test_offload_frees_every_storage_and_onload_restores_it(megatron_module, family_dirs, tmp_path):
    d = family_dirs["qwen2"]
    meg = megatron_module.MegatronTrainer(str(d), load_config(d), lr=1e-3, offload=True)
    ids, mask, behaviour, exec_of_row, adv = make_rows(3)
    counts = {i: 1 for i in adv}
    meg.train_micro_step(micro_batch([0, 1, 2, 3, 4], ids, mask, behaviour, exec_of_row, adv, counts))
    meg.optimizer_step(3)  # optimizer state exists now
    before = meg.export_weights()
    meg_logprobs_before = meg.current_logprobs(ids)
    opt_bytes = sum(v.numel() * v.element_size() for s in meg.optimizer.state.values()
                    for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    params = sum(p.numel() * p.element_size() for p in meg.gpt.parameters())
    freed = meg.offload()
    assert freed == params + opt_bytes
    assert all(p.untyped_storage().nbytes() == 0 for p in meg.gpt.parameters())
    with pytest.raises(RuntimeError, match="offloaded"):
        meg.train_micro_step(micro_batch([0, 1], ids, mask, behaviour, exec_of_row, adv, counts))
    host = meg._host
    assert all(torch.equal(meg.export_weights()[k], before[k]) for k in before)  # parameters back for the export
    assert torch.equal(meg.current_logprobs(ids), meg_logprobs_before)
    assert meg._host is host  # only the parameters came back (optimizer state stayed on the host)
    assert all(p.untyped_storage().nbytes() == 0 for p in meg.gpt.parameters())  # and left again
    meg.onload()
    after = meg.export_weights()
    assert all(torch.equal(after[k], before[k]) for k in before)
    # A publication reaching a rollout cell's offloaded trainer is kept on the host and
    # copied in at onload; a bad one is refused at once.
    meg.offload()
    published = {k: v * 0.5 for k, v in before.items()}
    with pytest.raises(ModelDirError, match="has shape"):
        meg.load_weights({**published, "model.norm.weight": torch.zeros(2)}.items(), version=5)
    meg.load_weights(published.items(), version=5)
    assert all(p.untyped_storage().nbytes() == 0 for p in meg.gpt.parameters())
    meg.onload()
    assert meg.version == 5 and all(torch.equal(meg.export_weights()[k], published[k]) for k in before)
    # Training goes on with the restored optimizer state.
    meg.train_micro_step(micro_batch([0, 1], ids, mask, behaviour, exec_of_row, adv, counts))
    assert meg.optimizer_step(2) > 0 and meg.version == 6
    # A checkpoint loaded into an offloaded trainer (a resume on a rollout cell): its
    # optimizer state must offload again (storages read from a file cannot be resized).
    saved = meg.export_weights()
    meg.save_checkpoint(str(tmp_path / "trainer.pt"))
    meg.offload()
    meg.load_checkpoint(str(tmp_path / "trainer.pt"))
    assert all(p.untyped_storage().nbytes() == 0 for p in meg.gpt.parameters())
    meg.onload()
    assert meg.offload() == freed and meg.version == 6
    meg.onload()
    assert all(torch.equal(meg.export_weights()[k], saved[k]) for k in saved)


# --- TP=2: two processes over gloo --------------------------------------------------------

CHILD = Path(__file__).with_name("_megatron_tp_child.py")
CHILD_ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[2]),
                                                         os.environ.get("PYTHONPATH", "")]))


def whole_batch(seed: int, path: Path):
    """All five rows of make_rows(seed) as one micro-step, also saved for a child process."""
    ids, mask, behaviour, exec_of_row, adv = make_rows(seed)
    counts = {i: int(mask[[r for r in range(5) if exec_of_row[r] == i]].sum()) for i in adv}
    batch = micro_batch([0, 1, 2, 3, 4], ids, mask, behaviour, exec_of_row, adv, counts)
    torch.save(batch.tensors(), path)
    return batch


@pytest.mark.parametrize("tp,pp,family", [(1, 2, "llama"), (2, 2, "qwen2")])  # TP alone: the cell test below
def test_model_parallel_cells_equal_the_cpu_trainer(family_dirs, tmp_path, tp, pp, family):
    """PP (a GPipe schedule over four chunks of the rows; a tied embedding's copy on the last
    stage) alone and with TP: one process per rank over gloo, each rank's gradients put back
    into HF names, against the CPU trainer on the same micro-step. Under PP a stage failing
    alone first (the loss on the last, the forward on the first) makes every stage raise,
    and the step after it is exact: nothing was left waiting or half-accumulated."""
    d = family_dirs[family]
    batch = whole_batch(21, tmp_path / "batch.pt")
    init = f"file://{tmp_path / 'store'}"
    world = tp * pp
    procs = [subprocess.Popen([sys.executable, str(CHILD), str(r), str(tp), str(pp), init, str(d),
                               str(tmp_path / "batch.pt"), str(tmp_path / f"out{r}.pt")], env=CHILD_ENV)
             for r in range(world)]
    try:
        assert [p.wait(timeout=240) for p in procs] == [0] * world
    finally:
        for p in procs:
            p.kill()
    outs = [torch.load(tmp_path / f"out{r}.pt", weights_only=True) for r in range(world)]
    for r, o in enumerate(outs):
        if pp == 1:
            assert o["failures"] == []
            continue
        last = r >= tp * (pp - 1)
        where = "pipeline stage {}" + (", TP rank 0" if tp > 1 else "")
        assert o["failures"][0] == ("ArithmeticError: injected loss failure" if last else
                                    f"RuntimeError: micro-step failed on {where.format(1)}: ArithmeticError: injected "
                                    "loss failure (this step's gradients were dropped on every rank)")
        assert o["failures"][1] == (f"RuntimeError: log-probs failed on {where.format(0)}: ArithmeticError: injected "
                                    "loss failure" if r >= tp else "ArithmeticError: injected loss failure")
    cpu = CpuTrainer(load_model(d), lr=1e-3)
    ref_lp = cpu.current_logprobs(batch.input_ids)
    stats = cpu.train_micro_step(batch)
    for o in outs:  # every rank answers with the whole vocabulary's log-probs and the loss
        assert torch.allclose(o["logprobs"], ref_lp, atol=2e-5)
        assert o["loss"] == pytest.approx(stats.loss, rel=1e-4) and o["tokens"] == stats.tokens
        assert o["params"] == sum(p.numel() for p in cpu.model.parameters())
    grads: dict[str, torch.Tensor] = {}
    for o in outs:  # each stage's own, numbered in the whole model; TP ranks of a stage agree
        for k, g in o["grads"].items():
            assert k not in grads or torch.equal(grads[k], g)
            grads[k] = g
    copies = [o["copy_grad"] for o in outs if o["copy_grad"] is not None]
    assert len(copies) == (tp if pp > 1 and cpu.model.config.tie_word_embeddings else 0)
    if copies:  # the output layer's use of a tied embedding, on the last stage until the step sums them
        grads["model.embed_tokens.weight"] = grads["model.embed_tokens.weight"] + copies[0]
    scale = max(float(p.grad.abs().max()) for p in cpu.model.parameters())
    assert set(grads) == {k for k, _ in cpu.model.named_parameters()}
    for k, p in cpu.model.named_parameters():
        assert torch.allclose(grads[k], p.grad, atol=1e-4 * scale), k
    norm = cpu.optimizer_step(3)
    assert all(o["norm"] == pytest.approx(norm, rel=1e-4) for o in outs)
    ref = cpu.export_weights()
    for o in outs:  # the last stage's copy of a tied embedding made the embedding's very update
        if o["copy_after"] is not None:
            assert torch.equal(o["copy_after"], outs[0]["weights"]["model.embed_tokens.weight"])
    for r, o in enumerate(outs):
        if r >= tp:  # later stages' ranks sent theirs to the first stage
            assert o["weights"] == {}
            continue
        assert set(o["weights"]) == set(ref)
        for k, w in ref.items():
            assert torch.allclose(o["weights"][k], w, atol=3e-3), k
            assert torch.equal(o["weights"][k], outs[0]["weights"][k]), k


def run_cell(script: str, d, seed: int, tmp_path):
    """A cell script (its results to a file) on make_rows(seed)'s micro-step; its first
    log-probs, loss and grad norm checked against the CPU trainer's on the same step.
    Returns (results, the batch, that CPU trainer, stepped once)."""
    batch = whole_batch(seed, tmp_path / "batch.pt")
    r = subprocess.run([sys.executable, str(Path(__file__).with_name(script)), str(d),
                        str(tmp_path / "batch.pt"), str(tmp_path / "out.pt")], env=CHILD_ENV, capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    cpu = CpuTrainer(load_model(d), lr=1e-3)
    assert torch.allclose(out["logprobs"], cpu.current_logprobs(batch.input_ids), atol=2e-5)
    assert out["loss"] == pytest.approx(cpu.train_micro_step(batch).loss, rel=1e-4)
    assert out["norm"] == pytest.approx(cpu.optimizer_step(3), rel=1e-4)
    return out, batch, cpu


def test_a_tensor_parallel_cell_in_one_workerd_equals_the_cpu_trainer(family_dirs, tmp_path):
    """TP=2 as workerd runs it: rank 0 in the process, rank 1 a child that mirrors every call."""
    out, batch, cpu = run_cell("_megatron_tp_cell.py", family_dirs["llama"], 5, tmp_path)
    assert out["version"] == 1 and out["freed"] > 0
    for k, w in cpu.export_weights().items():
        assert torch.allclose(out["weights"][k], w, atol=3e-3), k
    assert out["error"].startswith("ModelDirError: weights missing") and out["after"].shape == batch.input_ids.shape
    assert out["rank_error"].startswith("cell rank 1 failed save_checkpoint")
    assert out["stats2_tokens"] == batch.target_mask.sum()  # the next call's own answer
    assert torch.equal(out["again"], out["logprobs"])  # a second cell built in the same process


def test_a_pipeline_parallel_cell_in_one_workerd_through_role_changes(family_dirs, tmp_path):
    """PP=2 as workerd runs it (tied embeddings, three GPipe chunks): log-probs, a step equal
    to the CPU trainer's; a publication to the offloaded cell kept per stage and exported
    whole; a set one stage refuses is refused by the cell; a checkpoint per stage restores."""
    out, batch, cpu = run_cell("_megatron_pp_cell.py", family_dirs["qwen2"], 9, tmp_path)
    ref = cpu.export_weights()
    assert set(out["trained"]) == set(ref) and out["params"] == sum(p.numel() for p in cpu.model.parameters())
    for k, w in ref.items():
        assert torch.allclose(out["trained"][k], w, atol=3e-3), k
    # Every rank's parameters and Adam moments (fp32), the tied embedding's copy on the last stage too.
    whole = out["params"] + ref["model.embed_tokens.weight"].numel()
    assert out["freed"] == 3 * 4 * whole
    published = out["published"]
    for key in ("while_offloaded", "onloaded", "restored"):
        assert set(out[key]) == set(published), key
        assert all(torch.equal(out[key][k], published[k]) for k in published), key
    assert out["error"].startswith("weights missing for megatron parameters: decoder.layers.0.mlp"), out["error"]
    assert out["malformed"].startswith("weight 'model.layers.1.self_attn.k_proj.weight' has shape"), out["malformed"]
    assert out["mixed"].startswith("checkpoint ") and "different versions [4, 6]" in out["mixed"], out["mixed"]
    assert all(torch.equal(out["untouched"][k], out["trained"][k]) for k in published)  # no rank loaded it
    # Training goes on from the published weights (the loss is the CPU trainer's on them).
    cpu.load_weights(published.items(), version=4)
    assert out["loss2"] == pytest.approx(cpu.train_micro_step(batch).loss, rel=1e-4)
    assert out["version"] == 5 and out["norm2"] > 0
    assert out["files"] == ["out.pt.ckpt", "out.pt.ckpt.pp1.tp0"]  # rank 0's is the path itself


def test_non_finite_gradients_update_nothing(megatron_module, family_dirs):
    d = family_dirs["qwen2"]
    assert_non_finite_gradients_are_dropped(megatron_module.MegatronTrainer(str(d), load_config(d), lr=1e-3))


def test_what_breaks_a_cell_is_its_own_group_failing():
    """gloo reports a timed-out or broken send/recv/collective as a plain RuntimeError (the
    messages below are gloo's): those break a cell; a failed cross-cell reduction (another
    cell's trouble) and ordinary errors do not."""
    from gyre.workerd.reducer import ReducerError
    from gyre.workerd.trainers.tp import comm_failure

    assert comm_failure(RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] "
                                     "Timed out waiting 3000ms for recv operation to complete"))
    assert comm_failure(RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error "
                                     "[127.0.0.1]:41234: Application timeout caused pair closure"))
    assert comm_failure(torch.distributed.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp"))
    assert not comm_failure(ReducerError("cross-cell gradient reduction over 2 cells failed: Timed out waiting"))
    assert not comm_failure(RuntimeError("micro-step failed on pipeline stage 1: OutOfMemoryError: ..."))
    assert not comm_failure(ModelDirError("weights missing for megatron parameters: x"))


def agent_tree_batch():
    """A TreeBatch of one execution: three calls branching off one 40-token prompt, one of
    them continued by a tool result and a fourth call (a deeper branch)."""
    import random

    from gyre.proxy.admission import admit
    from gyre.proxy.tree import Tree
    from tests.workerd.treebuild import tree_batch

    rng = random.Random(3)
    tree = Tree(vocab_size=272)
    root = tree.add_text(-1, "system", [rng.randrange(256) for _ in range(40)], "c")
    leaves = {}
    for b in range(3):
        out = tree.add_output(root.id, f"o{b}", [rng.randrange(256) for _ in range(8)],
                              [-rng.random() for _ in range(8)], [0] * 8)
        leaves[out.id] = "main"
    sub = tree.add_text(out.id, "tool", [rng.randrange(256) for _ in range(6)], "t")
    deeper = tree.add_output(sub.id, "o3", [rng.randrange(256) for _ in range(8)], [-0.7] * 8, [0] * 8)
    leaves[deeper.id] = "main"
    del leaves[out.id]
    return tree_batch(tree, admit(tree, leaves, j_max=None), advantage=0.75, exec_index=0)


def test_a_tree_micro_step_trains_as_the_cpu_trainers_tree_form(megatron_module, family_dirs):
    """The tree form (packing = "tree") on the megatron trainer (trainers/megatron_tree.py:
    the rotary table indexed by each token's position id, an ancestor mask): the same loss and
    gradients as the CPU trainer computing the tree itself."""
    batch = agent_tree_batch()
    meg, cpu = _trainers(megatron_module, family_dirs["qwen2"])
    a, b = meg.train_micro_step(batch), cpu.train_micro_step(batch)
    assert (a.tokens, a.executions) == (b.tokens, b.executions) == (32, 1)
    assert a.loss == pytest.approx(b.loss, rel=1e-4, abs=1e-6)
    grads = to_hf([meg.grads()], meg.config)
    scale = max(float(p.grad.abs().max()) for p in cpu.model.parameters())
    for k, p in cpu.model.named_parameters():
        assert torch.allclose(grads[k], p.grad, atol=1e-4 * scale), k


def test_a_tensor_parallel_cell_trains_a_tree_micro_step(family_dirs, tmp_path):
    """TP=2 (rank 1 a child process) on the same tree micro-step: loss, gradient norm and the
    update equal the CPU trainer's tree form."""
    d = family_dirs["llama"]
    batch = agent_tree_batch()
    torch.save(batch.to_tensors(), tmp_path / "tree.pt")
    r = subprocess.run([sys.executable, str(Path(__file__).with_name("_megatron_tp_tree.py")), str(d),
                        str(tmp_path / "tree.pt"), str(tmp_path / "out.pt")], env=CHILD_ENV, capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    cpu = CpuTrainer(load_model(d), lr=1e-3)
    stats = cpu.train_micro_step(batch)
    assert (out["tokens"], out["loss"]) == (stats.tokens, pytest.approx(stats.loss, rel=1e-4, abs=1e-6))
    assert out["norm"] == pytest.approx(cpu.optimizer_step(1), rel=1e-4)
    for k, w in cpu.export_weights().items():
        assert torch.allclose(out["weights"][k], w, atol=3e-3), k
