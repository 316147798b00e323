"""Shared fixtures: the tiny model directory (written once per session)."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    from gyre.workerd.modeldir import init_tiny

    return init_tiny(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="session")
def chat_tokenizer(tiny_dir):
    from gyre.proxy.chat import ChatTokenizer

    return ChatTokenizer(tiny_dir)


@pytest.fixture
def tiny_model(tiny_dir):
    from gyre.workerd.model import load_model

    return load_model(tiny_dir)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("GYRE_TEST_GPU") == "1":
        return
    skip = pytest.mark.skip(reason="GPU test: set GYRE_TEST_GPU=1 on a GPU machine")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # the marker, not a folder named gpu
            item.add_marker(skip)
