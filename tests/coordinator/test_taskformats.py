"""Task sources other than gyre's JSONL, read for real from files: Harbor task folders (the
repo's examples/tasks and folders written to tmp_path) and SWE-bench-style JSONL rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gyre.coordinator.taskformats import describe, load_harbor_task, load_task_source
from gyre.coordinator.tasks import Environment, Task, TaskError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "tasks"
EXAMPLE_IDS = ["find-the-error", "fix-off-by-one", "make-test-pass", "sort-csv"]

TOML = """\
version = "1.0"

[metadata]
difficulty = "easy"

[verifier]
timeout_sec = 90.0

[agent]
timeout_sec = 120.0

[environment]
cpus = 2
memory = "4G"
"""


def harbor_task(folder: Path, *, toml: str = TOML, instruction: str = "Fix the bug.\n\n", dockerfile: bool = True,
                test_sh: bool = True, solve_sh: bool = True) -> Path:
    """A Harbor task folder with the given parts."""
    folder.mkdir(parents=True)
    (folder / "instruction.md").write_text(instruction)
    (folder / "task.toml").write_text(toml)
    if dockerfile:
        (folder / "environment").mkdir()
        (folder / "environment" / "Dockerfile").write_text("FROM debian:bookworm\n")
    if test_sh:
        (folder / "tests").mkdir()
        (folder / "tests" / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    if solve_sh:
        (folder / "solution").mkdir()
        (folder / "solution" / "solve.sh").write_text("true\n")
    return folder


def write_jsonl(path: Path, *rows: dict | str) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def swe_row(**over) -> dict:
    row = {"instance_id": "astropy__astropy-12907", "problem_statement": "Nested models break separability.",
           "image": "swebench/sweb.eval.x86_64.astropy_1776_astropy-12907:latest", "test_cmd": "pytest -rA",
           "FAIL_TO_PASS": json.dumps(["astropy/modeling/tests/test_separable.py::test_nested"]),
           "PASS_TO_PASS": ["astropy/modeling/tests/test_separable.py::test_simple"],
           "repo": "astropy/astropy", "base_commit": "d16bfe05a744909de4b27f5875fe0d4ed41ce607", "version": "4.3"}
    row.update(over)
    return {k: v for k, v in row.items() if v is not ...}  # `...`: leave the field out


# ---------------------------------------------------------------------------------------------
# Harbor


def test_examples_parse_with_their_fields():
    tasks = load_task_source(EXAMPLES)
    assert [t.id for t in tasks] == EXAMPLE_IDS
    for task in tasks:
        folder = EXAMPLES / task.id
        assert task.prompt == (folder / "instruction.md").read_text().rstrip()
        assert task.timeout_s == 120.0
        assert task.environment == Environment(build_dir=str(folder / "environment"), build_timeout_s=300.0,
                                               cpus=1.0, memory_mb=512, storage_mb=1024)
        assert (Path(task.environment.build_dir) / "Dockerfile").is_file()
        assert Path(task.tests_dir, "test.sh").is_file() and task.tests_dir == str(folder / "tests")
        assert task.solution_dir == str(folder / "solution")
        assert task.verifier == {"type": "harbor", "timeout_s": 60.0, "env": {}}
        assert task.meta["format"] == "harbor" and task.meta["path"] == str(folder)
        assert task.meta["metadata"]["difficulty"] == "easy" and task.meta["unknown_keys"] == []
        assert "agent_user" not in task.meta


def test_single_task_folder_given_directly(tmp_path):
    [task] = load_task_source(harbor_task(tmp_path / "my-task"))
    assert task.id == "my-task" and task.prompt == "Fix the bug."
    assert task.environment.cpus == 2.0 and task.environment.memory_mb == 4096
    assert task.environment.allow_internet is False and task.environment.image is None
    assert task.verifier == {"type": "harbor", "timeout_s": 90.0, "env": {}}
    [example] = load_task_source(EXAMPLES / "sort-csv")
    assert example.id == "sort-csv"


def test_folder_of_tasks_skips_hidden_and_non_task_folders(tmp_path):
    harbor_task(tmp_path / "b")
    harbor_task(tmp_path / "a", solve_sh=False)
    harbor_task(tmp_path / ".hidden")
    (tmp_path / "notes").mkdir()
    (tmp_path / "README.md").write_text("hi")
    tasks = load_task_source(tmp_path)
    assert [t.id for t in tasks] == ["a", "b"]
    assert tasks[0].solution_dir is None and tasks[1].solution_dir == str((tmp_path / "b" / "solution").resolve())


def test_folder_without_tasks_says_what_a_task_holds(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(TaskError, match="no Harbor task folders") as e:
        load_task_source(tmp_path)
    assert str(tmp_path) in str(e.value) and "task.toml" in str(e.value) and "instruction.md" in str(e.value)


@pytest.mark.parametrize(("value", "mib"), [('"4G"', 4096), ('"512M"', 512), ('"2048M"', 2048), ('"1.5G"', 1536),
                                            ('"2Gi"', 2048), ("768", 768)])
def test_older_memory_spelling_in_mib(tmp_path, value, mib):
    toml = f"[environment]\nmemory = {value}\nstorage = {value}\n"
    [task] = load_task_source(harbor_task(tmp_path / "t", toml=toml))
    assert task.environment.memory_mb == mib and task.environment.storage_mb == mib


@pytest.mark.parametrize(("missing", "kwargs"), [("instruction.md", None), ("tests/test.sh", {"test_sh": False}),
                                                 ("environment/Dockerfile", {"dockerfile": False})])
def test_missing_required_file_names_folder_and_file(tmp_path, missing, kwargs):
    folder = harbor_task(tmp_path / "broken", **(kwargs or {}))
    if kwargs is None:
        (folder / missing).unlink()
    with pytest.raises(TaskError) as e:
        load_task_source(folder)
    assert str(e.value).startswith(f"{folder.resolve()}: missing {missing} (a Harbor task needs")


def test_docker_image_stands_in_for_the_dockerfile(tmp_path):
    toml = '[environment]\ndocker_image = "ghcr.io/x/y:1"\nallow_internet = true\n'
    [task] = load_task_source(harbor_task(tmp_path / "img", toml=toml, dockerfile=False))
    assert task.environment.image == "ghcr.io/x/y:1" and task.environment.build_dir is None
    assert task.environment.allow_internet is True
    # Both: the Dockerfile is built, and the image name is kept.
    [both] = load_task_source(harbor_task(tmp_path / "both", toml=toml))
    assert both.environment.image == "ghcr.io/x/y:1"
    assert both.environment.build_dir == str((tmp_path / "both" / "environment").resolve())


def test_empty_instruction_is_an_error(tmp_path):
    with pytest.raises(TaskError, match="instruction.md is empty"):
        load_task_source(harbor_task(tmp_path / "t", instruction="  \n\n"))


@pytest.mark.parametrize(("toml", "words"), [
    ('[environment]\ncpus = "two"\n', "field [environment].cpus: must be a positive number, got 'two'"),
    ("[environment]\ncpus = 0\n", "field [environment].cpus: must be a positive number"),
    ("[environment]\nmemory_mb = 1.5\n", "field [environment].memory_mb: must be a positive integer"),
    ('[environment]\nmemory = "lots"\n', "field [environment].memory: must be a size like"),
    ('[environment]\nmemory = "4G"\nmemory_mb = 4096\n', "given both memory_mb and memory"),
    ('[environment]\nallow_internet = "yes"\n', "field [environment].allow_internet: must be true or false"),
    ("[agent]\ntimeout_sec = true\n", "field [agent].timeout_sec: must be a positive number"),
    ("[verifier]\nenv = { A = 1 }\n", "field [verifier].env: values must be strings"),
    ('agent = "fast"\n', "field [agent]: must be a table"),
])
def test_bad_toml_values_name_file_and_field(tmp_path, toml, words):
    folder = harbor_task(tmp_path / "t", toml=toml)
    with pytest.raises(TaskError) as e:
        load_task_source(folder)
    assert str(e.value).startswith(f"{folder.resolve() / 'task.toml'}: ") and words in str(e.value)


def test_toml_syntax_error_names_task_toml(tmp_path):
    folder = harbor_task(tmp_path / "t", toml="[agent\ntimeout_sec = 1\n")
    with pytest.raises(TaskError, match=r"task\.toml: not valid TOML: .*line 1"):
        load_task_source(folder)


def test_harbors_own_keys_are_listed_as_ignored_and_known_extras_kept(tmp_path):
    """Keys Harbor's format defines and gyre does not read are kept out of the way (listed for
    `gyre tasks check`), not refused."""
    toml = TOML + ('gpus = 1\nnetwork_mode = "no-network"\n\n[environment.healthcheck]\ncommand = "true"\n\n'
                   '[verifier.env]\nTOKEN = "t"\n\n[solution]\nenv = { MODE = "ref" }\n\n'
                   '[task]\nname = "org/t"\n')
    toml = toml.replace("[agent]\n", '[agent]\nuser = "agent"\nallowed_hosts = []\n').replace(
        'version = "1.0"', 'version = "1.0"\nsource = "tb"')
    [task] = load_task_source(harbor_task(tmp_path / "t", toml=toml))
    assert task.meta["unknown_keys"] == ["agent.allowed_hosts", "environment.healthcheck", "environment.network_mode"]
    assert task.meta["agent_user"] == "agent" and task.meta["gpus"] == 1
    assert task.meta["solution_env"] == {"MODE": "ref"} and task.verifier["env"] == {"TOKEN": "t"}
    assert describe(task)["unknown_keys"] == task.meta["unknown_keys"]


@pytest.mark.parametrize("edit, says", [
    (("[agent]\ntimeout_sec", "[agent]\ntimout_sec"), "unknown key [agent].timout_sec: did you mean 'timeout_sec'?"),
    (("cpus = 2", "cpu = 2"), "unknown key [environment].cpu: did you mean 'cpus'?"),
    (("[verifier]\n", "[verifier]\nfancy = true\n"),
     "unknown key [verifier].fancy: known: allowed_hosts, collect, env, "),
    (("[agent]\n", "[agent.extra]\nx = 1\n\n[agent]\n"), "unknown key [agent].extra: known: "),
    (("[environment]", "[enviroment]"), "unknown key [enviroment]: did you mean 'environment'?"),
    (('version = "1.0"', 'versoin = "1.0"'), "unknown key versoin: did you mean 'version'?"),
    (("[agent]", "[sandbox]\nkind = 'vm'\n\n[agent]"), "unknown key [sandbox]: known: "),
])
def test_a_key_neither_gyre_nor_harbor_knows_is_refused_naming_the_closest(tmp_path, edit, says):
    """A misspelt key used to be a note and the default ran silently; now it is one line with the
    file, the key and the closest known key."""
    folder = harbor_task(tmp_path / "t", toml=TOML.replace(*edit))
    with pytest.raises(TaskError) as e:
        load_task_source(folder)
    message = str(e.value)
    assert message.startswith(f"{folder.resolve() / 'task.toml'}: {says}") and "\n" not in message


def test_load_harbor_task_accepts_a_relative_folder(tmp_path, monkeypatch):
    harbor_task(tmp_path / "rel")
    monkeypatch.chdir(tmp_path)
    task = load_harbor_task("rel")
    assert task.tests_dir == str((tmp_path / "rel" / "tests").resolve())


# ---------------------------------------------------------------------------------------------
# SWE-bench-style JSONL


def test_swe_rows_with_test_ids_as_json_string_and_as_list(tmp_path):
    path = write_jsonl(tmp_path / "swe.jsonl", swe_row(), "",
                       swe_row(instance_id="b-2", FAIL_TO_PASS=["t::a", "t::b"], PASS_TO_PASS=..., test_patch="diff",
                               workdir="/testbed", timeout_s=300, test_timeout_s=60, cpus=4, memory_mb=8192,
                               allow_internet=True))
    a, b = load_task_source(path)
    assert a.id == "astropy__astropy-12907" and a.prompt == "Nested models break separability."
    assert a.environment == Environment(image="swebench/sweb.eval.x86_64.astropy_1776_astropy-12907:latest")
    assert a.verifier == {"type": "swe", "test_cmd": "pytest -rA",
                          "fail_to_pass": ["astropy/modeling/tests/test_separable.py::test_nested"],
                          "pass_to_pass": ["astropy/modeling/tests/test_separable.py::test_simple"],
                          "test_patch": None, "timeout_s": 1800.0}
    assert a.meta == {"format": "swe", "repo": "astropy/astropy",
                      "base_commit": "d16bfe05a744909de4b27f5875fe0d4ed41ce607", "version": "4.3"}
    assert a.tests_dir is None and a.solution_dir is None and a.timeout_s is None
    assert b.verifier["fail_to_pass"] == ["t::a", "t::b"] and b.verifier["pass_to_pass"] == []
    assert b.verifier["test_patch"] == "diff" and b.verifier["timeout_s"] == 60.0 and b.timeout_s == 300.0
    assert b.environment.workdir == "/testbed" and b.environment.cpus == 4.0
    assert b.environment.memory_mb == 8192 and b.environment.allow_internet is True


def test_swe_dockerfile_resolves_relative_to_the_jsonl(tmp_path):
    (tmp_path / "sets" / "docker" / "repo1").mkdir(parents=True)
    (tmp_path / "sets" / "docker" / "repo1" / "Dockerfile.eval").write_text("FROM python:3.11\n")
    path = write_jsonl(tmp_path / "sets" / "swe.jsonl", swe_row(image=..., dockerfile="docker/repo1/Dockerfile.eval"))
    [task] = load_task_source(path)
    assert task.environment.build_dir == str((tmp_path / "sets" / "docker" / "repo1").resolve())
    assert task.environment.dockerfile == "Dockerfile.eval" and task.environment.image is None
    with pytest.raises(TaskError, match=r"swe\.jsonl:1: field 'dockerfile': .* is not a file"):
        load_task_source(write_jsonl(tmp_path / "sets" / "swe.jsonl", swe_row(image=..., dockerfile="nope")))


@pytest.mark.parametrize(("row", "words"), [
    (swe_row(test_cmd=...), ":2: field 'test_cmd': missing"),
    (swe_row(test_cmd="  "), ":2: field 'test_cmd': must be a non-empty string"),
    (swe_row(dockerfile="Dockerfile"), ":2: field 'image': give image or dockerfile, not both"),
    (swe_row(image=...), ":2: field 'image': missing (give image or dockerfile)"),
    (swe_row(FAIL_TO_PASS="[]"), ":2: field 'FAIL_TO_PASS': must name at least one test"),
    (swe_row(FAIL_TO_PASS="not json"), ":2: field 'FAIL_TO_PASS': must be a list of test ids"),
    (swe_row(PASS_TO_PASS=[1]), ":2: field 'PASS_TO_PASS': must be a list of non-empty test id strings"),
    (swe_row(problem_statement=...), ":2: field 'problem_statement': missing"),
    (swe_row(workdir="testbed"), ":2: field 'workdir': must be an absolute path"),
    (swe_row(test_timeout_s=-1), ":2: field 'test_timeout_s': must be a positive number"),
    ("{not json", ":2: not valid JSON"),
    ("[1, 2]", ":2: a task must be a JSON object"),
])
def test_swe_errors_name_line_and_field(tmp_path, row, words):
    path = write_jsonl(tmp_path / "swe.jsonl", swe_row(instance_id="first"), row)
    with pytest.raises(TaskError) as e:
        load_task_source(path)
    assert str(e.value).startswith(f"{path}{words}")


def test_swe_duplicate_instance_id_names_the_first_line(tmp_path):
    path = write_jsonl(tmp_path / "swe.jsonl", swe_row(), "", swe_row(instance_id="other"), swe_row())
    with pytest.raises(TaskError, match=r"swe\.jsonl:4: field 'instance_id': duplicate id .*\(first on line 1\)"):
        load_task_source(path)


# ---------------------------------------------------------------------------------------------
# Dispatch and listing


def test_gyre_jsonl_still_loads_through_the_source(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", "", {"id": "a", "prompt": "Say hi", "target": "hi"},
                       {"id": "b", "prompt": "Say yo", "evaluator": {"type": "command", "argv": ["true"]}})
    a, b = load_task_source(path)
    assert a == Task(id="a", prompt="Say hi", target="hi") and b.evaluator["type"] == "command"
    assert describe(a)["format"] == "jsonl" and describe(a)["verifier"] == "similarity"
    assert describe(b)["verifier"] == "command"
    with pytest.raises(TaskError, match="no tasks"):
        load_task_source(write_jsonl(tmp_path / "empty.jsonl", ""))


def test_missing_path_is_named(tmp_path):
    with pytest.raises(TaskError, match="nowhere.jsonl: no such task file or folder"):
        load_task_source(tmp_path / "nowhere.jsonl")


def test_describe_harbor_and_swe(tmp_path):
    [harbor] = load_task_source(EXAMPLES / "fix-off-by-one")
    assert describe(harbor) == {"task": "fix-off-by-one", "format": "harbor", "image": None,
                                "build": str(EXAMPLES / "fix-off-by-one" / "environment"), "agent_timeout_s": 120.0,
                                "verifier": "harbor", "cpus": 1.0, "memory_mb": 512, "storage_mb": 1024,
                                "allow_internet": False, "solution": True, "unknown_keys": []}
    [swe] = load_task_source(write_jsonl(tmp_path / "swe.jsonl", swe_row(cpus=2)))
    row = describe(swe)
    assert row["format"] == "swe" and row["verifier"] == "swe" and row["image"].startswith("swebench/")
    assert row["cpus"] == 2.0 and row["solution"] is False and row["build"] is None


def test_harbor_schema_1_4_keys_are_read_ignored_or_refused(tmp_path):
    """Harbor's TaskConfig at schema 1.4: [environment].workdir is read (where the agent starts);
    artifacts, multi_step_reward_strategy, [environment].os and tpu, [verifier].environment_mode
    and collect are listed as ignored, each with why; [[steps]] (a multi-step task) is refused."""
    toml = 'artifacts = ["/app/out.txt"]\nmulti_step_reward_strategy = "mean"\n' + TOML.replace(
        "[environment]\n", '[environment]\nworkdir = "/app"\nos = "linux"\n').replace(
        "[verifier]\n", '[verifier]\nenvironment_mode = "separate"\n')
    [task] = load_task_source(harbor_task(tmp_path / "t", toml=toml))
    assert task.environment.workdir == "/app"
    assert task.meta["unknown_keys"] == ["artifacts", "environment.os", "multi_step_reward_strategy",
                                         "verifier.environment_mode"]
    from gyre.coordinator.taskformats import HARBOR_IGNORED

    assert all(why for section in HARBOR_IGNORED.values() for why in section.values())
    steps = harbor_task(tmp_path / "s", toml=TOML + '\n[[steps]]\nname = "one"\n')
    with pytest.raises(TaskError, match=r"task\.toml: \[\[steps\]\] \(a multi-step task\) is not supported"):
        load_task_source(steps)
