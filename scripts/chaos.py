#!/usr/bin/env python3
"""Chaos run: several ``sandcell serve`` workers on one Redis and one S3, turns under faults.

W workers (local provider) share a redis-server (AOF on) and a moto S3 server.
M sessions take turns round-robin, each sent to the next worker; a turn appends
its own numbered line to ``log`` in the session and prints the file back. Each
turn carries an ``Idempotency-Key``; a client retries on connection errors,
timeouts and retryable answers, against the other workers, until it has an
answer (acknowledged) or gives the turn up. Between turns, at random, a fault:

    kill_worker    SIGKILL a worker, start it again (same home and port)
    kill_runner    SIGKILL a runner process (a sandbox) of some worker
    *_mid_turn     the same, 0-300 ms into the next turn (whatever stage it is at)
    stop_worker    SIGSTOP a worker for --stop-s, SIGCONT it (turns sent to it hang)
    restart_redis  SIGTERM redis-server and start it again on its AOF
    stop_s3        stop the S3 endpoint for --s3-outage-s while turns go on
    wipe_redis     SIGKILL redis-server and start it again empty (persistence lost:
                   generations must still never go backwards)

Invariants, checked at every acknowledged turn and at the end:

    lost        an acknowledged line missing from a later turn's file
    duplicated  a line present twice (a turn applied twice)
    empty       a turn that saw none of the session's earlier acknowledged lines
    leftovers   runner processes alive after the sessions were deleted and the
                workers stopped

``--bounded`` is the mode the test suite runs (tests/orchestrator/serve/test_chaos.py): small
numbers and a wall-clock budget. Prints one JSON report; exit 1 if an invariant
broke. Stops only the processes it started (by pid / process group).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
import httpx
import psutil
from moto.server import ThreadedMotoServer

KEY = "chaos-key-0123456789abcdef"
BUCKET = "sandcell-chaos"
S3_ACCESS, S3_SECRET = "chaos-access", "chaos-secret-0123456789"
FAULTS = (
    "kill_worker",
    "kill_runner",
    "stop_worker",
    "restart_redis",
    "wipe_redis",
    "stop_s3",
    "kill_worker_mid_turn",
    "kill_runner_mid_turn",
)
# These strike the next turn a random 0-300 ms after it was sent: while its
# sandbox launches or restores, while it executes, while its checkpoint uploads,
# or before its record is written (a strike that comes after a quick turn ended
# hits the idle worker or runner instead).
MID_TURN = ("kill_worker_mid_turn", "kill_runner_mid_turn")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(check: Any, *, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if check():
                return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not come up in {timeout_s:g} s")


class Redis:
    """redis-server with its AOF on, restartable on the same port and directory."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (scripts/test installs it)")
        argv = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        argv += ["--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.workdir)]
        self.process = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        wait_for(self._ping, timeout_s=15, what="redis-server")

    def _ping(self) -> bool:
        with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=15)
        self.process = None

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=15)
        self.process = None


@dataclass
class Worker:
    index: int
    home: Path
    runtime_dir: Path
    port: int
    env: dict[str, str]
    log: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "sandcell_orchestrator", "serve"],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        process = self.process
        wait_for(
            lambda: (
                process.poll() is None
                and httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200
            ),
            timeout_s=60,
            what=f"worker {self.index}",
        )

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGCONT)
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


@dataclass
class Session:
    hint: str
    acked: list[str] = field(default_factory=list)
    given_up: list[str] = field(default_factory=list)


@dataclass
class Report:
    turns: int = 0
    acknowledged: int = 0
    given_up: int = 0
    first_try: int = 0
    faults: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAULTS, 0))
    lost: int = 0
    duplicated: int = 0
    empty: int = 0
    leftovers: int = 0
    answers: dict[str, int] = field(default_factory=dict)
    latencies_s: list[float] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    timeline: list[str] = field(default_factory=list)
    lost_turns: set[str] = field(default_factory=set)

    def summary(self, wall_s: float) -> dict[str, Any]:
        lat = sorted(self.latencies_s)

        def pct(p: float) -> float | None:
            return round(lat[min(len(lat) - 1, int(p * len(lat)))], 3) if lat else None

        return {
            "wall_s": round(wall_s, 1),
            "turns": self.turns,
            "acknowledged": self.acknowledged,
            "given_up": self.given_up,
            "first_try_share": round(self.first_try / self.turns, 3) if self.turns else None,
            "faults": self.faults,
            "faults_total": sum(self.faults.values()),
            "lost": self.lost,
            "lost_turns": sorted(self.lost_turns),
            "duplicated": self.duplicated,
            "empty_workspace": self.empty,
            "leftovers": self.leftovers,
            "answers": self.answers,
            "latency_p50_s": pct(0.5),
            "latency_p99_s": pct(0.99),
            "latency_mean_s": round(statistics.fmean(lat), 3) if lat else None,
            "problems": self.problems[:20],
            "timeline": self.timeline,
            "ok": self.lost == self.duplicated == self.empty == self.leftovers == 0,
        }


class Chaos:
    def __init__(self, args: argparse.Namespace, base: Path) -> None:
        self.args = args
        self.base = base
        self.rng = random.Random(args.seed)
        self.report = Report(faults=dict.fromkeys(args.kinds, 0))
        self.redis = Redis(base / "redis")
        self.s3_port = free_port()
        self.s3 = ThreadedMotoServer(ip_address="127.0.0.1", port=self.s3_port, verbose=False)
        self.workers: list[Worker] = []
        self.sessions = [
            Session(hint=f"chaos-{n}-{uuid.uuid4().hex[:6]}") for n in range(args.sessions)
        ]
        self._stopped: set[int] = set()
        self._mid_turn: str | None = None
        self._strikes: list[threading.Timer] = []

    # -- set-up -------------------------------------------------------------------

    def start(self) -> None:
        (self.base / "redis").mkdir()
        self.redis.start()
        self.s3.start()
        endpoint = f"http://127.0.0.1:{self.s3_port}"
        client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id=S3_ACCESS,
            aws_secret_access_key=S3_SECRET,
            region_name="us-east-1",
        )
        client.create_bucket(Bucket=BUCKET)
        client.close()
        shared = {k: v for k, v in os.environ.items() if not k.startswith("SANDCELL_")} | {
            "SANDCELL_REGISTRY_URL": self.redis.url,
            "SANDCELL_SNAPSHOT_URL": f"s3://{BUCKET}/chaos",
            "SANDCELL_S3_ENDPOINT": endpoint,
            "SANDCELL_S3_ACCESS_KEY": S3_ACCESS,
            "SANDCELL_S3_SECRET_KEY": S3_SECRET,
            "SANDCELL_API_KEYS": f"{KEY}=chaos",
            "SANDCELL_IDEMPOTENCY_CLAIM_TTL_S": str(self.args.claim_ttl_s),
            # The session lock's TTL is 1.5x the sum of these budgets, and a worker
            # killed mid-turn blocks its session until the lock expires: small
            # budgets (the turns are tiny) keep that wait to ~11 s, not ~12 min.
            "SANDCELL_LAUNCH_TIMEOUT_S": "3",
            "SANDCELL_HEALTH_TIMEOUT_S": "1",
            "SANDCELL_EXECUTE_TIMEOUT_S": "1.5",
            "SANDCELL_CHECKPOINT_TIMEOUT_S": "2",
        }
        for n in range(self.args.workers):
            root = self.base / f"w{n}"
            root.mkdir(mode=0o711)
            port = free_port()
            env = shared | {
                "SANDCELL_HOME": str(root / "home"),
                "SANDCELL_LOCAL_RUNTIME_DIR": str(root / "sandboxes"),
                "SANDCELL_SERVE_PORT": str(port),
            }
            worker = Worker(n, root / "home", root / "sandboxes", port, env, root / "serve.log")
            worker.start()
            self.workers.append(worker)

    def close(self) -> None:
        for strike in self._strikes:
            strike.join()
        with httpx.Client(timeout=30) as client:
            for session in self.sessions:
                sid = self._session_id(session)
                for worker in self.workers:
                    with contextlib.suppress(httpx.HTTPError):
                        response = client.delete(
                            f"{worker.url}/v1/sessions/{sid}", headers=self._auth()
                        )
                        if response.status_code in (204, 404):
                            break
        for worker in self.workers:
            worker.stop()
        time.sleep(0.5)
        left = [p for p in self._runners() if p.is_running()]
        self.report.leftovers = len(left)
        if left:
            self.report.problems.append(f"{len(left)} runner process(es) left behind")
        for process in left:
            with contextlib.suppress(psutil.Error):
                process.send_signal(signal.SIGKILL)
        psutil.wait_procs(left, timeout=10)
        self.redis.stop()
        with contextlib.suppress(Exception):
            self.s3.stop()

    def _session_id(self, session: Session) -> str:
        from sandcell_protocol import runtime_session_id

        return runtime_session_id("chaos", "u", session.hint)

    @staticmethod
    def _auth() -> dict[str, str]:
        return {"Authorization": f"Bearer {KEY}"}

    def _runners(self) -> list[psutil.Process]:
        """Runner and jail processes of every worker (never a worker itself)."""
        mine = {w.process.pid for w in self.workers if w.process is not None}
        found = []
        for process in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if process.pid in mine or process.status() == psutil.STATUS_ZOMBIE:
                    continue
                if str(self.base) in " ".join(process.cmdline()):
                    found.append(process)
        return found

    # -- faults -------------------------------------------------------------------

    def fault(self, kind: str) -> None:
        self.report.faults[kind] += 1
        self.report.timeline.append(f"after t{self.report.turns - 1}: {kind}")
        if kind in MID_TURN:
            self._mid_turn = kind
        elif kind == "kill_worker":
            worker = self.rng.choice(self.workers)
            worker.kill()
            worker.start()
        elif kind == "kill_runner":
            runners = self._runners()
            if runners:
                victim = self.rng.choice(runners)
                with contextlib.suppress(psutil.Error):
                    victim.send_signal(signal.SIGKILL)
        elif kind == "stop_worker":
            worker = self.rng.choice([w for w in self.workers if w.index not in self._stopped])
            assert worker.process is not None
            worker.process.send_signal(signal.SIGSTOP)
            self._stopped.add(worker.index)
            threading.Timer(self.args.stop_s, self._resume, args=(worker,)).start()
        elif kind == "restart_redis":
            self.redis.stop()
            self.redis.start()
        elif kind == "stop_s3":
            # moto keeps its buckets in this process: a restarted endpoint serves them.
            self.s3.stop()
            restart = threading.Timer(self.args.s3_outage_s, self.s3.start)
            restart.start()
            self._strikes.append(restart)
        elif kind == "wipe_redis":
            self.redis.kill()
            for leftover in self.redis.workdir.iterdir():
                if leftover.is_dir():
                    shutil.rmtree(leftover)
                else:
                    leftover.unlink()
            self.redis.start()

    def _strike(self, kind: str, worker: Worker) -> None:
        """A mid-turn fault, from a timer thread, on the worker the turn went to."""
        if kind == "kill_worker_mid_turn":
            worker.kill()
            try:
                worker.start()
            except RuntimeError as exc:
                self.report.problems.append(f"restart after a mid-turn kill: {exc}")
            return
        runners = [p for p in self._runners() if str(worker.runtime_dir) in " ".join(p.cmdline())]
        for victim in runners:
            with contextlib.suppress(psutil.Error):
                victim.send_signal(signal.SIGKILL)

    def _resume(self, worker: Worker) -> None:
        if worker.process is not None and worker.process.poll() is None:
            worker.process.send_signal(signal.SIGCONT)
        self._stopped.discard(worker.index)

    # -- turns --------------------------------------------------------------------

    def turn(self, step: int, client: httpx.Client) -> None:
        session = self.sessions[step % len(self.sessions)]
        line = f"t{step}"
        code = f"open('log', 'a').write({line!r} + '\\n')\nprint(open('log').read(), end='')"
        body = {
            "language": "python",
            "user_id": "u",
            "runtime_session_hint": session.hint,
            "code": code,
        }
        headers = self._auth() | {"Idempotency-Key": f"turn-{uuid.uuid4().hex}"}
        started = time.monotonic()
        deadline = started + self.args.turn_deadline_s
        attempt = 0
        self.report.turns += 1
        while time.monotonic() < deadline:
            worker = self.workers[(step + attempt) % len(self.workers)]
            attempt += 1
            if attempt == 1 and self._mid_turn is not None:
                delay_s = self.rng.uniform(0.0, 0.3)
                strike = threading.Timer(delay_s, self._strike, args=(self._mid_turn, worker))
                strike.start()
                self._strikes.append(strike)
                self._mid_turn = None
            try:
                response = client.post(f"{worker.url}/v1/exec", json=body, headers=headers)
            except httpx.HTTPError as exc:
                self._count(type(exc).__name__)
                time.sleep(0.2)
                continue
            code = ""
            if response.status_code >= 400:
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    code = " " + str(response.json()["error"]["code"])
            self._count(f"{response.status_code}{code}")
            if response.status_code == 200:
                self.report.latencies_s.append(time.monotonic() - started)
                if attempt == 1:
                    self.report.first_try += 1
                if attempt > 1:
                    self.report.timeline.append(f"t{step}: acknowledged on attempt {attempt}")
                self.check(session, line, response.json()["stdout"].splitlines())
                return
            if response.status_code == 422:
                self.report.problems.append(f"{line}: 422 on a retry with its own key")
                break
            if response.status_code == 500:
                self.report.problems.append(f"{line}: 500 {response.text[:160]}")
            retry_after = float(response.headers.get("retry-after", "0.3") or 0.3)
            time.sleep(min(retry_after, 1.0))
        self.report.given_up += 1
        session.given_up.append(line)

    def _count(self, answer: str) -> None:
        self.report.answers[answer] = self.report.answers.get(answer, 0) + 1

    def check(self, session: Session, line: str, seen: list[str]) -> None:
        self.report.acknowledged += 1
        counts: dict[str, int] = {}
        for entry in seen:
            counts[entry] = counts.get(entry, 0) + 1
        duplicated = [entry for entry, n in counts.items() if n > 1]
        if duplicated:
            self.report.duplicated += len(duplicated)
            self.report.problems.append(f"{line}: applied twice: {duplicated}")
        lost = [entry for entry in session.acked if entry not in counts]
        if lost:
            self.report.lost += len(lost)
            self.report.lost_turns.update(lost)
            self.report.problems.append(f"{line}: lost acknowledged {lost}")
            if len(lost) == len(session.acked):
                self.report.empty += 1
        if counts.get(line) != 1:
            self.report.problems.append(f"{line}: its own line is not in its answer once")
            self.report.lost += 1
        expected = [e for e in seen if e in session.acked or e in session.given_up or e == line]
        if expected != seen:
            self.report.problems.append(f"{line}: lines from nowhere: {seen}")
        session.acked.append(line)

    def run(self) -> dict[str, Any]:
        begun = time.monotonic()
        budget_end = begun + self.args.budget_s
        faults_due = self.args.faults
        next_kind = 0
        with httpx.Client(timeout=self.args.request_timeout_s) as client:
            step = 0
            while step < self.args.turns and time.monotonic() < budget_end:
                self.turn(step, client)
                step += 1
                left = self.args.turns - step
                if faults_due and self.rng.random() < faults_due / max(left, 1) * 1.5:
                    # One fault at a time: a mid-turn strike still restarting a
                    # worker must not race the next fault.
                    for strike in self._strikes:
                        strike.join()
                    kinds = self.args.kinds
                    kind = kinds[next_kind % len(kinds)]
                    if kind == "stop_worker" and len(self._stopped) >= len(self.workers) - 1:
                        continue
                    next_kind += 1
                    self.fault(kind)
                    faults_due -= 1
            # A last turn per session reads everything acknowledged back.
            for n, _session in enumerate(self.sessions):
                self.turn(step + n, client)
        return self.report.summary(time.monotonic() - begun)


def main(argv: list[str] | None = None) -> int:
    """Run once; the JSON report on stdout; 0 if every invariant held."""
    # moto's server logs every request through werkzeug.
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--bounded", action="store_true", help="the test suite's small run")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--turns", type=int, default=1000)
    parser.add_argument("--faults", type=int, default=400)
    parser.add_argument("--budget-s", type=float, default=3600.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop-s", type=float, default=4.0)
    parser.add_argument("--claim-ttl-s", type=float, default=3.0)
    parser.add_argument("--s3-outage-s", type=float, default=10.0)
    parser.add_argument("--request-timeout-s", type=float, default=15.0)
    parser.add_argument("--turn-deadline-s", type=float, default=60.0)
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    parser.add_argument(
        "--kinds", default=None, help=f"comma-separated fault kinds (default: all of {FAULTS})"
    )
    args = parser.parse_args(argv)
    if args.kinds is None:
        # The bounded run's S3 outage (<= 3 s) is shorter than the workers' checkpoint
        # retry budget (SANDCELL_CHECKPOINT_RETRY_S, 10 s), so a turn during it saves.
        kinds = list(FAULTS)
    else:
        kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
        unknown = sorted(set(kinds) - set(FAULTS))
        if unknown or not kinds:
            parser.error(f"--kinds: unknown or empty {unknown}; known: {', '.join(FAULTS)}")
    args.kinds = kinds
    if args.bounded:
        args.turns = min(args.turns, 40)
        args.faults = min(args.faults, 2 * len(kinds))
        args.budget_s = min(args.budget_s, 60.0)
        args.stop_s = min(args.stop_s, 3.0)
        args.s3_outage_s = min(args.s3_outage_s, 3.0)
        args.turn_deadline_s = min(args.turn_deadline_s, 30.0)
        args.request_timeout_s = min(args.request_timeout_s, 8.0)
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1 << 30)
    root = Path(tempfile.gettempdir()) / "sandcell-tests"
    root.mkdir(mode=0o711, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="chaos-", dir=root))
    os.chmod(base, 0o711)
    chaos = Chaos(args, base)
    try:
        chaos.start()
        summary = chaos.run()
    finally:
        chaos.close()
    summary = chaos.report.summary(summary["wall_s"]) | {
        "seed": args.seed,
        "workers": args.workers,
        "sessions": args.sessions,
    }
    text = json.dumps(summary, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    shutil.rmtree(base, ignore_errors=True)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
