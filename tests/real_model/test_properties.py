"""The proxy's hypothesis properties (tests/proxy) on SmolLM2's tokenizer, and on its
vocabulary with Qwen2's pre-tokenizer split regex, where segment-wise tokenisation is not
canonical by accident: external text must tokenise as the whole text would."""

from __future__ import annotations

import json

import pytest

from tests.proxy import test_text_rules as rules
from tests.proxy import test_tree_properties as tree


@pytest.fixture(scope="module")
def qwen2_split_tok(smollm2_dir, tmp_path_factory):
    """SmolLM2's vocabulary and merges, pre-tokenised with Qwen2's split regex."""
    import shutil

    from gyre.proxy.chat import ChatTokenizer
    from tests.conftest import QWEN2_SPLIT

    d = tmp_path_factory.mktemp("smollm2-qwen2-split")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, d / name)
    spec = json.loads((d / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": QWEN2_SPLIT}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}
    (d / "tokenizer.json").write_text(json.dumps(spec))
    tok = ChatTokenizer(d)
    assert tok.encode("result\n\n") != tok.encode("result\n") + tok.encode("\n")  # the case it exists for
    return tok


@pytest.fixture(params=["smollm2", "smollm2-qwen2-split"])
def tok(request, smol_tok, qwen2_split_tok):
    return smol_tok if request.param == "smollm2" else qwen2_split_tok


PROPERTIES = [rules.test_external_text_tokenises_as_the_whole_text,
              rules.test_special_token_text_in_content_is_plain_text,
              rules.test_streamed_text_is_the_whole_decoding_with_work_per_new_token,
              rules.test_tool_calls_are_found_in_the_text,
              rules.test_a_stop_string_ends_the_output_on_a_token_the_record_keeps,
              rules.test_an_unclosed_or_malformed_tool_call_is_text, tree.test_recorded_tokens_round_trip]


@pytest.mark.parametrize("prop", PROPERTIES, ids=lambda f: f.__name__.removeprefix("test_"))
def test_proxy_properties_hold(tok, prop):
    prop(tok)
