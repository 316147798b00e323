"""`gyre export`: a run's checkpoint as a Hugging Face directory that transformers loads, with
the trainer's logits. Real checkpoints: a CpuTrainer trained two steps, and megatron cells
(TP=2; TP=2 x PP=2) trained one step over gloo in separate processes, each saved where
`gyre up` saves them; then the one-line errors through typer's CliRunner."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import typer
from typer.testing import CliRunner

from gyre.cli.export import export
from gyre.coordinator.resume import step_dir, write_state
from tests.workerd.test_loss import make_rows, micro_batch

runner = CliRunner()
app = typer.Typer()
app.command("export")(export)  # what cli/main.py registers


@app.callback()
def _root() -> None:
    """A group, so that `export` is a subcommand as in `gyre`."""


def make_run(root: Path, model_dir: Path) -> Path:
    run = root / "run"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"model_dir": str(model_dir), "steps": 2}))
    return run


def checkpoint(run: Path, step: int, version: int) -> str:
    """Where the coordinator asks the core to save (resume.Checkpoints.save)."""
    step_dir(run, step).mkdir(parents=True, exist_ok=True)
    return str(step_dir(run, step) / "trainer.pt")


def train_step(trainer, seed: int) -> None:
    ids, mask, behaviour, exec_of_row, adv = make_rows(seed)
    counts = {i: int(mask[[r for r in range(5) if exec_of_row[r] == i]].sum()) for i in adv}
    trainer.train_micro_step(micro_batch([0, 1, 2, 3, 4], ids, mask, behaviour, exec_of_row, adv, counts))
    trainer.optimizer_step(3)


def invoke(*args: str):
    return runner.invoke(app, ["export", *map(str, args)])


def hf_logits(model_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return model(ids).logits


def hf_logprobs(model_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    """log p(ids[t] | ids[<t]) for t >= 1, as the trainers compute them, from transformers' logits."""
    logp = torch.log_softmax(hf_logits(model_dir, ids), dim=-1)[:, :-1]
    return logp.gather(-1, ids[:, 1:, None])[..., 0]


def chat_ids(model_dir: Path) -> torch.Tensor:
    """Token ids through the exported tokenizer and chat template (transformers' own)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "Write hello to hello.txt."}], tokenize=False,
                                   add_generation_prompt=True)
    return torch.tensor([tok(text)["input_ids"]])


# --- the CPU trainer ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cpu_run(tiny_dir, tmp_path_factory):
    """A run whose model directory is the tiny model with SmolLM2's README, and checkpoints
    of steps 1 (a small update) and 2 (a large one) of a CpuTrainer; returns (run, model
    dir, the trainer's models by step)."""
    from gyre.workerd.model import load_model
    from gyre.workerd.smollm2 import README, WHEEL
    from gyre.workerd.trainers.cpu import CpuTrainer

    root = tmp_path_factory.mktemp("cpu-export")
    model_dir = Path(shutil.copytree(tiny_dir, root / "model"))
    (model_dir / "README.md").write_text(README.format(wheel=WHEEL, dtype="float32"))
    run = make_run(root, model_dir)
    trainer, models = CpuTrainer(load_model(model_dir), lr=1e-2), {}
    for step, lr in ((1, 1e-5), (2, 1e-2)):  # step 1's updates mostly below bfloat16's resolution
        trainer.optimizer.param_groups[0]["lr"] = lr
        train_step(trainer, seed=step)
        trainer.save_checkpoint(checkpoint(run, step, trainer.version))
        write_state(run, step, {"step": step, "version": trainer.version})
        models[step] = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    return run, model_dir, models


def test_a_cpu_checkpoint_exports_to_what_transformers_loads_with_the_trainers_logits(cpu_run, tmp_path):
    from safetensors import safe_open

    from gyre.workerd.model import CausalLM
    from gyre.workerd.modeldir import check_model_dir, load_config

    run, model_dir, models = cpu_run
    out = tmp_path / "hf"
    r = invoke(run, out)
    assert r.exit_code == 0, r.output
    assert r.output.strip() == f"{out}: step 2 (version 2) of {run}, cpu trainer, float32"
    # The step-2 trainer's own forward (model.py) against transformers on the exported directory.
    ids = chat_ids(out)
    assert ids.shape[1] > 10
    trained = CausalLM(load_config(model_dir))
    trained.load_state_dict(models[2])
    with torch.no_grad():
        ours = trained(ids)
    theirs = hf_logits(out, ids)
    assert torch.allclose(theirs, ours, atol=1e-5, rtol=0), float((theirs - ours).abs().max())
    assert (hf_logits(model_dir, ids) - theirs).abs().max() > 1e-2  # training moved them
    # Tied embeddings stay tied: no lm_head in the file, one matrix in transformers.
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert {f.get_tensor(n).dtype for n in names} == {torch.float32}
    assert "lm_head.weight" not in names and names == set(models[2])
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(out)
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    # The model directory's files come along; gyre itself takes the export as a model.
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "gyre.json"):
        assert (out / name).read_bytes() == (model_dir / name).read_bytes(), name
    assert json.loads((out / "config.json").read_text()) == json.loads((model_dir / "config.json").read_text())
    check_model_dir(out)
    readme = (out / "README.md").read_text()
    assert f"`{run}`" in readme and "step 2, weight version 2" in readme and "gyre export" in readme
    assert "dequantised by\n> transformers" in readme and "not** the original bfloat16 release" in readme
    assert not list(tmp_path.glob("hf.tmp-*"))  # written aside, then renamed


def test_step_picks_an_older_checkpoint_and_dtype_converts(cpu_run, tmp_path):
    from safetensors.torch import load_file

    run, model_dir, models = cpu_run
    (tmp_path / "empty").mkdir()  # an empty OUT is taken
    r = invoke(run, "--step", 1, tmp_path / "empty", "--dtype", "bfloat16")
    assert r.exit_code == 0, r.output
    # The updates bfloat16 cannot hold are counted against the base model's weights and said.
    from gyre.workerd.weightfiles import iter_weights

    base = dict(iter_weights(model_dir))
    n = sum(t.numel() for t in models[1].values())
    moved = sum(int((t != base[k]).sum()) for k, t in models[1].items()) / n
    kept = sum(int((t.bfloat16() != base[k].bfloat16()).sum()) for k, t in models[1].items()) / n
    assert 0 < kept < moved
    note = (f"the trainer held float32: {100 * moved:.2f}% of the elements differ from the base model's there, "
            f"{100 * kept:.2f}% in bfloat16; --dtype float32 keeps every update")
    assert r.output.splitlines() == [f"{tmp_path / 'empty'}: step 1 (version 1) of {run}, cpu trainer, bfloat16",
                                     f"note: {note}"]
    assert f"`model.safetensors`, bfloat16 ({note})." in (tmp_path / "empty" / "README.md").read_text()
    saved = load_file(str(tmp_path / "empty" / "model.safetensors"))
    assert all(torch.equal(saved[k], models[1][k].to(torch.bfloat16)) for k in models[1])
    assert not torch.equal(saved["model.norm.weight"], models[2]["model.norm.weight"].to(torch.bfloat16))
    assert json.loads((tmp_path / "empty" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert "step 1, weight version 1" in (tmp_path / "empty" / "README.md").read_text()


# --- megatron-core, TP=2 and TP=2 x PP=2, on CPU over gloo ---------------------------------


def megatron_rank(rank: str, tp: str, pp: str, init: str, model_dir: str, run: str, out: str) -> None:
    """One rank of a megatron cell (a child process): one step trained, the checkpoint saved
    as the core saves it, and the trainer's own log-probs and exported weights kept."""
    import torch.distributed as dist

    from gyre.workerd.modeldir import load_config
    from gyre.workerd.trainers.megatron import MegatronTrainer

    rank, tp, pp = int(rank), int(tp), int(pp)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=tp * pp)
    trainer = MegatronTrainer(model_dir, load_config(model_dir), lr=1e-2, tp=tp, pp=pp)
    train_step(trainer, seed=3)
    trainer.save_checkpoint(checkpoint(Path(run), 1, trainer.version))
    ids = torch.tensor([list(range(40, 72)), list(range(100, 132))])
    logprobs, weights = trainer.current_logprobs(ids), trainer.export_weights()
    if rank == 0:
        torch.save({"ids": ids, "logprobs": logprobs, "weights": weights, "version": trainer.version}, out)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    """The tiny Qwen2 model (tied embeddings, QKV bias, GQA) with 2 layers: PP=2 puts one on each stage."""
    from gyre.workerd.modeldir import init_tiny

    return init_tiny(tmp_path_factory.mktemp("small"), seed=3, overrides={"num_hidden_layers": 2})


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp,pp", [(2, 1), (2, 2)])
def test_a_megatron_checkpoint_gathers_every_rank_into_the_trainers_model(small_dir, tmp_path, tp, pp):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'gyre[test]')")
    run = make_run(tmp_path, small_dir)
    child = "import sys; from tests.cli.test_export import megatron_rank; megatron_rank(*sys.argv[1:])"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[2]),
                                                      os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, "-W", "ignore", "-c", child, str(r), str(tp), str(pp),
                               f"file://{tmp_path / 'store'}", str(small_dir), str(run), str(tmp_path / "ref.pt")],
                              env=env) for r in range(tp * pp)]
    try:
        assert [p.wait(timeout=240) for p in procs] == [0] * (tp * pp)
    finally:
        for p in procs:
            p.kill()
    ref = torch.load(tmp_path / "ref.pt", weights_only=True)
    write_state(run, 1, {"step": 1, "version": ref["version"]})
    files = sorted(f.name for f in step_dir(run, 1).glob("trainer.pt*"))
    assert len(files) == tp * pp  # one per rank
    r = invoke(run, tmp_path / "hf")
    assert r.exit_code == 0, r.output
    assert f"megatron TP={tp} PP={pp} trainer" in r.output
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert set(saved) == set(ref["weights"]) - {"lm_head.weight"}
    assert all(torch.equal(saved[k], ref["weights"][k]) for k in saved)  # the files = the cell's own gather
    # The exported model's log-probs of the ids equal the megatron trainer's own forward.
    ids, theirs = ref["ids"], ref["logprobs"][:, 1:]  # position 0 has no context: 0
    logp = hf_logprobs(tmp_path / "hf", ids)
    assert torch.allclose(logp, theirs, atol=1e-5, rtol=0), float((logp - theirs).abs().max())
    assert (hf_logprobs(small_dir, ids) - logp).abs().max() > 1e-2  # the step changed them
    # A rank's file missing: refused, naming it, and nothing written.
    lost = step_dir(run, 1) / files[-1]
    lost.rename(tmp_path / "lost")
    r = invoke(run, tmp_path / "hf2")
    assert r.exit_code == 1 and not (tmp_path / "hf2").exists()
    assert r.output.strip() == (f"[error] megatron checkpoint {step_dir(run, 1)} is incomplete: {files[-1]} missing "
                                f"(a TP={tp} x PP={pp} cell writes {tp * pp} files, one per rank)")


# --- one-line errors ------------------------------------------------------------------------


def test_errors_are_one_line_and_write_nothing(cpu_run, tiny_dir, tmp_path):
    run, _, _ = cpu_run
    fresh = make_run(tmp_path / "fresh", tiny_dir)
    cases = [
        ((fresh, tmp_path / "a"), f"[error] run {fresh} has no checkpoint yet: a run saves one every "
         "checkpoint_every steps and at its end (runs from before gyre did so, and runs that trained no step, "
         f"have none); `gyre up --resume {fresh} --steps N` trains on and saves one"),
        ((run, "--step", 3, tmp_path / "a"), f"[error] run {run} has no checkpoint of step 3 (available: 1, 2)"),
        ((tmp_path, tmp_path / "a"), f"[error] {tmp_path} has no config.json: not a gyre run directory"),
        ((run, tmp_path / "a", "--dtype", "int8"), "[error] --dtype must be one of float32, bfloat16, float16, "
         "got 'int8'"),
    ]
    serve = tmp_path / "serve"
    serve.mkdir()
    (serve / "config.json").write_text(json.dumps({"command": "serve", "model": str(tiny_dir)}))
    cases.append(((serve, tmp_path / "a"), f"[error] {serve} is not a `gyre up` run directory (gyre serve trains "
                  "nothing): there is no checkpoint to export"))
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    cases.append(((run, full), f"[error] {full} exists and is not an empty directory: export into a new one "
                  "(nothing is overwritten)"))
    for args, expected in cases:
        r = invoke(*args)
        assert (r.exit_code, r.output.strip()) == (1, expected)
    assert not (tmp_path / "a").exists() and (full / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in full.iterdir()) == ["keep.txt"]


def test_a_run_whose_model_directory_is_gone_is_refused(cpu_run, tmp_path):
    run, _, _ = cpu_run
    moved = Path(shutil.copytree(run, tmp_path / "run"))
    (moved / "config.json").write_text(json.dumps({"model_dir": str(tmp_path / "gone")}))
    r = invoke(moved, tmp_path / "out")
    assert (r.exit_code, r.output.strip()) == (1, f"[error] the run's model directory {tmp_path / 'gone'} is gone "
                                               "(or has no config.json): the export takes its config and "
                                               "tokenizer from there")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
