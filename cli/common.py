"""common.py: the helpers several `gyre` commands share: a domain error as one `[error]`
line (`fail`, `guard`), the harness preset a command names, the sandbox its tasks run in,
the model directory it serves and its default run directory, gyre's version.

A leaf: it imports no other cli/ module, so every command module may import it. Not the
typer app or any command (main.py and the command modules), not the options (options.py).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import typer

debug = False  # --debug (main.py's root callback): fail() raises instead of printing one line


def fail(e: Exception) -> None:
    if debug:
        raise e
    typer.echo(f"[error] {e}", err=True)
    raise typer.Exit(1) from None


def guard(fn, **kwargs):
    """`fn(**kwargs)`; a GyreError it raises is one `[error]` line and exit status 1."""
    from gyre.workerd.wire import GyreError

    try:
        return fn(**kwargs)
    except GyreError as e:
        fail(e)


def gyre_version() -> str:
    try:
        return version("gyre")
    except PackageNotFoundError:
        return "0+unknown"


def check_installed(preset, sandbox: str = "process") -> None:
    """The preset can run on `sandbox` here: its command on PATH, or, in a container, its
    sandbox_command (checked in the image at launch) with its sandbox_pip folder installed
    now, so a pip failure is one line before anything starts."""
    from gyre.coordinator.sandbox import backend_class

    contained = guard(backend_class, name=sandbox).needs_image
    why = preset.missing(contained=contained)
    if why is not None:
        fail(FileNotFoundError(why))
    if contained and preset.sandbox_pip:
        from gyre.coordinator.sandbox.agentdir import agent_dir

        guard(agent_dir, preset=preset.name, packages=preset.sandbox_pip, python=preset.sandbox_python)


def flag_or_config(flag, *, config: Path | None, key: str, option: str, default, check=None):
    """An explicit flag, else the run config's `key`, else `default` (flags win over the config,
    as in `gyre up`). `check(value) -> str | None` says what is wrong with a value; its error
    names where the value came from (`option` or the config file's field)."""
    from gyre.coordinator.runconfig import load_config_file

    values = guard(load_config_file, path=config) if config and flag is None else {}
    value, where = (flag, option) if flag is not None else (values.get(key), f"{config}: {key}")
    if value is None:
        return default
    why = check(value) if check is not None else None
    if why:
        fail(ValueError(f"{where} {why}, got {value!r}"))
    return value


def positive_seconds(value) -> str | None:
    from gyre.coordinator.tasks import MAX_TIMEOUT_S

    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= MAX_TIMEOUT_S
    return None if ok else f"must be a positive number of seconds, at most {MAX_TIMEOUT_S:g} (a week)"


def config_timeout(config: Path | None) -> float:
    """The seconds a harness gets where the task, --timeout and the preset set none: the run
    config's execution_timeout_s (checked), else serve.DEFAULT_TIMEOUT_S."""
    from gyre.coordinator.serve import DEFAULT_TIMEOUT_S

    return flag_or_config(None, config=config, key="execution_timeout_s", option="--timeout",
                          default=DEFAULT_TIMEOUT_S, check=positive_seconds)


def harness_preset(name: str | None, config: Path | None, sandbox: str = "process"):
    """The preset --harness names, else the config's `harness`, else demo (user presets from
    `config` first), checked for `sandbox`."""
    from gyre.coordinator.harnesses import HarnessError, resolve
    from gyre.coordinator.runconfig import load_config_file

    values = guard(load_config_file, path=config) if config else {}
    try:
        preset = resolve(name if name is not None else values.get("harness", "demo"), values.get("harnesses", {}))
    except HarnessError as e:
        fail(e)
    check_installed(preset, sandbox)
    return preset


def sandbox_for(*, flag: str | None, url: str | None, config: Path | None, tasks,
                source: str) -> tuple[str, str | None]:
    """(sandbox, sandbox_url) a command runs `tasks` in: --sandbox, else the run config's
    `sandbox`, else the default rule (sandbox/preflight.py default_sandbox: podman or docker
    for tasks that run in an image, else process); --sandbox-url, else the config's. `source`
    names the task source in the rule's error."""
    from gyre.coordinator.runconfig import load_config_file
    from gyre.coordinator.sandbox import BACKENDS
    from gyre.coordinator.sandbox.preflight import default_sandbox

    values = guard(load_config_file, path=config) if config else {}
    url = url if url is not None else values.get("sandbox_url")
    name = flag if flag is not None else values.get("sandbox")
    if name is None:
        return guard(default_sandbox, tasks=tasks, source=source, url=url), url
    if name not in BACKENDS:
        where = "--sandbox" if flag is not None else f"{config}: sandbox"
        fail(ValueError(f"{where} must be one of {', '.join(BACKENDS)}, got {name!r}"))
    return name, url


def check_timeout(timeout: float | None) -> None:
    """--timeout, where given: seconds, positive, at most a week (NaN fails it too)."""
    from gyre.coordinator.tasks import MAX_TIMEOUT_S

    if timeout is not None and not 0 < timeout <= MAX_TIMEOUT_S:
        fail(ValueError(f"--timeout must be a positive number of seconds, at most {MAX_TIMEOUT_S:g} (a week), "
                        f"got {timeout:g}"))


def check_model(model_dir: Path) -> None:
    from gyre.workerd.modeldir import check_model_dir

    check_model_dir(model_dir)


def model_or_tiny(model, run_dir, seed: int):
    """The given model directory, or the tiny default written into the run directory."""
    from gyre.workerd.modeldir import init_tiny

    if model is not None:
        return model
    if (run_dir / "model" / "config.json").exists():
        return run_dir / "model"
    return init_tiny(run_dir / "model", seed=seed)


def default_run_dir(prefix: str) -> Path:
    import time

    return Path("runs") / time.strftime(f"{prefix}-%Y%m%d-%H%M%S")
