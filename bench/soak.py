"""bench/soak.py: a bounded soak of a real `gyre up` beside a hostile neighbour.

The embedded default (tiny model, demo harness, two spawned workerds, CPU engine and
trainer) runs with an unreachable step count for `--minutes`, then gets SIGTERM. Beside it,
unless `--no-hostile`, a local process does what a careless or hostile neighbour would:
- junk HTTP to the proxy: no key, a made-up key, malformed JSON, a wrong Content-Encoding,
  unknown paths (each must be a 4xx; a 5xx is counted and fails the soak);
- slowloris: `--slow-conns` connections that send a header line every few seconds and never
  finish (the proxy's header deadline must close them; fds must stay bounded);
- the worker port: a keyless ZeroMQ DEALER sending garbage and forged heartbeats (dropped,
  counted by the link; the workers' calls must go on).
Every `--interval` seconds it samples the coordinator (RSS, open fds, threads), the
workerds' RSS, the processes of the run, the run directory's size, and from /gyre/status
the steps, executions, calls in flight and the event loop's lateness. At the end it checks
what must hold after any stop: exit 143 with the resume command printed, no traceback, one
execution event per execution, the counters' identities (f == p <= d), no 5xx, nothing of
the run left running. It prints the table and the ratios of the last quarter to the first
(after `--warmup`): a leak shows as a ratio that grows with the soak's length.
Run:
    python bench/soak.py [--minutes M] [--interval S] [--slow-conns N] [--no-hostile] [--json PATH]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

PAGE = os.sysconf("SC_PAGE_SIZE")


# --- the run -------------------------------------------------------------------------------


class Up:
    """`gyre up` as a subprocess; its output kept (read on a thread)."""

    def __init__(self, run: Path, extra: list[str]):
        argv = [sys.executable, "-m", "gyre.cli", "up", "--no-live", "--steps", "1000000", "--run-dir", str(run),
                *extra]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))


def status(run: Path) -> dict | None:
    try:
        url = json.loads((run / "coordinator.json").read_text())["status_url"]
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.loads(r.read())
    except (OSError, ValueError, KeyError):
        return None


# --- /proc ---------------------------------------------------------------------------------


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def rss_mb(pid: int) -> float | None:
    fields = _read(f"/proc/{pid}/statm").split()
    return int(fields[1]) * PAGE / 2**20 if fields else None


def fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def threads(pid: int) -> int | None:
    for line in _read(f"/proc/{pid}/status").splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return None


def cmdline(pid: int | str) -> list[str]:
    return _read(f"/proc/{pid}/cmdline").split("\0")


def of_run(run: Path, coordinator: int) -> dict[int, str]:
    """Live processes of the run, {pid: kind}: the coordinator's workerds (by --parent-pid) and
    anything naming the run directory in its command line or environment (harnesses)."""
    found, root = {}, str(run)
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in (os.getpid(), coordinator):
            continue
        argv = cmdline(entry)
        if "workerd" in argv and "--parent-pid" in argv and argv[argv.index("--parent-pid") + 1] == str(coordinator):
            found[int(entry)] = "workerd"
        elif any(root in a for a in argv):
            found[int(entry)] = "harness"
        else:
            try:
                env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"GYRE_SANDBOX_RUN_DIR={root}".encode() in env:
                found[int(entry)] = "harness"
    return found


def du_mb(folder: Path) -> float:
    total = 0
    for base, _, files in os.walk(folder):
        for f in files:
            try:
                total += os.lstat(os.path.join(base, f)).st_size
            except OSError:
                pass
    return total / 2**20


# --- the neighbour -------------------------------------------------------------------------


JUNK = [  # (method, path, headers, body)
    ("POST", "/v1/chat/completions", {"Content-Type": "application/json"}, b'{"model": "x", "messages": []}'),
    ("POST", "/v1/messages", {"x-api-key": "sk-made-up", "Content-Type": "application/json"}, b'{"model":'),
    ("POST", "/v1/messages", {"x-api-key": "sk-made-up", "Content-Encoding": "gzip"}, b"not gzip at all"),
    ("POST", "/v1/responses", {"Authorization": "Bearer nope", "Content-Type": "application/json"}, b"[1, 2, 3]"),
    ("GET", "/v1/nothing-here", {}, b""),
    ("DELETE", "/v1/chat/completions", {}, b""),
    ("POST", "/v1/messages/count_tokens", {"x-api-key": "k", "Content-Encoding": "br"}, b"\x00" * 64),
]


class Neighbour:
    def __init__(self, host: str, port: int, zmq_address: str | None, slow_conns: int):
        self.host, self.port, self.zmq_address, self.slow_conns = host, port, zmq_address, slow_conns
        self.stop = threading.Event()
        self.http = Counter()  # status class -> count ("5xx" fails the soak)
        self.slow = Counter()  # opened, closed_by_server, refused
        self.zmq_sent = 0
        self.threads = [threading.Thread(target=f, daemon=True) for f in (self._junk, self._slowloris, self._zmq)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)

    def _junk(self) -> None:
        rng = random.Random(0)
        while not self.stop.wait(0.05):
            method, path, headers, body = rng.choice(JUNK)
            try:
                conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
                conn.request(method, path, body=body or None, headers=headers)
                code = conn.getresponse().status
                conn.close()
                self.http[f"{code // 100}xx"] += 1
                self.http[str(code)] += 1
            except OSError as e:
                self.http[f"error:{type(e).__name__}"] += 1

    def _slowloris(self) -> None:
        conns: list[socket.socket] = []
        while not self.stop.is_set():
            while len(conns) < self.slow_conns and not self.stop.is_set():
                try:
                    s = socket.create_connection((self.host, self.port), timeout=5)
                    s.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\n")
                    s.setblocking(False)
                    conns.append(s)
                    self.slow["opened"] += 1
                except OSError:
                    self.slow["refused"] += 1
                    break
            alive = []
            for s in conns:
                try:
                    if s.recv(4096, socket.MSG_PEEK) == b"":  # the server closed it
                        raise ConnectionResetError
                except BlockingIOError:
                    pass
                except OSError:
                    self.slow["closed_by_server"] += 1
                    s.close()
                    continue
                try:
                    s.send(b"X-Slow: 1\r\n")  # one more header line, never the end of them
                    alive.append(s)
                except OSError:
                    self.slow["closed_by_server"] += 1
                    s.close()
            conns = alive
            self.stop.wait(3)
        for s in conns:
            s.close()

    def _zmq(self) -> None:
        if self.zmq_address is None:
            return
        import zmq

        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 1000)
        sock.connect(self.zmq_address)
        rng = random.Random(1)
        try:
            while not self.stop.wait(0.002):
                if rng.random() < 0.5:
                    msg = [b"Heartbeat", json.dumps({"node_id": "local-0", "t": time.time()}).encode()]
                else:
                    msg = [rng.randbytes(rng.randrange(1, 32)), rng.randbytes(rng.randrange(0, 4096))]
                try:
                    sock.send_multipart(msg, flags=zmq.NOBLOCK)
                    self.zmq_sent += 1
                except zmq.Again:
                    pass
        finally:
            sock.close(0)
            ctx.term()


def worker_address(coordinator: int) -> str | None:
    """The coordinator's worker port, read off a workerd's command line."""
    for entry in os.listdir("/proc"):
        argv = cmdline(entry) if entry.isdigit() else []
        if "workerd" in argv and "--parent-pid" in argv and argv[argv.index("--parent-pid") + 1] == str(coordinator):
            return argv[argv.index("--coordinator") + 1]
    return None


# --- the soak ------------------------------------------------------------------------------


def sample(run: Path, pid: int, t0: float, neighbour: Neighbour | None) -> dict:
    s = status(run) or {}
    procs = of_run(run, pid)
    lag = s.get("loop_lag_ms") or {}
    return {
        "t_s": round(time.monotonic() - t0, 1), "steps": s.get("steps", {}).get("done"),
        "executions": s.get("waterlevel", {}).get("finished"), "calls_in_flight": s.get("calls", {}).get("in_flight"),
        "lag_p99_ms": lag.get("p99"), "lag_max_ms": lag.get("max"),
        "coord_rss_mb": rss_mb(pid), "coord_fds": fds(pid), "coord_threads": threads(pid),
        "workerd_rss_mb": sum(rss_mb(p) or 0 for p, k in procs.items() if k == "workerd"),
        "harnesses": sum(1 for k in procs.values() if k == "harness"), "run_dir_mb": du_mb(run),
        "http_4xx": neighbour.http["4xx"] if neighbour else 0, "http_5xx": neighbour.http["5xx"] if neighbour else 0,
        "slow_closed": neighbour.slow["closed_by_server"] if neighbour else 0,
        "zmq_sent": neighbour.zmq_sent if neighbour else 0,
    }


def check_journal(run: Path) -> list[str]:
    """What must hold in metrics.jsonl after the stop; returns the failures."""
    from gyre.coordinator.metrics import read_events

    read = read_events(run / "metrics.jsonl", warn=True)
    evs = read.events
    fails = [f"metrics.jsonl lines {list(read.mid[:5])} are not whole events"] if read.mid else []
    ids = Counter(e["id"] for e in evs if e["event"] == "execution")
    if twice := [i for i, n in ids.items() if n > 1]:
        fails.append(f"executions ended twice: {twice[:5]}")
    summary = evs[-1] if evs and evs[-1]["event"] == "summary" else None
    if summary is None:
        return [*fails, "no summary event at the end of metrics.jsonl"]
    c = summary["counters"]
    if not (0 <= c["f"] == c["p"] <= c["d"]):
        fails.append(f"counters {c}: every launched execution must end once (f == p <= d)")
    if summary["dropped_groups"]:
        fails.append(f"groups dropped: {summary['dropped_groups']}")
    return fails


def fmt(v) -> str:
    if v is None:
        return "n/a"
    return f"{v:.1f}" if isinstance(v, float) else str(v)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--interval", type=float, default=30.0, help="seconds between samples")
    ap.add_argument("--warmup", type=float, default=60.0, help="seconds before the baseline sample")
    ap.add_argument("--slow-conns", type=int, default=256)
    ap.add_argument("--no-hostile", action="store_true")
    ap.add_argument("--run-dir", type=Path, default=None, help="default: a temporary folder, kept")
    ap.add_argument("--set", action="append", default=[], help="FIELD=VALUE for gyre up")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()

    run = a.run_dir or Path(tempfile.mkdtemp(prefix="gyre-soak-")) / "run"
    up = Up(run, [x for kv in a.set for x in ("--set", kv)])
    pid, t0, fails = up.proc.pid, time.monotonic(), []
    while status(run) is None:
        if up.proc.poll() is not None:
            print("\n".join(up.lines[-40:]))
            print(f"FAIL: gyre up ended (exit {up.proc.returncode}) before it served")
            return 1
        time.sleep(0.5)
    proxy = status(run)["proxy"].removeprefix("http://")
    host, port = proxy.rsplit(":", 1)
    neighbour = None
    if not a.no_hostile:
        neighbour = Neighbour(host, int(port), worker_address(pid), a.slow_conns)
        neighbour.start()
    print(f"soak: {run}, {a.minutes:g} min, hostile={'no' if a.no_hostile else 'yes'}; "
          f"sampling every {a.interval:g} s", flush=True)
    cols = ["t_s", "steps", "executions", "calls_in_flight", "lag_p99_ms", "lag_max_ms", "coord_rss_mb", "coord_fds",
            "coord_threads", "workerd_rss_mb", "harnesses", "run_dir_mb", "http_4xx", "http_5xx", "slow_closed",
            "zmq_sent"]
    print(" ".join(f"{c:>14}" for c in cols), flush=True)
    rows, end = [], t0 + a.minutes * 60
    while time.monotonic() < end and up.proc.poll() is None:
        time.sleep(min(a.interval, max(0.0, end - time.monotonic())))
        row = sample(run, pid, t0, neighbour)
        rows.append(row)
        print(" ".join(f"{fmt(row[c]):>14}" for c in cols), flush=True)
    if up.proc.poll() is not None:
        fails.append(f"gyre up ended by itself (exit {up.proc.returncode}) before the soak's end")
    if neighbour is not None:
        neighbour.close()
    up.proc.send_signal(signal.SIGTERM)
    t_stop = time.monotonic()
    try:
        code = up.proc.wait(300)
    except subprocess.TimeoutExpired:
        up.proc.kill()
        code = up.proc.wait()
        fails.append("gyre up did not stop within 300 s of SIGTERM")
    stop_s = time.monotonic() - t_stop
    time.sleep(1)  # a moment for the last harness's exit to show in /proc (a measurement, not a handshake)
    output = "\n".join(up.lines)
    if code != 143:
        fails.append(f"exit {code} after SIGTERM, expected 143")
    if f"gyre up --resume {run}" not in output:
        fails.append("no resume command printed")
    if "Traceback" in output:
        fails.append("a traceback in gyre up's output")
    if left := of_run(run, pid):
        fails.append(f"left running: {left}")
    fails += check_journal(run)
    if neighbour is not None and neighbour.http["5xx"]:
        fails.append(f"{neighbour.http['5xx']} 5xx answers to junk")

    base = [r for r in rows if r["t_s"] >= a.warmup] or rows
    q = max(1, len(base) // 4)
    first, last = base[:q], base[-q:]

    def mean(rs, k):
        vals = [r[k] for r in rs if r[k] is not None]
        return sum(vals) / len(vals) if vals else None

    def rate(rs, k):  # per minute over the rows' span
        if len(rs) < 2 or rs[0][k] is None or rs[-1][k] is None or rs[-1]["t_s"] <= rs[0]["t_s"]:
            return None
        return (rs[-1][k] - rs[0][k]) * 60 / (rs[-1]["t_s"] - rs[0]["t_s"])

    half = len(base) // 2
    ratios = {}
    for k in ("coord_rss_mb", "coord_fds", "coord_threads", "workerd_rss_mb", "lag_p99_ms"):
        f, la = mean(first, k), mean(last, k)
        ratios[k] = None if not f or la is None else round(la / f, 3)
    for k in ("steps", "executions"):
        f, la = rate(base[: half + 1], k), rate(base[half:], k)
        ratios[f"{k}_per_min"] = None if not f or la is None else round(la / f, 3)
    print(f"\nlast quarter / first quarter (after {a.warmup:g} s): "
          + ", ".join(f"{k} {fmt(v)}" for k, v in ratios.items()))
    if neighbour is not None:
        print(f"neighbour: http {dict(neighbour.http)}; slowloris {dict(neighbour.slow)}; "
              f"zmq messages sent {neighbour.zmq_sent}")
    print(f"stop: exit {code} in {stop_s:.1f} s")
    for f in fails:
        print(f"FAIL: {f}")
    if not fails:
        print("OK: every check held")
    if a.json:
        a.json.write_text(json.dumps({"run_dir": str(run), "rows": rows, "ratios": ratios, "exit": code,
                                      "stop_s": stop_s, "fails": fails,
                                      "neighbour": None if neighbour is None else {
                                          "http": dict(neighbour.http), "slowloris": dict(neighbour.slow),
                                          "zmq_sent": neighbour.zmq_sent}}, indent=2))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
