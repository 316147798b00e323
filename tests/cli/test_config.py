"""The run config: TOML/YAML/JSON files, --set overrides by field type, errors that name the
field, and `gyre config show` with each value's source."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gyre.cli.main import app
from gyre.coordinator.runconfig import ConfigError, build_config, load_config_file, parse_sets


def show(*args) -> dict[str, dict]:
    r = CliRunner().invoke(app, ["config", "show", "--json", *args])
    assert r.exit_code == 0, r.output
    return {row["field"]: row for row in json.loads(r.output)}


@pytest.mark.parametrize("name, text", [
    ("run.toml", 'steps = 7\npolicy = "elastic"\nharness = ["python", "agent.py"]\n[harnesses.x]\ncommand = ["a"]\n'),
    ("run.yaml", 'steps: 7\npolicy: elastic\nharness: [python, agent.py]\nharnesses:\n  x:\n    command: [a]\n'),
    ("run.json", '{"steps": 7, "policy": "elastic", "harness": ["python", "agent.py"], '
                 '"harnesses": {"x": {"command": ["a"]}}}'),
])
def test_three_formats_one_config(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    values = load_config_file(path)
    cfg = build_config(values, {"run_dir": tmp_path, "model_dir": tmp_path})
    assert cfg.steps == 7 and cfg.policy == "elastic" and cfg.harness == ("python", "agent.py")
    assert cfg.harnesses == {"x": {"command": ["a"]}}


def test_set_parses_by_field_type():
    got = parse_sets(["lr=0.01", "steps=3", "j_max=none", "harness=claude-code", 'harness=["sh", "-c", "x"]',
                      "tasks-path=tasks.jsonl", 'harnesses={"a": {"command": ["b"]}}'])
    assert got["lr"] == 0.01 and got["steps"] == 3 and got["j_max"] is None
    assert got["harness"] == ["sh", "-c", "x"]  # the later --set wins; a JSON list is a command
    assert got["tasks_path"] == Path("tasks.jsonl") and got["harnesses"] == {"a": {"command": ["b"]}}
    assert parse_sets(["harness=demo"])["harness"] == "demo"


@pytest.mark.parametrize("sets, message", [
    (["lr=fast"], "--set lr=fast: not a float"),
    (["steps"], "expected FIELD=VALUE"),
    (["warp=9"], "unknown field 'warp': `gyre config show` lists the fields"),
    (["stpes=3"], "unknown field 'stpes': did you mean 'steps'?"),
    (["j_max=lots"], "not a int or none"),
])
def test_bad_sets_name_the_field(sets, message):
    with pytest.raises(ConfigError) as e:
        parse_sets(sets)
    assert message in str(e.value)


@pytest.mark.parametrize("values, message", [
    ({"steps": "five"}, "field steps: expected int, got 'five'"),
    ({"lr": True}, "field lr: expected float or none, got True"),
    ({"policy": "warp"}, "policy must be one of elastic, colocate, async, async-streaming, got 'warp'"),
    ({"harness": "nope"}, "unknown harness 'nope'"),
    ({"min_valid": 99}, r"min_valid must be in \[1, group_size=8\]"),
    ({"trainer_options": {"weight_decay": "none"}}, "trainer_options: TrainerSpec.weight_decay must be float"),
    ({"engine_options": {"max_running": 1.5}}, "engine_options: EngineSpec.max_running must be int"),
])
def test_bad_values_name_the_field_and_the_allowed(tmp_path, values, message):
    with pytest.raises(ConfigError, match=message):
        build_config(values, {"run_dir": tmp_path, "model_dir": tmp_path})


def test_unknown_file_fields_and_bad_files(tmp_path):
    bad = tmp_path / "a.toml"
    bad.write_text("stepz = 3\n")
    with pytest.raises(ConfigError) as e:
        load_config_file(bad)
    assert str(e.value) == f"{bad}: unknown field 'stepz': did you mean 'steps'?"  # one line, not all 77 fields
    broken = tmp_path / "b.yaml"
    broken.write_text("steps: [1,\n")
    with pytest.raises(ConfigError, match="b.yaml"):
        load_config_file(broken)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config_file(tmp_path / "none.toml")


def test_config_show_resolves_with_sources(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('steps = 9\nlr = 0.5\npolicy = "async"\n')
    rows = show(str(cfg), "--set", "lr=0.25", "--policy", "elastic", "--set", "policy=colocate")
    assert rows["steps"]["value"] == 9 and rows["steps"]["source"] == "file"
    assert rows["lr"]["value"] == 0.25 and rows["lr"]["source"] == "flag"  # --set over the file
    assert rows["policy"]["value"] == "elastic"  # a named flag over --set
    assert rows["cells"] == {"field": "cells", "value": 2, "source": "default", "type": "int"}
    assert rows["harness"]["value"] == "demo" and rows["run_dir"]["source"] == "default"
    text = CliRunner().invoke(app, ["config", "show", str(cfg)]).output
    assert "steps" in text and "= 9  # file, int" in text
    r = CliRunner().invoke(app, ["config", "show", "--set", "policy=warp"])
    assert r.exit_code == 1 and "[error] policy must be one of elastic, colocate, async" in r.output


def test_set_none_clears_a_file_value(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('reducer_init = "tcp://10.0.0.1:29500"\n')
    rows = show(str(cfg), "--set", "reducer_init=none")
    assert rows["reducer_init"]["value"] is None and rows["reducer_init"]["source"] == "flag"


def test_per_model_defaults_and_the_context_clamp(tmp_path, tiny_dir, caplog):
    """Unset lr and output limits come from the model directory's gyre.json (the tiny
    model's); a real model without one gets lr 1e-6 and limits up to the remaining context;
    max_context defaults to the model's max_position_embeddings and is clamped to it."""
    import shutil

    from gyre.coordinator.config import CoordinatorConfig
    from gyre.coordinator.runconfig import with_model_defaults
    from gyre.coordinator.serve import serve_fields, serve_settings

    c = with_model_defaults(CoordinatorConfig(run_dir=tmp_path, model_dir=tiny_dir))
    assert (c.lr, c.default_max_tokens, c.max_tokens_cap, c.max_context) == (3e-3, 16, 64, 32768)
    real = tmp_path / "real"
    shutil.copytree(tiny_dir, real)
    (real / "gyre.json").unlink()
    cfg = json.loads((real / "config.json").read_text())
    (real / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 4096}))
    with caplog.at_level("WARNING"):
        c = with_model_defaults(CoordinatorConfig(run_dir=tmp_path, model_dir=real, max_context=100_000,
                                                  default_max_tokens=100))
    assert (c.lr, c.default_max_tokens, c.max_tokens_cap, c.max_context) == (1e-6, 100, None, 4096)
    assert "clamped to 4096" in caplog.text
    assert with_model_defaults(c) is c  # idempotent
    s = serve_settings(model_dir=real, fields=serve_fields(sets=["max_tokens_cap=300"], max_context=9999))
    assert (s.max_context, s.default_max_tokens, s.max_tokens_cap) == (4096, None, 300)
    with pytest.raises(ConfigError, match="gyre serve takes no field 'lr': it takes only default_max_tokens, "):
        serve_fields(sets=["lr=1"])
    with pytest.raises(ConfigError, match=re.escape("gyre serve takes no field 'allow_rollout_top_p': did you mean "
                                                    "'rollout_top_p'?")):
        serve_fields(sets=["allow_rollout_top_p=true"])
    # A typo is named against serve's own fields, not the run config's (stpes -> steps, which
    # serve would then refuse).
    with pytest.raises(ConfigError, match=re.escape("unknown field 'max_contxt': did you mean 'max_context'?")):
        serve_fields(sets=["max-contxt=5"])
    with pytest.raises(ConfigError, match=re.escape("unknown field 'stpes': gyre serve takes only default_max_tokens")):
        serve_fields(sets=["stpes=3"])
    # Serving budgets nothing unless asked (its one execution may be a whole benchmark client).
    assert (s.max_calls_in_flight_per_execution, s.max_tokens_per_minute_per_execution) == (0, 0)
    s = serve_settings(model_dir=real, fields=serve_fields(sets=["max_calls_in_flight_per_execution=2",
                                                                 "budget_wait_s=5"]))
    assert (s.max_calls_in_flight_per_execution, s.budget_wait_s) == (2, 5)
    with pytest.raises(ConfigError, match="max_calls_in_flight_per_execution must be an int >= 0, got -1"):
        serve_fields(sets=["max_calls_in_flight_per_execution=-1"])


@pytest.mark.parametrize("field, value, says", [
    ("default_max_tokens", 0, "default_max_tokens must be an int >= 1, got 0"),
    ("max_context", 1, "max_context must be an int >= 2, got 1"),
    ("rollout_top_p", 2.0, "rollout_top_p must be in (0, 1], got 2.0"),
    ("max_tokens_per_minute_per_execution", -5, "max_tokens_per_minute_per_execution must be an int >= 0"),
    ("budget_wait_s", -1, "budget_wait_s must be a number >= 0"),
])
def test_a_serving_field_has_one_rule_in_a_run_config_and_in_serve(tmp_path, field, value, says):
    """The run config and `gyre serve`/`tasks run`/`eval` refuse a serving value with the
    same words: both are the proxy's one ProxyConfig (proxy/serving.py), which validates
    itself; the run config's proxy settings are its serving()."""
    from gyre.coordinator.config import CoordinatorConfig
    from gyre.coordinator.serve import serve_fields
    from gyre.proxy.serving import ProxyConfig

    with pytest.raises(ValueError, match=re.escape(says)):
        CoordinatorConfig(run_dir=tmp_path, model_dir=tmp_path, **{field: value})
    with pytest.raises(ConfigError, match=re.escape(says)):
        serve_fields(sets=[f"{field}={json.dumps(value)}"])
    c = CoordinatorConfig(run_dir=tmp_path, model_dir=tmp_path, proxy_port=8123, rollout_temperature=0.5,
                          max_calls_in_flight_per_execution=2)
    assert (c.serving().port, c.serving().temperature, c.serving().max_calls_in_flight_per_execution) == (8123, 0.5, 2)
    assert ProxyConfig.from_fields(c.serving().as_fields()) == c.serving()
    with pytest.raises(ValueError, match=re.escape("max_tokens_cap must be an int >= 1, got True")):
        ProxyConfig(max_tokens_cap=True)  # a bool is no count, though Python's bool is an int


async def test_the_proxy_cuts_output_to_the_cap_and_the_context(chat_tokenizer):
    from gyre.proxy.server import ProxyConfig, ProxyServer
    from gyre.proxy.types import ChatRequest, Message

    def limit(config, asked, budget):
        server = ProxyServer(chat_tokenizer, backend=None, config=config)
        return server._max_tokens(ChatRequest(api="openai", model="m", messages=[Message("user", "x")],
                                              max_tokens=asked), budget)

    assert limit(ProxyConfig(), None, 5000) == 5000  # no default: the remaining context
    assert limit(ProxyConfig(default_max_tokens=16), None, 5000) == 16
    assert limit(ProxyConfig(max_tokens_cap=64), 32000, 5000) == 64  # Claude Code's 32,000, cut
    assert limit(ProxyConfig(), 32000, 700) == 700  # never past the context


def test_the_workers_are_welcomed_with_the_runs_settings_and_the_wires_defaults(tmp_path, tiny_dir):
    """The run's engine and trainer settings become the Welcome's typed specs (engine_options and
    trainer_options over them: gyre's names as fields, the rest the backend's own options);
    each setting's default is the wire spec's, lr's the one a real model's run resolves to."""
    from gyre.coordinator.config import CoordinatorConfig
    from gyre.coordinator.runconfig import REAL_MODEL_LR, with_model_defaults
    from gyre.workerd.wire import EngineSpec, TrainerSpec

    c = CoordinatorConfig(run_dir=tmp_path, model_dir=tiny_dir)
    assert c.engine_spec() == EngineSpec() and c.trainer_spec() == TrainerSpec()  # the same defaults
    assert TrainerSpec().lr == REAL_MODEL_LR
    c = with_model_defaults(CoordinatorConfig(
        run_dir=tmp_path, model_dir=tiny_dir, seed=3, micro_step_tokens=512,
        engine_options={"max_running": 4, "server": {"tp_size": 2}}, trainer_options={"weight_decay": 0, "tp": 2}))
    assert c.engine_spec() == EngineSpec(seed=3, max_running=4, options={"server": {"tp_size": 2}})
    assert c.trainer_spec() == TrainerSpec(lr=3e-3, micro_step_tokens=512, weight_decay=0.0, options={"tp": 2})


def test_config_show_explain_says_what_every_field_means(tmp_path, monkeypatch):
    """`gyre config show --explain` prints each field's meaning (the same words as
    docs/reference/config.md, both from config.py's comments) above its value."""
    from gyre.coordinator.configdoc import field_meanings
    from gyre.coordinator.runconfig import field_names

    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    out = runner.invoke(app, ["config", "show", "--explain", "--json"])
    assert out.exit_code == 0, out.output
    rows = json.loads(out.output)
    assert [r["field"] for r in rows] == list(field_names())
    meanings = field_meanings()
    assert all(r["meaning"] and r["meaning"] == meanings[r["field"]] for r in rows)
    text = runner.invoke(app, ["config", "show", "--explain"]).output
    assert "# optimizer steps to run" in text and "eval_attempts" in text
    assert "# optimizer steps" not in runner.invoke(app, ["config", "show"]).output
