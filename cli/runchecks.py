"""runchecks.py: `gyre doctor RUN_DIR`'s checks of a run directory, one Check each.

config.json as `gyre up --resume` reads it (and a directory moved since), the model it
names, what the run needs here (backends, sandbox, harness), its state and lock, torn lines
in metrics.jsonl and the records, the latest checkpoint (megatron rank files included),
free disk and leftover podman containers (a `gyre serve` directory: its lock, records and
disk). Reads only: the fixes are for the user to run.
Not the installation checks (doctor.py) and not resume itself (coordinator/resume.py).
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
from pathlib import Path

import orjson

from gyre.cli.checks import FAIL, OK, PROBE_S, WARN, Check, free_disk, guarded, probe, split_fix

MAX_EXECUTION_LINES = 20  # problem lines about executions; the rest are counted


def run_directory(run_dir: Path) -> list[Check]:
    from gyre.coordinator.rundir import absolute

    d = absolute(run_dir)
    where = "name a run directory that `gyre up` made (it holds config.json, metrics.jsonl, executions/)"
    if not d.is_dir():
        return [Check("run directory", FAIL, f"{d} {'is not a directory' if d.exists() else 'does not exist'}", where)]
    if not (d / "config.json").exists():
        return [Check("run directory", FAIL, f"{d} has no config.json: not a gyre run directory", where)]
    serve = _serve_config(d)
    if serve is not None:  # `gyre serve`: records, no training (nothing to resume)
        return [Check("run directory", OK, f"a `gyre serve` directory (harness {serve.get('harness')}, model "
                                           f"{serve.get('model')})"),
                *guarded(_run_lock, d), *guarded(_run_executions, d), *guarded(_run_disk, d)]
    checks, cfg = _run_config(d)
    if cfg is not None:
        checks += guarded(_run_model, cfg) + guarded(_run_needs, cfg)
    for fn, args in ((_run_state, (d,)), (_run_lock, (d,)), (_run_metrics, (d,)), (_run_training, (d,)),
                     (_run_checkpoint, (d, cfg)),
                     (_run_executions, (d,)), (_run_disk, (d,)), (_run_sandboxes, (d, cfg))):
        checks += guarded(fn, *args)
    return checks


def _serve_config(d: Path) -> dict | None:
    """config.json as `gyre serve` writes it (coordinator/serve.py), else None."""
    try:
        raw = orjson.loads((d / "config.json").read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None
    return raw if isinstance(raw, dict) and raw.get("command") == "serve" else None


def _run_config(d: Path):
    """([checks], the config or None): config.json as `gyre up --resume` reads it."""
    from gyre.coordinator.runconfig import ConfigError, build_config, load_config_file

    path = d / "config.json"
    try:
        cfg = build_config(file_values=load_config_file(path), overrides={})
    except ConfigError as e:
        return [Check("run config", FAIL, str(e),
                      f"correct it in {path} (`gyre config show` lists every field and its type)")], None
    checks = [Check("run config", OK, f"steps {cfg.steps}, policy {cfg.policy}, harness {cfg.preset().name}, "
                                      f"sandbox {cfg.sandbox}, trainer {cfg.trainer_backend}")]
    named = cfg.run_dir
    if named != d and not (named.exists() and named.samefile(d)):
        moved = f"config.json names run_dir {named}: this directory was moved or copied"
        if cfg.model_dir.is_relative_to(named):  # the embedded model, named by the old path
            checks.append(Check("run config", WARN, f"{moved}, and its model_dir {cfg.model_dir} is under the old path",
                                f"set model_dir to {d / cfg.model_dir.relative_to(named)} in {path} "
                                "(`gyre up --resume` takes this directory but model_dir as written)"))
        else:
            checks.append(Check("run config", OK, f"{moved} (`gyre up --resume` takes this directory)"))
    return checks, cfg


def _run_model(cfg) -> Check:
    from gyre.workerd.modeldir import check_model_dir

    try:
        mc = check_model_dir(cfg.model_dir)
    except Exception as e:  # noqa: BLE001 - ModelDirError, or a weights file the safetensors reader refuses
        if cfg.model_dir == cfg.run_dir / "model":  # the embedded tiny default: seeded, so written again exactly
            fix = f"write it again: gyre init-model tiny {shlex.quote(str(cfg.model_dir))} --seed {cfg.seed}"
        else:
            fix = f"restore {cfg.model_dir}, or set model_dir in config.json to a copy of it"
        return Check("run model", FAIL, str(e), fix)
    return Check("run model", OK, f"{cfg.model_dir}: {mc.architecture}, {mc.num_hidden_layers} layers, "
                                  f"vocab {mc.vocab_size}, context {mc.max_position_embeddings}")


def _run_needs(cfg) -> list[Check]:
    """What `gyre up --resume` would refuse before starting: backends, sandbox, harness binary."""
    from gyre.coordinator.sandbox import BACKENDS, backend_class, isolation
    from gyre.coordinator.sandbox.base import SandboxError
    from gyre.coordinator.sandbox.preflight import check_sandbox
    from gyre.workerd.backends import check_backends
    from gyre.workerd.wire import BackendError

    out = []
    if cfg.workers == "local":  # external workerds bring their own backends
        try:
            check_backends(cfg.engine_backend, cfg.trainer_backend)
        except BackendError as e:
            what, _, fix = str(e).rpartition(": ")
            out.append(Check("run needs", FAIL, what, fix))
    try:
        check_sandbox(cfg.sandbox, url=cfg.sandbox_url, hosts=cfg.sandbox_hosts, internet=cfg.sandbox_internet)
    except SandboxError as e:
        out.append(Check("run needs", FAIL, *split_fix(str(e))))
    preset = cfg.preset()
    missing = preset.missing(contained=cfg.sandbox in BACKENDS and backend_class(cfg.sandbox).needs_image)
    if missing is not None:
        what, _, fix = missing.partition("; install: ")
        out.append(Check("run needs", FAIL, what, fix or preset.install or "install it, or set harness in config.json"))
    return out or [Check("run needs", OK, f"engine {cfg.engine_backend}, trainer {cfg.trainer_backend}, "
                                          f"sandbox {cfg.sandbox}, harness {preset.name}: all here; sandbox "
                                          f"{cfg.sandbox} {isolation(cfg.sandbox)}")]


def _lock_pid(d: Path) -> int | None:
    from gyre.coordinator.rundir import LOCK

    try:
        return int((d / LOCK).read_text().strip())
    except (OSError, ValueError):
        return None


def _run_state(d: Path) -> Check:
    from gyre.coordinator.rundir import held, state

    q = shlex.quote(str(d))
    if held(d):
        return Check("run state", OK, f"running (pid {_lock_pid(d)} holds the lock)", f"watch it: gyre top {q}")
    try:
        s = state(d)
    except TypeError:  # rundir.state compares config.json's steps as it is: a non-number raises
        return Check("run state", WARN, "unknown: config.json's steps is not a number",
                     f"correct steps in {d / 'config.json'}")
    of = f"{s.steps_done}/{s.steps_target}" if s.steps_target is not None else f"{s.steps_done}"
    if s.kind == "finished":
        return Check("run state", OK, f"finished ({of} steps)",
                     f"extend it: gyre up --resume {q} --steps N (N > {s.steps_done})")
    if s.kind == "stopped":
        return Check("run state", OK, f"stopped at step {of} (a graceful stop)", f"continue it: gyre up --resume {q}")
    return Check("run state", WARN, f"crashed at step {of} (no closing summary in metrics.jsonl)",
                 f"continue it: gyre up --resume {q}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except PermissionError:
        return True  # another user's
    except OSError:
        return False
    return True


def _run_lock(d: Path) -> Check:
    from gyre.coordinator.rundir import LOCK, held, live_coordinator

    if not (d / LOCK).exists():
        return Check("run lock", OK, "no .lock: never claimed")
    pid = _lock_pid(d)
    if held(d):
        return Check("run lock", OK, f"held by pid {pid} (alive)")
    who = "gone" if pid is None or not _alive(pid) else "alive, but not holding it (a reused pid)"
    detail = f"not held; .lock names pid {pid}, {who}: stale and harmless (the kernel drops a flock with its holder)"
    if live_coordinator(d):  # coordinator.json's pid runs, yet nobody holds the lock: reused too
        return Check("run lock", WARN, f"{detail}; coordinator.json names a live pid that holds no lock",
                     "`gyre top` may take this run for a live one: name the run you mean (gyre top RUN_DIR)")
    return Check("run lock", OK, detail)


def _torn(path: Path) -> tuple[list[int], int]:
    """(numbers of the lines that are no whole JSON record, lines) of an execution's records
    file; blank lines are skipped, as every reader does."""
    if not path.exists():
        return [], 0
    lines = path.read_bytes().splitlines()
    torn = []
    for i, line in enumerate(lines, 1):
        if line.strip():
            try:
                orjson.loads(line)
            except orjson.JSONDecodeError:
                torn.append(i)
    return torn, len(lines)


def _run_metrics(d: Path) -> Check:
    from gyre.coordinator.metrics import read_events
    from gyre.coordinator.rundir import held

    q, path = shlex.quote(str(d)), d / "metrics.jsonl"
    if not path.exists():
        return Check("metrics.jsonl", WARN, "missing: the run ended before its first event",
                     f"start it again: gyre up --resume {q}")
    journal = read_events(path)
    n, torn_last, mid = journal.lines, journal.torn_last, list(journal.mid)
    if torn_last and not mid and held(d):  # a live run: its last line may be mid-write as we read
        torn_last = False
    if not torn_last and not mid:
        return Check("metrics.jsonl", OK, f"{n} events, no torn line")
    parts = ["a crash tore the last line; resume skips it"] if torn_last else []
    if mid:
        parts.append(f"{len(mid)} torn line(s) mid-file (line {', '.join(map(str, mid[:5]))}): readers skip them "
                     "and their events are lost")
    fix = (f"nothing to repair: gyre up --resume {q} skips torn lines" +
           ("; a lost dispatch or execution event makes it run that work again" if mid else ""))
    return Check("metrics.jsonl", WARN, f"{n} lines: {'; '.join(parts)}", fix)


def _run_training(d: Path) -> list[Check]:
    """What the steps trained: a run whose steps trained no token left the weights as the base
    model's (a warning, with the diagnosis its step events carry: coordinator/diagnosis.py)."""
    from gyre.coordinator.diagnosis import merge, why
    from gyre.coordinator.metrics import counted_steps, read_events

    path = d / "metrics.jsonl"
    if not path.exists():
        return []
    steps = counted_steps(read_events(path).events)  # a resume's retrained steps once
    if not steps:
        return [Check("training", OK, "no step done yet")]
    idle = [e for e in steps if not e.get("tokens_trained")]
    tokens = sum(e.get("tokens_trained") or 0 for e in steps)
    if not idle:
        return [Check("training", OK, f"{len(steps)} steps, {tokens} tokens trained")]
    reason = why(merge(idle), sum(e.get("groups") or 0 for e in idle))
    fix = ("give the reward spread within a group (partial credit, a larger group_size); if calls end at "
           "max_tokens, raise default_max_tokens; read what the model said with gyre inspect "
           f"{shlex.quote(str(d))} --execution ID --transcript (docs/troubleshooting.md, \"Nothing trained\")")
    if len(idle) == len(steps):
        return [Check("training", WARN, f"{len(steps)} step(s) trained 0 tokens: the weights equal the base "
                                        f"model's" + (f" ({reason})" if reason else ""), fix)]
    return [Check("training", OK, f"{len(steps)} steps, {tokens} tokens trained; {len(idle)} step(s) trained "
                                  f"nothing" + (f" ({reason})" if reason else ""))]


def _rank_files(folder: Path, cfg) -> list[str]:
    """The megatron rank files a checkpoint lacks (megatron_state.ckpt_path's names: rank 0's
    is trainer.pt, the others trainer.pt.tpR, or trainer.pt.ppS.tpR under PP)."""
    if cfg is None or cfg.trainer_backend != "megatron":
        return []
    tp, pp = int(cfg.trainer_options.get("tp", 1)), int(cfg.trainer_options.get("pp", 1))
    names = [f"trainer.pt.pp{s}.tp{r}" if pp > 1 else f"trainer.pt.tp{r}"
             for s in range(pp) for r in range(tp) if (s, r) != (0, 0)]
    return [n for n in names if not (folder / n).exists()]


def _complete(folder: Path, cfg) -> bool:
    return (folder / "state.json").exists() and (folder / "trainer.pt").exists() and not _rank_files(folder, cfg)


def _run_checkpoint(d: Path, cfg) -> Check:
    from gyre.coordinator.resume import CHECKPOINTS, newest_intact

    pointer = d / CHECKPOINTS / "latest"
    if not pointer.exists():
        return Check("checkpoint", OK, "none yet: a resume starts from step 0 (the model directory's weights), "
                                       "every closed execution restored")
    name = pointer.read_text().strip()
    folder, st, skipped = newest_intact(d)
    if skipped:  # a resume would fall back past them (or find none): say so
        return _bad_checkpoint(d, cfg, name, "; ".join(skipped))
    missing = _rank_files(folder, cfg)
    if missing:
        shape = f"TP={cfg.trainer_options.get('tp', 1)}, PP={cfg.trainer_options.get('pp', 1)}"
        return _bad_checkpoint(d, cfg, name, f"checkpoint {folder} is incomplete: rank file(s) "
                                             f"{', '.join(missing)} missing ({shape}; a cell loads one only "
                                             "with every rank's file)")
    ranks = " and the rank files" if cfg is not None and cfg.trainer_backend == "megatron" else ""
    return Check("checkpoint", OK, f"latest is {name} (step {st.get('step')}, version {st.get('version')}): "
                                   f"state.json, trainer.pt{ranks}")


def _bad_checkpoint(d: Path, cfg, name: str, detail: str) -> Check:
    """A latest checkpoint resume would refuse; the fix names an earlier complete one."""
    from gyre.coordinator.resume import CHECKPOINTS

    pointer = shlex.quote(str(d / CHECKPOINTS / "latest"))
    earlier = [f for f in sorted((d / CHECKPOINTS).glob("step-*"), reverse=True) if f.name < name and _complete(f, cfg)]
    if earlier:
        fix = f"point latest at the newest complete one: echo {earlier[0].name} > {pointer}"
    else:
        fix = f"rm {pointer}: a resume then starts from step 0 (the model directory's weights)"
    return Check("checkpoint", FAIL, f"{detail}; `gyre up --resume` cannot load it", fix)


def _run_executions(d: Path) -> list[Check]:
    from gyre.coordinator.rundir import held

    root = d / "executions"
    if not root.is_dir():
        return [Check("executions", OK, "no executions/ yet")]
    folders = sorted(p for p in root.iterdir() if p.is_dir())
    live = held(d)
    problems = [c for f in folders for c in guarded(_execution, d, f, live)]
    bad = len({c.check for c in problems})
    head = Check("executions", WARN if problems else OK,
                 f"{len(folders)} folder(s)" + (f", {bad} with problems below" if problems else
                                                ": nodes.jsonl and calls.jsonl whole"))
    more = len(problems) - MAX_EXECUTION_LINES
    tail = [Check("executions", WARN, f"and {more} more problem line(s)", "fix those above, then run doctor again")]
    return [head, *problems[:MAX_EXECUTION_LINES], *(tail if more > 0 else [])]


def _execution(d: Path, folder: Path, live: bool) -> list[Check]:
    """Whether the records make a tree is the reader's verdict (records.load_execution, as
    resume and `gyre inspect` read them); torn lines are counted here. `live`: the run is
    running, so a last line (or a call whose nodes were read before it) may be mid-write."""
    name, torn = f"execution {folder.name}", []
    for file in ("nodes.jsonl", "calls.jsonl"):
        lines, n = _torn(folder / file)
        mid = [i for i in lines if i != n]
        if n in lines and not live:
            torn.append(f"{file}: a crash tore the last line")
        if mid:
            torn.append(f"{file}: line {', '.join(map(str, mid[:5]))} of {n} is no whole record (torn mid-file)")
    error = _load_error(folder)
    if error is not None and live:
        return [Check(name, WARN, f"its records do not load yet ({error}): the run is live, a record may be "
                                  "mid-write", "run gyre doctor again once the execution has closed")]
    if error is not None:
        broken = shlex.quote(str(d / "broken"))
        return [Check(name, FAIL, f"its records do not load, so resume and gyre inspect stop on them ({error})"
                                  + "".join(f"; {t}" for t in torn),
                      f"move it aside (mkdir -p {broken} && mv {shlex.quote(str(folder))} {broken}/): a resume "
                      "then restores the execution without records and trains none of it")]
    return [Check(name, WARN, f"{t}; readers skip it", "nothing to repair: resume and gyre inspect read the rest")
            for t in torn]


def _load_error(folder: Path) -> str | None:
    from gyre.proxy.records import load_execution

    quiet = logging.getLogger("gyre.records")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # torn lines are the doctor's own lines, said once
    try:
        load_execution(folder)
    except Exception as e:  # noqa: BLE001 - whatever the reader raises, resume and gyre inspect would
        return f"{type(e).__name__}: {e}"
    finally:
        quiet.setLevel(level)
    return None


def _run_disk(d: Path) -> Check:
    return free_disk("run disk", d, "free space on that filesystem: checkpoints and records grow with the run")


def _run_sandboxes(d: Path, cfg) -> Check:
    """Containers labelled with this run directory in the local podman (sandbox/reaper.py's labels)."""
    from gyre.coordinator.rundir import held
    from gyre.coordinator.sandbox.base import LABEL_EXECUTION, LABEL_RUN_DIR
    from gyre.coordinator.sandbox.reaper import kept_marker

    if shutil.which("podman") is None:
        return Check("run sandboxes", OK, "no podman here: no containers to look for")
    found: dict[str, dict] = {}
    for rd in sorted({str(d), *([str(cfg.run_dir)] if cfg is not None else [])}):
        text = probe(["podman", "ps", "-a", "--filter", f"label={LABEL_RUN_DIR}={rd}", "--format", "json"])
        if text is None:
            return Check("run sandboxes", WARN, f"podman ps did not answer within {PROBE_S:g} s",
                         f"look by hand: podman ps -a --filter label={LABEL_RUN_DIR}={shlex.quote(rd)}")
        found.update({c["Id"]: c for c in json.loads(text or "[]")})
    remote = " (the local podman only: sandbox_url / sandbox_hosts not asked)" if cfg is not None and (
        cfg.sandbox_url or cfg.sandbox_hosts) else ""
    if not found:
        return Check("run sandboxes", OK, f"no podman container labelled {LABEL_RUN_DIR}={d}{remote}")
    if held(d):
        return Check("run sandboxes", OK, f"{len(found)} container(s): the running run's own{remote}")
    kept = {i for i, c in found.items() if kept_marker(d, (c.get("Labels") or {}).get(LABEL_EXECUTION, "-")).exists()}
    left = [i[:12] for i in found if i not in kept]
    if not left:
        return Check("run sandboxes", OK, f"{len(kept)} container(s) kept on purpose (keep_sandbox): remove them "
                                          f"when done (podman rm -f {' '.join(i[:12] for i in kept)})")
    return Check("run sandboxes", WARN, f"{len(left)} leftover container(s) of this run{remote}",
                 f"podman rm -f {' '.join(left)} (a `gyre up --resume` removes them at start-up too)")
