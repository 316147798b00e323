"""serve.py: `gyre serve`: the rollout stack on one local workerd (stack.py), recording one execution.

Without `--harness` it prints one JSON line (`base_url`, `api_key`, `api_keys` with
`--executions N`: one key per execution, each recorded as its own, `run_dir`) so any
harness can be pointed at it, then serves until SIGINT/SIGTERM. With `--harness NAME
--task TEXT` it runs that preset's harness once in a fresh workspace under the run
directory (the launcher's path: key, environment, deadline), prints one JSON summary line
and exits 0 when the harness completed. Either way the calls form one execution whose
records land in RUN_DIR/executions/<execution>/, for `gyre inspect`. Not the RL loop:
nothing trains or scores here.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

from gyre.coordinator.buffer import Execution
from gyre.coordinator.harnesses import HarnessPreset
from gyre.coordinator.launcher import LaunchSpec
from gyre.coordinator.sandbox import Limits
from gyre.coordinator.stack import execution_stack, rollout_stack, serving_worker
from gyre.coordinator.tasks import Task
from gyre.coordinator.waterlevel import Tracked
from gyre.proxy.server import ProxyServer
from gyre.proxy.serving import SERVING_FIELDS, ProxyConfig

DEFAULT_TIMEOUT_S = 600.0  # a harness's seconds where the task, --timeout and the preset set none


async def run_harness_once(proxy: ProxyServer, preset: HarnessPreset, prompt: str, *, run_dir: Path,
                           execution: str = "serve", timeout_s: float | None = None, task: Task | None = None,
                           sandbox: str = "process", sandbox_url: str | None = None) -> dict:
    """Run `preset` once against a started proxy, in a sandbox of `sandbox`; with `task` (a
    Harbor task, say) on that task, scored by its tests. `timeout_s`: the --timeout given, over
    the preset's timeout_s and under the task's own (harness_timeout). The summary is also
    written to RUN_DIR/executions/<execution>/summary.json."""
    spec = LaunchSpec(preset=preset, timeout_s=timeout_s or DEFAULT_TIMEOUT_S, timeout_flag_s=timeout_s,
                      eval_attempts=1, eval_budget_s=600.0 if task else 0.0, limits=Limits(pids=4096))
    run = Execution(id=execution, group=0, index=0, task=task or Task(id=execution, prompt=prompt), tracked=Tracked(),
                    version_dispatched=0)
    folder = run_dir / "executions" / execution
    scored: dict = {}
    async with execution_stack(proxy, spec, run_dir=run_dir, sandbox=sandbox, sandbox_url=sandbox_url) as executor:
        launcher = executor.launcher
        if task is not None:
            launcher.images.check(task)
            await launcher.run(run)  # the whole lifecycle: image, harness, deadline, tests, score
            status, code, workspace = run.status, None, folder / "workspace"
            scored = {"task": task.id, "score": run.reward, "valid": run.valid, "ref": run.ref}
        else:
            code, timed_out, workspace = await launcher.execute(run)
            status = ("not_started" if code is None else "timed_out" if timed_out
                      else "completed" if code == 0 else "harness_error")
    ex = run.recorder
    summary = {"execution": execution, "harness": preset.name, "sandbox": sandbox, "status": status,
               "exit_code": code, **scored, "calls": len(ex.calls) if ex else 0,
               "roles": dict(Counter(c["role"] for c in ex.calls)) if ex else {},
               "call_status": dict(Counter(c["status"] for c in ex.calls)) if ex else {},
               "tree": ex.tree.stats() if ex else {}, "workspace": str(workspace),
               "harness_log": str(folder / "harness.log")}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def harness_timeout(preset: HarnessPreset, timeout_s: float | None, task: Task | None = None) -> float:
    """The seconds a harness run once gets, as the launcher picks them: the task's own, else
    --timeout, else the preset's timeout_s, else DEFAULT_TIMEOUT_S."""
    return (task.timeout_s if task else None) or timeout_s or preset.timeout_s or DEFAULT_TIMEOUT_S


# What `gyre serve`, `tasks run` and `eval` take of a run config's serving fields (--host and
# --port are flags; tasks and eval listen on a free loopback port).
SERVE_FIELDS = tuple(name for name in SERVING_FIELDS if name not in ("proxy_host", "proxy_port"))
# The per-execution budgets when serving: none unless set (`gyre serve`'s one execution is often
# a whole benchmark client; `gyre up` sets its own, config.py).
SERVING_BUDGETS = {"max_calls_in_flight_per_execution": 0, "max_tokens_per_minute_per_execution": 0,
                   "budget_wait_s": 60.0}


def serve_fields(*, config: Path | None = None, sets: list[str] | None = None,
                 max_context: int | None = None) -> dict:
    """The serving fields of a run config (file < --set < --max-context), checked by
    ProxyConfig's rules (proxy/serving.py, as `gyre up`'s are): nothing is resolved against
    a model yet, so a bad value is refused before anything is made. Serving trains
    nothing, so a rollout_top_p < 1 or a rollout_temperature of 0 is allowed here."""
    from gyre.coordinator.runconfig import ConfigError, did_you_mean, field_names, load_config_file, parse_sets

    values = {k: v for k, v in (load_config_file(config) if config else {}).items() if k in SERVE_FIELDS}
    for item in sets or []:  # named against serve's own fields: a typo's nearest is one of them
        name = item.partition("=")[0].strip().replace("-", "_")
        if "=" in item and name not in SERVE_FIELDS:
            served = ", ".join(SERVE_FIELDS)
            if name in field_names():  # the run config's, not served
                raise ConfigError(f"gyre serve takes no field '{name}': "
                                  + did_you_mean(name, SERVE_FIELDS, f"it takes only {served}"))
            raise ConfigError(f"unknown field '{name}': "
                              + did_you_mean(name, SERVE_FIELDS, f"gyre serve takes only {served}"))
    values.update(parse_sets(sets or []))
    if max_context is not None:
        values["max_context"] = max_context
    try:
        ProxyConfig.from_fields(values)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return values


def serve_settings(*, model_dir: Path, fields: dict | None = None) -> ProxyConfig:
    """The ProxyConfig of `serve_fields`, resolved for the model as `gyre up` resolves it:
    output limits from gyre.json or the remaining context, the context clamped to the
    model's; the budgets SERVING_BUDGETS unless set."""
    from gyre.coordinator.runconfig import model_defaults

    f = {**SERVING_BUDGETS, **(fields if fields is not None else serve_fields())}
    limits = model_defaults(model_dir, lr=0.0, default_max_tokens=f.get("default_max_tokens"),
                            max_tokens_cap=f.get("max_tokens_cap"), max_context=f.get("max_context"))
    del limits["lr"]
    return ProxyConfig.from_fields({**f, **limits})


async def serve(*, model_dir: Path, run_dir: Path, host: str, port: int, execution: str = "serve",
                ready_file: Path | None = None, preset: HarnessPreset | None = None, task: str | None = None,
                timeout_s: float | None = None, settings: ProxyConfig | None = None, executions: int = 1,
                task_obj: Task | None = None, sandbox: str = "process", sandbox_url: str | None = None) -> int:
    loop = asyncio.get_running_loop()
    settings = settings if settings is not None else serve_settings(model_dir=model_dir)
    settings = replace(settings, host=host, port=port)
    async with rollout_stack(serving_worker(model_dir, run_dir), settings, run_dir=run_dir) as rollout:
        proxy, base_url = rollout.proxy, rollout.proxy.base_url
        if preset is not None:
            job = asyncio.ensure_future(run_harness_once(
                proxy, preset, task or "", run_dir=run_dir, execution=execution, timeout_s=timeout_s,
                task=task_obj, sandbox=sandbox, sandbox_url=sandbox_url))
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, job.cancel)
            try:
                summary = await job
            except asyncio.CancelledError:
                print(json.dumps({"event": "interrupted", "execution": execution}), file=sys.stderr)
                return 130
            print(json.dumps(summary), flush=True)
            return 0 if summary["status"] == "completed" else 1
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        # One key per execution: each client's calls form their own tree (one key shared by
        # concurrent harnesses would label their conversations sub-agents of each other).
        names = [execution] if executions == 1 else [f"{execution}-{i + 1}" for i in range(executions)]
        recorders = [proxy.register(name) for name in names]
        info = {"base_url": base_url, "openai_base_url": f"{base_url}/v1", "api_key": recorders[0].key,
                "api_keys": [ex.key for ex in recorders], "execution": names[0], "executions": names,
                "run_dir": str(run_dir)}
        print(json.dumps(info), flush=True)
        if ready_file is not None:
            ready_file.write_text(json.dumps(info))
        try:
            await stop.wait()
        finally:
            for name in names:
                proxy.revoke(name)
        print(json.dumps({"event": "stopped", "calls": {ex.id: len(ex.calls) for ex in recorders},
                          "trees": {ex.id: ex.tree.stats() for ex in recorders}}), file=sys.stderr)
        return 0


def recorded(settings: ProxyConfig) -> dict:
    """The serving settings a serve's or task run's config.json records."""
    return {"default_max_tokens": settings.default_max_tokens, "max_tokens_cap": settings.max_tokens_cap,
            "max_context": settings.max_context, "temperature": settings.temperature, "top_p": settings.top_p,
            **{name: getattr(settings, name) for name in SERVING_BUDGETS}}


def run_serve(*, model_dir: Path, run_dir: Path, host: str, port: int, preset: HarnessPreset | None = None,
              task: str | None = None, timeout_s: float | None = None, settings: ProxyConfig | None = None,
              executions: int = 1, task_obj: Task | None = None, sandbox: str = "process",
              sandbox_url: str | None = None) -> int:
    import uvloop

    settings = settings if settings is not None else serve_settings(model_dir=model_dir)
    (run_dir / "config.json").write_text(json.dumps({
        "command": "serve", "model": str(model_dir), "host": host, "port": port,
        "harness": None if preset is None else preset.name, "task": task,
        "timeout_s": None if preset is None else harness_timeout(preset, timeout_s, task_obj),
        "task_dir": None if task_obj is None else task_obj.id, "sandbox": sandbox,
        **recorded(settings)}, indent=2))
    return uvloop.run(serve(model_dir=model_dir, run_dir=run_dir, host=host, port=port, preset=preset, task=task,
                            timeout_s=timeout_s, settings=settings, executions=executions, task_obj=task_obj,
                            sandbox=sandbox, sandbox_url=sandbox_url))
