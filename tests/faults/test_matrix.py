"""The fault matrix (issue 26): one fault at one phase of a real `gyre up` on the embedded
default (elastic, two spawned workerds, CPU engine and trainer, the tiny model), each case
its own run of 2 or 3 steps, the fault in step 2 (a checkpoint of step 1 exists):

    fault \\ phase        rollout                 training                publication
    workerd SIGKILL      cell 1: the run goes    cell 0 (the core): the  cell 1: the push to it
                         on without it           run stops; --resume     fails over, the run
                                                 completes it            goes on without it
    workerd SIGSTOP      cell 1: declared dead,  cell 0: as a kill       cell 1: the push waits
    (then SIGCONT once   continued, it rejoins                           for its death, then it
    declared dead)                                                       rejoins
    coordinator SIGKILL  --resume from step 1's checkpoint: nothing lost, nothing trained twice;
                         the harnesses it could not stop are reaped by the resume; its
                         workerds wait for it, and it takes them back with their weights
                         (the core's trainer at step 1's version in rollout and training: no
                         checkpoint loaded; a step ahead in publication: built again)
    coordinator SIGTERM  a stop: exit 143, the trained steps kept (step 2's too, in publication),
                         the executions it cancelled left pending (never dropped nor replaced);
                         --resume continues with the uninterrupted run's schedule
    terminal Ctrl-C      SIGINT to the whole process group, as a terminal sends it: a stop as
                         for SIGTERM (exit 130); the workerds, in their own session, never see
                         it, so the last trained step's checkpoint is saved
    (and cell 0 SIGKILLed in rollout: the run stops as in training)

The phases, read from `/gyre/status` (RUN_DIR/coordinator.json): *rollout* is step 2's
executions running and calling the model, no step in flight; *training* is step 2 in flight
with the core in the training role (the task set has a fast and a slow task, one group of
each per step, so a streaming step waits seconds for the slow group); *publication* is step
2's weights sent to cell 1 and not yet taken: cell 1 is stopped while the step is in flight
(worker_timeout_s long enough to outlast it), and the publication's frames are seen waiting
in its socket's receive queue before the fault. Every case then asserts, from metrics.jsonl
and the run directory: one status per execution, no closed execution lost, no invalid
reward trained, the counters' identities (waterlevel.py), the uninterrupted run's schedule
(staleness 0, nothing pending at the end), and nothing of the run left running (/proc:
command lines, environments, working directories and open files).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

HERE = Path(__file__).parent
COORD_TESTS = HERE.parent / "coordinator"
EVAL = [sys.executable, str(COORD_TESTS / "_evaluator.py"), "ok"]
HARNESS = [sys.executable, str(COORD_TESTS / "_harness.py")]
AT_STEP = 2  # the fault comes in step 2 (of 2, or 3 where a stopped worker is to rejoin): step 1's checkpoint exists
SLOW_S = 4  # the slow task's deadline: how long a streaming step 2 waits for its second group
REWARD_RANGE = (-1e6, 1e6)
INVALID_STATUSES = {"aborted_infra", "evaluator_error", "cancelled"}

pytestmark = [pytest.mark.slow, pytest.mark.faults, pytest.mark.timeout(300)]


# --- the run -------------------------------------------------------------------------------


def write_config(folder: Path, tiny_dir: Path, *, worker_timeout_s: float, steps: int,
                 checkpoint_every: int = 1, workers: str = "local") -> Path:
    ev = {"type": "command", "argv": EVAL}
    tasks = folder / "tasks.jsonl"
    # Two tasks: every pass of the (shuffled) set is one step's two groups, so each step has
    # a fast group (ready in a second or two: the core moves to training, a streaming step
    # starts) and a slow one (its harness sleeps to the task's deadline after answering:
    # the step waits for it, timed_out and scored on its answer).
    tasks.write_text(json.dumps({"id": "fast", "prompt": "mode:normal fast", "evaluator": ev}) + "\n"
                     + json.dumps({"id": "slow", "prompt": "mode:sleep slow", "evaluator": ev,
                                   "timeout_s": SLOW_S}) + "\n")
    cfg = folder / "run.toml"
    cfg.write_text(f'steps = {steps}\ngroups_per_step = 2\ngroup_size = 2\nmin_valid = 2\n'
                   f'checkpoint_every = {checkpoint_every}\n'
                   f'harness = {json.dumps(HARNESS)}\ntasks_path = "{tasks}"\nmodel_dir = "{tiny_dir}"\n'
                   f'default_max_tokens = 8\nworker_timeout_s = {worker_timeout_s}\n'
                   f'reward_range = {list(REWARD_RANGE)}\nworkers = "{workers}"\n')
    return cfg


class Up:
    """A `gyre up` subprocess whose output is read on a thread (waits have deadlines)."""

    def __init__(self, argv: list[str]):
        # Its own process group, as a shell's job: a terminal's Ctrl-C goes to all of it.
        self.proc = subprocess.Popen([sys.executable, "-m", "gyre.cli", "up", *argv, "--no-live"],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self.lines.append(None)  # end of output
            self._cond.notify_all()

    @property
    def output(self) -> str:
        return "\n".join(x for x in self.lines if x is not None)

    def wait_line(self, start: str, timeout: float) -> str:
        end = time.monotonic() + timeout
        with self._cond:
            i = 0
            while True:
                while i < len(self.lines):
                    if self.lines[i] is None:
                        raise AssertionError(f"the run ended before a line {start!r}:\n{self.output[-3000:]}")
                    if self.lines[i].startswith(start):
                        return self.lines[i]
                    i += 1
                left = end - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no line {start!r} within {timeout}s:\n{self.output[-3000:]}")
                self._cond.wait(left)

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(10)
        self.proc.stdout.close()
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.wait(60)


def status(run: Path) -> dict | None:
    """The coordinator's /gyre/status, or None while it is not serving."""
    try:
        url = json.loads((run / "coordinator.json").read_text())["status_url"]
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.loads(r.read())
    except (OSError, ValueError, KeyError):
        return None


def wait_for(what: str, probe, timeout: float, up: Up | None = None, every: float = 0.02):
    """Poll `probe()` until it returns something truthy (the value), within `timeout` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = probe()
        if value:
            return value
        if up is not None and up.proc.poll() is not None:
            raise AssertionError(f"the run ended (exit {up.proc.returncode}) before {what}:\n{up.output[-3000:]}")
        time.sleep(every)  # the probe's rate, not a synchronisation
    raise AssertionError(f"not within {timeout}s: {what}" + (f"\n{up.output[-3000:]}" if up else ""))


def events(run: Path) -> list[dict]:
    out = []
    for line in (run / "metrics.jsonl").read_bytes().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a kill -9 may tear the last line (the resume cuts it)
            continue
    return out


def journal_lines(run: Path) -> int:
    """Whole lines in metrics.jsonl now: where the next session's events begin."""
    return (run / "metrics.jsonl").read_bytes().count(b"\n")


def wait_event(run: Path, kind: str, timeout: float, up: Up | None = None, **match) -> dict:
    def probe():
        return next((e for e in events(run) if e["event"] == kind
                     and all(e.get(k) == v for k, v in match.items())), None)

    return wait_for(f"a {kind} event {match or ''}", probe, timeout, up, every=0.05)


# --- processes -----------------------------------------------------------------------------


def workerd_pid(coordinator_pid: int, cell: int) -> int:
    """The workerd a coordinator spawned for `cell` (local.py: --cell K ... --parent-pid PID)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            argv = _cmdline(entry).split()
            if "workerd" in argv and _flag(argv, "--cell") == str(cell) \
                    and _flag(argv, "--parent-pid") == str(coordinator_pid):
                return int(entry)
    raise AssertionError(f"no workerd for cell {cell} of coordinator {coordinator_pid}")


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv[:-1] else None


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def rx_queued(pid: int) -> int:
    """Bytes waiting in the receive queues of `pid`'s TCP sockets (its link to the
    coordinator among them): a stopped workerd's grow when a publication sends it weights."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    total = 0
    for table in ("tcp", "tcp6"):
        try:
            rows = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[9] in inodes:
                total += int(cols[4].split(":")[1], 16)
    return total


def leftovers(run: Path, coordinators: list[int]) -> list[tuple[int, str, str]]:
    """Live processes of the run, as (pid, why, command line): its workerds (spawned with
    --parent-pid of one of its coordinators), and anything naming the run directory in its
    command line or environment (a harness: GYRE_SANDBOX_RUN_DIR), working in it or holding
    a file of it open."""
    me, root, found = os.getpid(), str(run), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        p = Path("/proc", entry)
        try:
            if (p / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
        except OSError:
            continue
        cmd, why = _cmdline(entry), None
        argv = cmd.split()
        if "workerd" in argv and _flag(argv, "--parent-pid") in {str(c) for c in coordinators}:
            why = "workerd"
        elif root in cmd:
            why = "command line"
        else:
            try:
                if f"GYRE_SANDBOX_RUN_DIR={root}".encode() in (p / "environ").read_bytes().split(b"\0"):
                    why = "sandbox"
                elif os.readlink(p / "cwd").startswith(root):
                    why = "working directory"
                elif any(os.readlink(fd).startswith(root) for fd in (p / "fd").iterdir()):
                    why = "open file"
            except OSError:
                continue
        if why:
            found.append((int(entry), why, cmd[:160]))
    return found


def assert_nothing_left(run: Path, coordinators: list[int], *, but=frozenset()) -> list[tuple[int, str, str]]:
    """Wait (bounded) until nothing of the run runs but processes of the kinds `but`; those
    are returned, anything else after the deadline is killed and fails the test."""
    def rest():
        return [x for x in leftovers(run, coordinators) if x[1] not in but]

    try:
        wait_for("nothing of the run left running", lambda: not rest(), 30, every=0.2)
    except AssertionError:
        left = rest()
        for pid, _, _ in left:  # do not leave them to the machine
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        raise AssertionError(f"left running: {left}") from None
    return leftovers(run, coordinators)


# --- the faults ----------------------------------------------------------------------------


@dataclass
class Case:
    fault: str  # workerd-kill | workerd-stop | coordinator-kill | coordinator-term | terminal-int
    phase: str  # rollout | training | publication
    target: int | None = None  # the workerd's cell
    worker_timeout_s: float = 3.0
    checkpoint_every: int = 1  # 5 (the default) for Ctrl-C: step 1 is saved by the stop's final checkpoint or lost
    workers: str = "local"  # inproc: the workers are threads of the coordinator, in its process group
    observed: dict = field(default_factory=dict)

    @property
    def steps(self) -> int:
        """The run's steps: 2, or 3 where a stopped worker continued after step 2's fault is to
        rejoin, and where a stop keeps step 2 (a run stopped at its last step is finished)."""
        rejoins = self.fault == "workerd-stop" and self.target != 0
        return 3 if rejoins or (self.stops and self.phase == "publication") else AT_STEP

    @property
    def stops(self) -> bool:
        """A graceful stop: SIGTERM to the coordinator, or a terminal's SIGINT to its group."""
        return self.fault in ("coordinator-term", "terminal-int")

    @property
    def core_dies(self) -> bool:
        return self.fault.startswith("workerd") and self.target == 0

    @property
    def restarts(self) -> bool:
        """The first session ends before the run does: `gyre up --resume` completes it."""
        return self.fault.startswith("coordinator") or self.stops or self.core_dies


# The cell each workerd fault hits is the one that works in that phase: cell 1 rolls out
# (its death is survived), cell 0 trains (its death stops the run: the extra rollout case
# shows that it does in any phase). worker_timeout_s: 3 s, but longer where the fault must
# meet the step's end or its publication before it is noticed (the slow group closes within
# SLOW_S): the coordinator then sends to the killed core (a send that fails at once) or
# publishes to the stopped cell 1 (frames that wait).
CASES = [
    Case("workerd-kill", "rollout", 1), Case("workerd-kill", "rollout", 0),
    Case("workerd-kill", "training", 0, 8.0), Case("workerd-kill", "publication", 1, 10.0),
    Case("workerd-stop", "rollout", 1), Case("workerd-stop", "training", 0, 8.0),
    Case("workerd-stop", "publication", 1, 10.0),
    Case("coordinator-kill", "rollout"), Case("coordinator-kill", "training"),
    Case("coordinator-kill", "publication", None, 10.0),
    Case("coordinator-term", "rollout"), Case("coordinator-term", "training"),
    Case("coordinator-term", "publication", None, 10.0),
    Case("terminal-int", "rollout", checkpoint_every=5), Case("terminal-int", "training", checkpoint_every=5),
    Case("terminal-int", "publication", None, 10.0, checkpoint_every=5),
    Case("terminal-int", "training", checkpoint_every=5, workers="inproc"),
]
IDS = [f"{c.fault}-{c.phase}" + (f"-cell{c.target}" if c.target is not None else "")
       + (f"-{c.workers}" if c.workers != "local" else "") for c in CASES]


def at_phase(case: Case, run: Path, up: Up) -> dict:
    """Wait for the case's phase of step 2; returns the status seen there."""
    done = AT_STEP - 1
    if case.phase == "rollout":
        def probe():  # step 1 published, its next groups running and calling the model
            s = status(run)
            return s if s and s["steps"]["done"] == done and s["burst"]["publications"] == done \
                and not s["step_in_flight"] and s["waterlevel"]["running"] > 0 and s["cells"][0]["role"] == "rollout" \
                and (s["cells"][case.target]["homes"] > 0 if case.target is not None  # the cell hit serves
                     else any(c["homes"] > 0 for c in s["cells"])) else None

        return wait_for("step 2's rollout", probe, 120, up)

    def in_flight():
        s = status(run)
        return s if s and s["steps"]["done"] == done and s["step_in_flight"] \
            and s["cells"][0]["role"] == "training" else None

    seen = wait_for("step 2 in flight", in_flight, 120, up)
    if case.phase == "training":
        return seen

    def calls_done():  # the slow group's harnesses have made their one call each: they only sleep now
        s = in_flight()
        return s if s and s["calls"]["in_flight"] == 0 \
            and sum(c["homes"] for c in s["cells"]) >= s["waterlevel"]["running"] else None

    # publication: cell 1 stopped now, so step 2's publication finds it stopped (it is
    # declared dead only after worker_timeout_s, well after the step ends: nothing the step
    # waits for needs cell 1); its frames waiting in cell 1's receive queue are the
    # publication in flight.
    wait_for("step 2 in flight, its last calls answered", calls_done, 60, up)
    sat = workerd_pid(up.proc.pid, 1)
    os.kill(sat, signal.SIGSTOP)
    case.observed["stopped"] = sat
    queued = wait_for("step 2's weights queued at the stopped cell 1", lambda: rx_queued(sat) >= 64 << 10,
                      case.worker_timeout_s, up, every=0.01)
    s = status(run)
    assert s and s["steps"]["done"] == AT_STEP and s["burst"]["publications"] == done, s  # not yet published
    case.observed["rx_queued"] = queued
    return s


def inject(case: Case, run: Path, up: Up) -> None:
    """The fault, at the phase; for a stop, the continue once the coordinator declared it dead."""
    if case.fault == "terminal-int":  # what Ctrl-C does: SIGINT to the foreground process group
        os.killpg(up.proc.pid, signal.SIGINT)
    elif case.fault.startswith("coordinator"):
        os.kill(up.proc.pid, signal.SIGKILL if case.fault == "coordinator-kill" else signal.SIGTERM)
    if case.fault.startswith("coordinator") or case.fault == "terminal-int":
        if "stopped" in case.observed:  # ours, not the fault: let it see its parent gone, or serve the stop
            os.kill(case.observed["stopped"], signal.SIGCONT)
        return
    pid = case.observed.get("stopped") or workerd_pid(up.proc.pid, case.target)
    if case.fault == "workerd-kill":
        os.kill(pid, signal.SIGKILL)
        return
    os.kill(pid, signal.SIGSTOP)
    wait_event(run, "worker_dead", case.worker_timeout_s + 60, up, cell=case.target)
    os.kill(pid, signal.SIGCONT)


# --- the checks ----------------------------------------------------------------------------


def check_journal(run: Path, evs: list[dict], final_from: int, steps: int) -> dict:
    """The invariants every case keeps; `final_from`: the index of the final session's first
    event. Returns what the checks found (for the case's own assertions)."""
    summary = evs[-1]  # the final session's (a stopped session before it has its own)
    assert summary["event"] == "summary"
    final = evs[final_from:]
    resumes = [e for e in final if e["event"] == "resume"]
    execs = [e for e in evs if e["event"] == "execution" and e.get("group") is not None]

    # One status per execution: an id ends in exactly one execution event, or was dispatched
    # again (id-rN in a later dispatch of its group), or its group is pending at the end.
    per_id: dict[str, list[dict]] = {}
    for e in execs:
        per_id.setdefault(e["id"], []).append(e)
    assert all(len(v) == 1 for v in per_id.values()), {k: v for k, v in per_id.items() if len(v) > 1}
    dispatched = [(e["group"], r) for e in evs if e["event"] == "dispatch" for r in e["runs"]]
    all_ids = {r for _, r in dispatched}
    pending = set(summary["pending_groups"])
    for group, rid in dispatched:
        redone = any(x.startswith(rid + "-r") for x in all_ids)
        assert rid in per_id or redone or group in pending, f"{rid} (group {group}) has no end"

    # Counted steps: the last step event of each number (one redone after a resume replaces
    # the one lost with the model); 1..steps, each group trained in at most one of them.
    counted: dict[int, dict] = {}
    for e in evs:
        if e["event"] == "step":
            counted[e["step"]] = e
    assert sorted(counted) == list(range(1, steps + 1)) and summary["steps"] == steps
    trained = [g for s in counted.values() for g in s["group_ids"]]
    assert len(trained) == len(set(trained)), trained
    assert not set(trained) & pending

    # Nothing lost: every closed execution's group trained exactly once, pending or dropped.
    dropped = set(summary["dropped_groups"])
    for e in execs:
        if e["status"] != "cancelled":
            assert e["group"] in set(trained) | pending | dropped, e

    # No invalid reward trained: every valid outcome's reward finite and in range; a trained
    # group's outcomes all valid (min_valid = group_size) and never an invalid status.
    for e in execs:
        if e["valid"]:
            assert e["reward"] is not None and math.isfinite(e["reward"]), e
            assert REWARD_RANGE[0] <= e["reward"] <= REWARD_RANGE[1], e
            assert e["status"] not in INVALID_STATUSES, e
    last_dispatch = {e["group"]: e["runs"] for e in evs if e["event"] == "dispatch"}
    for g in trained:
        outcomes = [per_id[r][0] for r in last_dispatch[g] if r in per_id]
        assert len(outcomes) == 2 and all(o["valid"] and o["status"] not in INVALID_STATUSES for o in outcomes), \
            (g, outcomes)
    for s in counted.values():
        assert s["reward_mean"] is None or math.isfinite(s["reward_mean"])

    # The counters (waterlevel.py): 0 <= f <= p <= d; every launched execution ends once, so
    # at the end f == p (shutdown closes what runs); f counts this session's execution events
    # plus the closed executions a resume restored (launched and terminated at rebuild).
    c = summary["counters"]
    assert 0 <= c["f"] <= c["p"] <= c["d"], c
    assert c["f"] == c["p"], c
    final_execs = sum(1 for e in final if e["event"] == "execution" and e.get("group") is not None)
    restored = sum(r["executions_restored"] for r in resumes)
    assert c["f"] == final_execs + restored, (c, final_execs, restored)
    if not resumes:  # one session: every dispatched execution is counted once in d
        assert c["d"] == sum(len(e["runs"]) for e in final if e["event"] == "dispatch"), c
    assert sum(summary["statuses"].values()) == len(execs), (summary["statuses"], len(execs))
    return {"summary": summary, "counted": counted, "resumes": resumes, "execs": execs}


def one_line_error(up: Up, *words: str) -> str:
    errors = [x for x in up.lines if x and x.startswith("[error]")]
    assert len(errors) == 1 and all(w in errors[0] for w in words), up.output[-3000:]
    assert "Traceback" not in up.output, up.output[-3000:]
    return errors[0]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_fault_matrix(case: Case, tiny_dir, tmp_path):
    run = tmp_path / "run"
    cfg = write_config(tmp_path, tiny_dir, worker_timeout_s=case.worker_timeout_s, steps=case.steps,
                       checkpoint_every=case.checkpoint_every, workers=case.workers)
    up = Up([str(cfg), "--run-dir", str(run)])
    coordinators = [up.proc.pid]
    resumed: Up | None = None
    try:
        case.observed["status"] = at_phase(case, run, up)
        inject(case, run, up)
        code = up.wait(120 + 2 * case.worker_timeout_s)
        first = events(run)
        kept = check_first_session(case, up, code, run, first)
        # The stopped or finished run's workerds and harnesses are gone. A coordinator killed
        # with -9 cannot stop its harnesses (the process sandbox's deadline is the coordinator's
        # to enforce): they run on until a start-up on the run directory reaps them (below);
        # its workerds wait (worker_linger_s) for the resume, which takes them back.
        orphans = assert_nothing_left(run, coordinators,
                                      but={"sandbox", "workerd"} if case.fault == "coordinator-kill" else ())
        case.observed["orphans"] = sum(why == "sandbox" for _, why, _ in orphans)
        lingering = sorted(pid for pid, why, _ in orphans if why == "workerd")
        final_from = 0
        if case.restarts:
            final_from = journal_lines(run)
            resumed = Up(["--resume", str(run)])
            coordinators.append(resumed.proc.pid)
            assert resumed.wait(240) == 0, resumed.output[-3000:]
            assert "resuming" in resumed.output
            if case.fault == "coordinator-kill":  # the same workerds served the resume
                assert len(lingering) == 2 and sorted(json.loads(
                    (run / "workers.json").read_text())["pids"].values()) == lingering
            final_from = min(final_from, len(events(run)))  # a torn last line was cut
        evs = events(run)
        found = check_journal(run, evs, final_from, case.steps)
        assert_nothing_left(run, coordinators)
    finally:
        for u in (up, resumed):
            if u is not None:
                u.kill()
        if "stopped" in case.observed:
            try:
                os.kill(case.observed["stopped"], signal.SIGCONT)
            except OSError:
                pass

    summary, counted, resumes = found["summary"], found["counted"], found["resumes"]
    statuses = {e["status"] for e in found["execs"]}
    assert statuses <= {"completed", "timed_out", "cancelled"}, statuses  # no harness saw an error
    # The schedule is the uninterrupted run's (phi = 0, mu = 1: every step trains the groups
    # its publication dispatched, staleness 0), and the run ends with nothing left over.
    assert all(s["staleness"] == [0, 0] for s in counted.values()), {k: s["staleness"] for k, s in counted.items()}
    assert summary["pending_groups"] == [] and summary["dropped_groups"] == [], summary
    if case.restarts:
        (res,) = resumes
        assert res["step"] == kept and res["checkpoint"].endswith(f"step-{kept:06d}"), res
        if case.fault == "coordinator-kill":  # its workerds' trainers at step 1's version, or the core's a step on
            ahead = case.phase == "publication"
            assert res["checkpoint_loaded"] is ahead and (res["workers_kept"] < 2 if ahead else
                                                          res["workers_kept"] == 2), res
        cut = evs.index(res)
        assert [e["step"] for e in evs[cut:] if e["event"] == "step"] == list(range(kept + 1, case.steps + 1))
        # What was running when the session ended (killed, or cancelled at its stop) runs
        # again under new ids; a kill in rollout or training always leaves some.
        cancelled = sum(1 for e in first if e["event"] == "execution" and e["status"] == "cancelled")
        assert res["executions_redispatched"] >= cancelled, res
        if case.phase != "publication" and (case.fault.startswith("coordinator") or case.stops):
            assert res["executions_redispatched"] > 0, res
    else:
        assert not resumes
        deaths = [e for e in evs if e["event"] == "worker_dead"]
        assert [e["cell"] for e in deaths] == [case.target]
        rejoined = [e for e in evs if e["event"] == "worker_rejoined"]
        if case.fault == "workerd-kill":
            assert summary["dead_cells"] == [case.target] and not rejoined
        else:  # continued once declared dead: asked to register again, back as a rollout cell
            assert [e["cell"] for e in rejoined] == [case.target], rejoined
            assert summary["dead_cells"] == [] and summary["rejoined_cells"] == [case.target]
    if case.phase == "publication" and not case.restarts:
        # The fault met step 2's publication in flight: it completed only after the death.
        (pub,) = [e for e in evs if e["event"] == "publish" and e["version"] == counted[AT_STEP]["version"]]
        (dead,) = [e for e in evs if e["event"] == "worker_dead"]
        assert counted[AT_STEP]["t"] < dead["t"] <= pub["t"], (counted[AT_STEP], dead, pub)
    if case.phase == "publication" and case.fault == "coordinator-kill":
        lost = [e for e in evs[:evs.index(resumes[0])] if e["event"] == "publish"]
        assert [p["version"] for p in lost] == list(range(1, AT_STEP))  # step 2's never completed


def check_first_session(case: Case, up: Up, code: int, run: Path, first: list[dict]) -> int:
    """How the session the fault hit ended; returns the step of the checkpoint it left."""
    latest = run / "checkpoints" / "latest"
    kept = int(latest.read_text().strip().split("-")[1])
    summaries = [e for e in first if e["event"] == "summary"]
    if case.fault == "coordinator-kill":
        assert code == -signal.SIGKILL and not summaries
        assert kept == AT_STEP - 1  # step 2's checkpoint comes after its publication
    elif case.stops:
        # A stop: exit 128 + 15 (or 2), the resume command printed, every trained step kept (a
        # step in flight given up, its groups back in the pipeline), nothing of the stop
        # mistaken for a failure: the executions it cancelled leave their groups pending,
        # none dropped and none replaced.
        assert code == (143 if case.fault == "coordinator-term" else 130), up.output[-3000:]
        assert f"continue with: gyre up --resume {run}" in up.output
        assert not [x for x in up.lines if x and x.startswith("[error]")] and "Traceback" not in up.output
        (summary,) = summaries
        assert kept == summary["steps"] == (AT_STEP if case.phase == "publication" else AT_STEP - 1)
        assert summary["dropped_groups"] == [] and not stop_dispatches(first), summary
    elif case.core_dies:
        # The core dying stops the run, by design: one line naming it, exit 1, no
        # traceback; the checkpoint kept is step 1's (the dead core saves nothing).
        assert code == 1, up.output[-3000:]
        one_line_error(up, "the core (cell 0", "died")
        assert [e["cell"] for e in first if e["event"] == "worker_dead"] == [0]
        assert kept == AT_STEP - 1
        (summary,) = summaries
        assert summary["steps"] == AT_STEP - 1 and summary["dead_cells"] == [0]
        assert summary["dropped_groups"] == [] and not stop_dispatches(first), summary
    else:
        assert code == 0, up.output[-3000:]
    return kept


def stop_dispatches(evs: list[dict]) -> list[dict]:
    """Groups dispatched once the stop began cancelling executions (nothing else cancels here:
    no oversampling, so no surplus)."""
    cancels = [e["t"] for e in evs if e["event"] == "execution" and e["status"] == "cancelled"]
    return [e for e in evs if e["event"] == "dispatch" and cancels and e["t"] >= min(cancels)]


# --- the core killed between two of its calls: a send that fails at once ------------------


@pytest.mark.timeout(180)
async def test_the_core_killed_between_its_calls_is_reported_as_its_death(tiny_dir, tmp_path, monkeypatch):
    """The matrix's `workerd-kill-training-cell0`, deterministic: the core is killed just
    before the step's first call to it (its weights' export), and the link knows it is gone
    (ZeroMQ's ROUTER_MANDATORY: the send fails at once, EHOSTUNREACH) long before its
    silence would say so. The run must stop as for any death of the core: the error names
    it, `worker_dead` is journaled, the summary counts cell 0 dead. (It stopped with the
    bare send error, `node local-0 unreachable: Host unreachable`, nothing journaled: the
    tick raised the step's failure before its health watch read the link.)"""
    import zmq

    from gyre.coordinator.config import CoordinatorConfig
    from gyre.coordinator.link import WorkerDeadError, WorkerLink
    from gyre.coordinator.main import Coordinator
    from gyre.workerd import wire

    tasks = tmp_path / "fast.jsonl"
    tasks.write_text(json.dumps({"id": "fast", "prompt": "mode:normal fast",
                                 "evaluator": {"type": "command", "argv": EVAL}}) + "\n")
    config = CoordinatorConfig(run_dir=tmp_path / "run", model_dir=tiny_dir, steps=1, groups_per_step=1,
                               group_size=2, min_valid=2, harness=tuple(HARNESS), tasks_path=tasks,
                               worker_timeout_s=60.0, default_max_tokens=8, checkpoint_every=0)  # silence: a minute
    coord = Coordinator(config)
    killed: list[str] = []
    send = WorkerLink.send

    async def send_after_killing_the_core(self, node, msg, tensors=None, force=False):
        step_call = isinstance(msg, (wire.ExportWeights, wire.TrainMicroStep, wire.SetParticipants,
                                     wire.OptimizerStep))
        if step_call and not killed and node == coord.cells.nodes[0]:
            killed.append(type(msg).__name__)
            proc = coord.cluster.procs[0]
            proc.kill()
            await asyncio.wait_for(proc.wait(), 30)
            end = time.monotonic() + 30
            while time.monotonic() < end:  # until ZeroMQ has dropped the dead connection
                try:
                    await self._sock.send_multipart([node.encode(), b"probe"])
                except zmq.ZMQError:
                    break
                await asyncio.sleep(0.01)
        await send(self, node, msg, tensors, force)

    monkeypatch.setattr(WorkerLink, "send", send_after_killing_the_core)
    with pytest.raises(WorkerDeadError, match=r"the core \(cell 0, local-0\) died"):
        await coord.run()
    assert killed == ["ExportWeights"]
    evs = events(config.run_dir)
    assert [(e["cell"], e["node"]) for e in evs if e["event"] == "worker_dead"] == [(0, "local-0")]
    assert evs[-1]["event"] == "summary" and evs[-1]["dead_cells"] == [0]
