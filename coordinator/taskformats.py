"""taskformats.py: reads task sources other than gyre's JSONL: Harbor task folders and SWE-bench rows.

`load_task_source` takes a path and decides: a directory is Harbor's format (the one
Terminal-Bench 2.0 uses: one task folder, or a folder of them), a JSONL file whose first row
has `instance_id` is SWE-bench-style, and any other file is gyre's own JSONL
(`tasks.load_tasks`). Every error names the file (and line) and the field. A task author is
not trusted: a link out of the task folder (instruction.md, tests/, solution/, environment/) is
refused before anything is read through it, and every number is held to sane bounds (a week
for timeouts; CPUS_RANGE, MEMORY_MB_RANGE, ...). `describe` turns a task into one row of a
listing. Not the sandbox (it builds and starts nothing) and not the verifier (it runs no
test.sh or test_cmd): it only reads files and checks them.
"""

from __future__ import annotations

import difflib
import json
import math
import re
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gyre.coordinator.tasks import (
    MAX_TIMEOUT_S,
    Environment,
    Task,
    TaskError,
    check_links,
    inside,
    load_jsonl,
    load_tasks,
)

HARBOR_NEEDS = ("a Harbor task needs instruction.md, task.toml, environment/Dockerfile or [environment].docker_image, "
                "tests/test.sh")
# task.toml's keys: the sections and keys gyre reads (HARBOR_SECTIONS), and the keys Harbor's format
# defines that gyre does not use (HARBOR_TOP_KEYS, HARBOR_IGNORED, each with why: the ignored ones
# are listed in meta["unknown_keys"] for `gyre tasks check`). Any other key is refused, the closest
# known one named: Harbor itself drops it, so a typo (`timout_sec`) would silently run with the
# default. Checked against Harbor's TaskConfig (src/harbor/models/task/config.py, schema_version
# 1.4: AlienKevin/sprint@49e3cd77, a fork carrying it; 1.1: LegoX/harbor@73fd120e).
HARBOR_TOP_KEYS = frozenset({"version", "schema_version", "source", "task"})  # identity, read by no one
HARBOR_SECTIONS: dict[str, frozenset[str] | None] = {  # None: any key (free-form)
    "metadata": None,
    "verifier": frozenset({"timeout_sec", "env", "environment"}),  # environment: gyre's (fresh | agent)
    "agent": frozenset({"timeout_sec", "user"}),
    "environment": frozenset({"docker_image", "build_timeout_sec", "cpus", "memory_mb", "memory",
                              "storage_mb", "storage", "allow_internet", "gpus", "workdir"}),
    "solution": frozenset({"env"}),
}
_NETWORK = "gyre's network is the proxy only, or the internet with allow_internet and sandbox_internet"
HARBOR_IGNORED: dict[str, dict[str, str]] = {
    "": {"artifacts": "gyre keeps each execution's own records and copies out the workspace",
         "multi_step_reward_strategy": "for [[steps]] tasks, which gyre refuses"},
    "verifier": {"user": "the verifier runs as the image's user",
                 "network_mode": _NETWORK, "allowed_hosts": _NETWORK,
                 "environment_mode": "gyre's [verifier].environment chooses: fresh (default) or agent",
                 "collect": "no compose services: the tests read the agent's workspace"},
    "agent": {"network_mode": _NETWORK, "allowed_hosts": _NETWORK},
    "environment": {"gpu_types": "a sandbox gets no accelerator type", "tpu": "a sandbox gets no TPU",
                    "os": "gyre runs Linux images", "network_mode": _NETWORK, "allowed_hosts": _NETWORK,
                    "mcp_servers": "a harness preset brings its own tools",
                    "env": "host variables are not passed into a task's sandbox",
                    "skills_dir": "a harness preset brings its own files",
                    "healthcheck": "the agent starts once the container runs"},
    "solution": {},
}
HARBOR_STEPS = ("[[steps]] (a multi-step task) is not supported: gyre runs one instruction and one verifier "
                "per task")
SWE_FIELDS = frozenset({"instance_id", "problem_statement", "image", "dockerfile", "test_cmd", "FAIL_TO_PASS",
                        "PASS_TO_PASS", "test_patch", "workdir", "timeout_s", "test_timeout_s", "cpus",
                        "memory_mb", "allow_internet"})
DEFAULT_BUILD_TIMEOUT_S = 600.0
DEFAULT_HARBOR_VERIFIER_TIMEOUT_S = 600.0
DEFAULT_SWE_TEST_TIMEOUT_S = 1800.0
FORMATS = ("harbor", "swe")
# What a Harbor task folder hands to the run: each is checked for links that leave the folder.
HARBOR_PARTS = ("instruction.md", "task.toml", "tests", "solution", "environment")
# Sane maxima (tasks.MAX_TIMEOUT_S for timeouts): a task past them is refused at load with the
# field named, not handed to the engine, which failed every execution as infra (cpus = 1e9).
# Minima are the engine's own: podman refuses fewer than 0.01 CPUs and less than 6 MiB.
CPUS_RANGE = (0.01, 512.0)
MEMORY_MB_RANGE = (6, 4 << 20)  # 6 MiB .. 4 TiB
STORAGE_MB_RANGE = (1, 16 << 20)  # 1 MiB .. 16 TiB
GPUS_RANGE = (1, 64)
# [verifier].environment: "fresh" (default) scores in a new container from the task's image holding
# the agent's copied-out workdir; "agent" in a copy of the agent's whole container, for tasks that
# check system state it changed outside its workdir (verifier.py says what that mode guarantees).
VERIFIER_ENVIRONMENTS = ("fresh", "agent")


# ---------------------------------------------------------------------------------------------
# Value checks: each returns the value to keep or raises _Bad with why; _Fields adds where.


class _Bad(Exception):
    """A value of the wrong kind; the message says what it must be."""


def _positive_number(value: Any) -> float:
    # bool is an int subclass: `true` is not a number of CPUs.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise _Bad(f"must be a positive number, got {value!r}")
    return float(value)


def _positive_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _Bad(f"must be a positive integer, got {value!r}")
    return value


def _within(check: Callable[[Any], Any], low: float, high: float, unit: str) -> Callable[[Any], Any]:
    """`check`, then the value held to [low, high]: the message says both bounds."""

    def bounded(value: Any) -> Any:
        got = check(value)
        if not low <= got <= high:
            raise _Bad(f"must be from {low:g} to {high:g}{unit}, got {value!r}")
        return got

    return bounded


def _timeout(value: Any) -> float:
    """Seconds: positive, finite and at most a week (1e308 overflowed a deadline)."""
    got = _positive_number(value)
    if got > MAX_TIMEOUT_S:
        raise _Bad(f"must be at most {MAX_TIMEOUT_S:g} s (a week), got {value!r}")
    return got


_cpus = _within(_positive_number, *CPUS_RANGE, " CPUs")
_gpus = _within(_positive_int, *GPUS_RANGE, " GPUs")


_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt])i?b?\s*", re.IGNORECASE)
_MIB_PER_UNIT = {"k": 1 / 1024, "m": 1, "g": 1024, "t": 1024 * 1024}


def _size_mb(value: Any) -> int:
    """MiB from an int (already MiB) or a string like "4G", "512M", "1.5G" (Harbor's older spelling)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return _positive_int(value)
    match = _SIZE.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        raise _Bad(f"must be a size like '4G' or '512M' (or an integer of MiB), got {value!r}")
    mib = float(match[1]) * _MIB_PER_UNIT[match[2].lower()]
    if not math.isfinite(mib) or mib <= 0:  # 400 digits of "G" is inf, which ceil cannot take
        raise _Bad(f"must be a positive size, got {value!r}")
    return math.ceil(mib)


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise _Bad(f"must be true or false, got {value!r}")
    return value


def _string(value: Any) -> str:
    if not isinstance(value, str):
        raise _Bad(f"must be a string, got {type(value).__name__}")
    return value


def _nonempty_string(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _Bad(f"must be a non-empty string, got {value!r}")
    return value


def _container_path(value: Any) -> str:
    if not isinstance(value, str) or not value.startswith("/") or "\x00" in value:
        raise _Bad(f"must be an absolute path in the container, got {value!r}")
    return value


def _table(value: Any) -> dict:
    if not isinstance(value, dict):
        raise _Bad(f"must be a table, got {type(value).__name__}")
    return value


def _string_table(value: Any) -> dict[str, str]:
    table = _table(value)
    if bad := sorted(k for k, v in table.items() if not isinstance(v, str)):
        raise _Bad(f"values must be strings; {bad[0]!r} is {type(table[bad[0]]).__name__}")
    return dict(table)


def _test_ids(value: Any) -> list[str]:
    """A list of test ids, or SWE-bench's spelling: a string holding that list as JSON."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise _Bad(f"must be a list of test ids or a JSON string of one, got {value!r}") from None
    if not isinstance(value, list) or not all(isinstance(t, str) and t for t in value):
        raise _Bad(f"must be a list of non-empty test id strings, got {value!r}")
    return value


def _nonempty_test_ids(value: Any) -> list[str]:
    ids = _test_ids(value)
    if not ids:
        raise _Bad("must name at least one test")
    return ids


class _Fields:
    """One table's values, checked on the way out; errors read `{where}: field {label}: {why}`.

    A value of None (JSON null) counts as missing, so a dataset's empty columns read as absent."""

    def __init__(self, table: dict, where: str, label: str):
        self.table, self.where, self.label = table, where, label  # label: "{!r}" or "[agent].{}"

    def error(self, name: str, why: str) -> TaskError:
        return TaskError(f"{self.where}: field {self.label.format(name)}: {why}")

    def has(self, name: str) -> bool:
        return self.table.get(name) is not None

    def get(self, name: str, check: Callable[[Any], Any], default: Any = None, *, required: bool = False) -> Any:
        value = self.table.get(name)
        if value is None:
            if required:
                raise self.error(name, "missing")
            return default
        try:
            return check(value)
        except _Bad as e:
            raise self.error(name, str(e)) from None


# ---------------------------------------------------------------------------------------------
# The entry point


def load_task_source(path: str | Path) -> list[Task]:
    """Every task at `path`: a Harbor task folder or folder of them, a SWE-bench-style JSONL
    file, or gyre's own JSONL. Blocking file IO: call at startup or via asyncio.to_thread."""
    path = Path(path)
    if path.is_dir():
        return load_harbor_dir(path)
    if not path.exists():
        raise TaskError(f"{path}: no such task file or folder")
    if _first_row_has(path, "instance_id"):
        return load_swe_tasks(path)
    return load_tasks(path)


def _first_row_has(path: Path, key: str) -> bool:
    """Whether the first non-empty line of `path` is a JSON object with `key`."""
    try:
        with path.open(encoding="utf-8") as f:
            line = next((line for line in f if line.strip()), "")
    except (OSError, UnicodeDecodeError) as e:
        raise TaskError(f"cannot read task file {path}: {e}") from None
    try:
        obj = json.loads(line)
    except ValueError:
        return False  # not ours to report: load_tasks names the line
    return isinstance(obj, dict) and key in obj


# ---------------------------------------------------------------------------------------------
# Harbor task folders


def load_harbor_dir(path: str | Path) -> list[Task]:
    """The task `path` is (it has task.toml), else one per immediate subfolder with task.toml,
    by name; hidden folders and folders without task.toml are skipped."""
    path = Path(path)
    if (path / "task.toml").is_file():
        return [load_harbor_task(path)]
    try:
        folders = sorted(p for p in path.iterdir()
                         if p.is_dir() and not p.name.startswith(".") and (p / "task.toml").is_file())
    except OSError as e:
        raise TaskError(f"cannot list task folder {path}: {e}") from None
    if not folders:
        raise TaskError(f"{path}: no Harbor task folders in it (a task folder holds task.toml, instruction.md, "
                        "environment/Dockerfile or [environment].docker_image, and tests/test.sh)")
    # The ids are the folder names of one directory, so they are unique already.
    return [load_harbor_task(folder) for folder in folders]


def load_harbor_task(folder: str | Path) -> Task:
    """One Harbor task folder: instruction.md is the prompt, task.toml the settings, environment/
    the image to build, tests/ the verifier (copied in after the agent stops), solution/ optional."""
    folder = Path(folder).resolve()
    check_links(folder, HARBOR_PARTS)  # before anything is read through one
    prompt = _read_text(_required(folder, "instruction.md")).rstrip()
    if not prompt:
        raise TaskError(f"{folder}: instruction.md is empty")
    toml = _read_toml(_required(folder, "task.toml"))
    where = str(folder / "task.toml")
    sections = _harbor_sections(toml, where)
    ignored = _ignored_keys(toml, where)  # and a key neither gyre nor Harbor knows refused
    environment = _harbor_environment(folder, _Fields(sections["environment"], where, "[environment].{}"))
    tests = _required(folder, "tests/test.sh").parent
    agent = _Fields(sections["agent"], where, "[agent].{}")
    return Task(id=folder.name, prompt=prompt, timeout_s=agent.get("timeout_sec", _timeout),
                environment=environment, tests_dir=str(tests),
                solution_dir=str(folder / "solution") if (folder / "solution" / "solve.sh").is_file() else None,
                verifier=_harbor_verifier(_Fields(sections["verifier"], where, "[verifier].{}")),
                meta=_harbor_meta(folder, sections, where, ignored))


def _required(folder: Path, rel: str) -> Path:
    path = folder / rel
    if not path.is_file():
        raise TaskError(f"{folder}: missing {rel} ({HARBOR_NEEDS})")
    return path


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TaskError(f"cannot read {path}: {e}") from None


def _read_toml(path: Path) -> dict:
    text = _read_text(path)
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise TaskError(f"{path}: not valid TOML: {e}") from None


def _harbor_sections(toml: dict, where: str) -> dict[str, dict]:
    """Each known section's table ({} when absent), or TaskError when one is not a table."""
    top = _Fields(toml, where, "[{}]")
    return {name: top.get(name, _table, {}) for name in HARBOR_SECTIONS}


def _harbor_environment(folder: Path, env: _Fields) -> Environment:
    image = env.get("docker_image", _nonempty_string)
    build_dir = folder / "environment"
    has_dockerfile = (build_dir / "Dockerfile").is_file()
    if image is None and not has_dockerfile:
        _required(folder, "environment/Dockerfile")
    # Both given: the Dockerfile is the task's own recipe, so it wins; the image name stays known.
    return Environment(image=image, build_dir=str(build_dir) if has_dockerfile else None,
                       workdir=env.get("workdir", _container_path),
                       build_timeout_s=env.get("build_timeout_sec", _timeout, DEFAULT_BUILD_TIMEOUT_S),
                       cpus=env.get("cpus", _cpus),
                       memory_mb=_harbor_size(env, "memory_mb", "memory", MEMORY_MB_RANGE),
                       storage_mb=_harbor_size(env, "storage_mb", "storage", STORAGE_MB_RANGE),
                       allow_internet=env.get("allow_internet", _bool, False))


def _harbor_size(env: _Fields, name: str, older: str, bounds: tuple[int, int]) -> int | None:
    """MiB from `name` (an integer) or its older spelling `older` ("4G"), within `bounds`;
    None when neither."""
    if env.has(name) and env.has(older):
        raise env.error(older, f"given both {name} and {older}; keep {name}")
    if env.has(name):
        return env.get(name, _within(_positive_int, *bounds, " MiB"))
    return env.get(older, _within(_size_mb, *bounds, " MiB"))


def _verifier_environment(value: Any) -> str:
    if value not in VERIFIER_ENVIRONMENTS:
        raise _Bad(f"must be one of {', '.join(map(repr, VERIFIER_ENVIRONMENTS))}, got {value!r}")
    return value


def _harbor_verifier(verifier: _Fields) -> dict:
    """The verifier's settings; "environment" only where it is not the default ("fresh")."""
    out = {"type": "harbor",
           "timeout_s": verifier.get("timeout_sec", _timeout, DEFAULT_HARBOR_VERIFIER_TIMEOUT_S),
           "env": verifier.get("env", _string_table, {})}
    if (where := verifier.get("environment", _verifier_environment, "fresh")) != "fresh":
        out["environment"] = where
    return out


def _harbor_meta(folder: Path, sections: dict[str, dict], where: str, ignored: list[str]) -> dict:
    agent = _Fields(sections["agent"], where, "[agent].{}")
    env = _Fields(sections["environment"], where, "[environment].{}")
    meta: dict[str, Any] = {"format": "harbor", "path": str(folder), "metadata": sections["metadata"]}
    if agent.has("user"):
        meta["agent_user"] = agent.get("user", _nonempty_string)
    if env.has("gpus"):  # no Environment field yet: kept so a sandbox can refuse what it lacks
        meta["gpus"] = env.get("gpus", _gpus)
    solution = _Fields(sections["solution"], where, "[solution].{}")
    if solution.has("env"):
        meta["solution_env"] = solution.get("env", _string_table)
    meta["unknown_keys"] = ignored
    return meta


def _ignored_keys(toml: dict, where: str) -> list[str]:
    """ "section.key" for each key of a section that Harbor's format defines and gyre does not
    read; TaskError for a key neither knows. The sections are tables (_harbor_sections)."""
    ignored: list[str] = []
    for key, value in toml.items():
        if key in HARBOR_TOP_KEYS:
            continue
        if key == "steps":
            raise TaskError(f"{where}: {HARBOR_STEPS}")
        if key in HARBOR_IGNORED[""]:
            ignored.append(key)
            continue
        if key not in HARBOR_SECTIONS:
            raise _unknown_key(where, f"[{key}]" if isinstance(value, dict) else key, key,
                               [*HARBOR_SECTIONS, *HARBOR_TOP_KEYS, *HARBOR_IGNORED[""], "steps"])
        if HARBOR_SECTIONS[key] is None:  # free-form
            continue
        known = HARBOR_SECTIONS[key] | set(HARBOR_IGNORED[key])
        for name in value:
            if name not in known:
                raise _unknown_key(where, f"[{key}].{name}", name, sorted(known))
            if name in HARBOR_IGNORED[key]:
                ignored.append(f"{key}.{name}")
    return sorted(ignored)


def _unknown_key(where: str, label: str, name: str, known: list[str]) -> TaskError:
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"did you mean '{close[0]}'?" if close else f"known: {', '.join(known)}"
    return TaskError(f"{where}: unknown key {label}: {hint}")


# ---------------------------------------------------------------------------------------------
# SWE-bench-style JSONL


def load_swe_tasks(path: str | Path) -> list[Task]:
    """Every row of a SWE-bench-style JSONL file (blank lines ignored), instance ids unique."""
    return load_jsonl(path, parse_swe_row, id_field="instance_id")


def parse_swe_row(row: Any, where: str, base: Path) -> Task:
    """One SWE-bench-style row; `where` prefixes errors, `base` anchors a relative `dockerfile`."""
    if not isinstance(row, dict):
        raise TaskError(f"{where}: a task must be a JSON object, got {type(row).__name__}")
    fields = _Fields(row, where, "{!r}")
    return Task(id=fields.get("instance_id", _nonempty_string, required=True),
                prompt=fields.get("problem_statement", _nonempty_string, required=True),
                timeout_s=fields.get("timeout_s", _timeout),
                environment=_swe_environment(fields, base), verifier=_swe_verifier(fields),
                meta={**{k: v for k, v in row.items() if k not in SWE_FIELDS}, "format": "swe"})


def _swe_environment(fields: _Fields, base: Path) -> Environment:
    if fields.has("image") == fields.has("dockerfile"):
        why = "give image or dockerfile, not both" if fields.has("image") else "missing (give image or dockerfile)"
        raise fields.error("image", why)
    build_dir = dockerfile = None
    if fields.has("dockerfile"):
        # Relative to the JSONL file, so a task set and its Dockerfiles move together; never out
        # of its folder (a dockerfile of "/root/Dockerfile" would send /root as the build context).
        path = (base / fields.get("dockerfile", _nonempty_string)).resolve()
        if not path.is_file():
            raise fields.error("dockerfile", f"{path} is not a file")
        try:
            inside(base.resolve(), path, "the task file's folder")
            check_links(path.parent, ["."], "the build context")  # what the engine is sent
        except TaskError as e:
            raise fields.error("dockerfile", str(e)) from None
        build_dir, dockerfile = str(path.parent), path.name
    return Environment(image=fields.get("image", _nonempty_string), build_dir=build_dir, dockerfile=dockerfile,
                       workdir=fields.get("workdir", _container_path), cpus=fields.get("cpus", _cpus),
                       memory_mb=fields.get("memory_mb", _within(_positive_int, *MEMORY_MB_RANGE, " MiB")),
                       allow_internet=fields.get("allow_internet", _bool, False))


def _swe_verifier(fields: _Fields) -> dict:
    return {"type": "swe", "test_cmd": fields.get("test_cmd", _nonempty_string, required=True),
            "fail_to_pass": fields.get("FAIL_TO_PASS", _nonempty_test_ids, required=True),
            "pass_to_pass": fields.get("PASS_TO_PASS", _test_ids, []),
            "test_patch": fields.get("test_patch", _string),
            "timeout_s": fields.get("test_timeout_s", _timeout, DEFAULT_SWE_TEST_TIMEOUT_S)}


# ---------------------------------------------------------------------------------------------
# Listing


def describe(task: Task) -> dict:
    """One row for `gyre tasks list/check`: where the task runs and how it is scored."""
    env = task.environment or Environment()
    fmt = task.meta.get("format")
    return {"task": task.id, "format": fmt if fmt in FORMATS else "jsonl", "image": env.image,
            "build": env.build_dir, "agent_timeout_s": task.timeout_s,
            "verifier": task.verifier.get("type") or task.evaluator.get("type") or "similarity",
            "cpus": env.cpus, "memory_mb": env.memory_mb, "storage_mb": env.storage_mb,
            "allow_internet": env.allow_internet, "solution": task.solution_dir is not None,
            "unknown_keys": list(task.meta.get("unknown_keys", []))}
