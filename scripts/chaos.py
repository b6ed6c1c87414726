#!/usr/bin/env python3
"""Chaos run: several ``sandcell serve`` workers on one Redis and one S3, turns under faults.

W workers (local provider by default, ``--provider docker`` for podman) share a
redis-server and a moto S3 server reached through a latency proxy. M sessions run
in parallel, one client thread each; a session's turns alternate workers. A turn
appends its own numbered line to ``log`` in the session and prints the file back,
streamed (NDJSON), with an ``Idempotency-Key``; the client retries on connection
errors, timeouts and retryable answers, against the other workers, until it has
an answer or gives the turn up.

Faults strike a chosen turn at a chosen stage, found from the turn's own stream:

    launch      0-50 ms after the request is sent: holding the session, launching
                or reusing its sandbox, restoring its checkpoint
    execute     when the job printed that it started (it then sleeps a little)
    checkpoint  when the job printed that it finished: the worker is uploading the
                checkpoint (S3 slowed stretches this) or about to
    record      50-250 ms after that: the upload's end, the fenced record write, the
                answer (which stage exactly is a matter of timing)

Kinds (every kind at every stage, round robin):

    kill_worker     SIGKILL the turn's worker, start it again (same home, a fresh port)
    kill_runner     SIGKILL the runner processes of the turn's worker
    stop_worker     SIGSTOP the turn's worker until another worker has taken the
                    session over (its lock expired, the generation moved on), then
                    SIGCONT: a true split brain, the woken worker must be fenced
    restart_redis   SIGTERM redis-server, start it again on its AOF (persistence on)
    wipe_redis      SIGKILL redis-server (and its forks), delete its files once all
                    have exited, start it empty (off):
                    generations still never go backwards (checkpoints carry theirs)
    stop_s3         the S3 endpoint refuses connections for --s3-outage-s
    slow_s3         S3 answers through --s3-latency-s per read for --s3-slow-s
    restart_worker  the turn runs a long execute (--long-execute-s); its worker is
                    stopped (SIGINT, as by a deploy) and started again

Invariants, checked at every answer and at the end:

    lost        a committed line missing from a later answer; committed means an
                answer that said ``durable: true`` showed it
    duplicated  a line present twice (a turn applied twice); those of turns in flight
                at a Redis wipe are also counted apart, as ``duplicated_after_redis_wipe``
    empty       an answer that showed none of the session's committed lines
    from nowhere  a line no turn of the session wrote
    leftovers   runner processes, local sandbox roots, mounts or cgroups left after
                the sessions were deleted and the workers stopped
    unreferenced  checkpoint objects no record points at and older than the
                collection window (--grace-s), after the sweepers ran

Turns answered ``durable: false`` (their checkpoint failed past the retry budget)
are counted apart: ``unsaved_acknowledged``, and of those how many a later durable
answer showed (``unsaved_later_durable``) or a later answer lacked
(``unsaved_lost``: the warm sandbox was lost before the next save, as the answer
had warned).

``--trace`` runs the workers with the turn trace on (the DEBUG lines of
``sandcell_orchestrator.sessions.turn``: hold, attach, applied check, commit, each
tagged with a prefix of the turn's stored idempotency key) and, if an invariant
broke, prints the timeline of the turns the problems name, from every worker's
serve.log, each tag mapped back to its turn (``t121``).

``--bounded`` is the mode the test suite runs (tests/orchestrator/serve/test_chaos.py).
Prints one JSON report; exit 1 if an invariant broke. Stops only the processes
it started (by pid / process group).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import re
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
import redis
from moto.server import ThreadedMotoServer

KEY = "chaos-key-0123456789abcdef"
BUCKET = "sandcell-chaos"
LAUNCH_BUDGET_S = 10.0 + 3.0
"""The local workers' launch and health budgets together (their environment below)."""
S3_ACCESS, S3_SECRET = "chaos-access", "chaos-secret-0123456789"
FAULTS = (
    "kill_worker",
    "kill_runner",
    "stop_worker",
    "restart_redis",
    "wipe_redis",
    "stop_s3",
    "slow_s3",
    "restart_worker",
)
STAGES = ("launch", "execute", "checkpoint", "record")
STARTED, EXECUTED = "@started", "@executed"
NAMESPACE = "chaos"
"""The tenant of ``KEY`` (``SANDCELL_API_KEYS``): part of each turn's stored key."""
TRACE_LOGGER = "sandcell_orchestrator.sessions.turn"
# ``sandcell serve`` sets the root logger to INFO and has no log level setting of its
# own: a traced worker is the same CLI, with the turn logger at DEBUG first.
TRACED_SERVE = (
    "import logging, sys\n"
    f"logging.getLogger({TRACE_LOGGER!r}).setLevel(logging.DEBUG)\n"
    "from sandcell_orchestrator.cli import main\n"
    "sys.exit(main(['serve']))\n"
)


def serve_argv(*, trace: bool) -> list[str]:
    """How a worker is started: ``sandcell serve``, with the turn trace if ``trace``."""
    if trace:
        return [sys.executable, "-c", TRACED_SERVE]
    return [sys.executable, "-m", "sandcell_orchestrator", "serve"]


def trace_tag_of(header_key: str) -> str:
    """The tag a worker's trace lines give the turn sent with ``Idempotency-Key:
    header_key`` (on /v1/exec, as ``KEY``'s tenant)."""
    from sandcell_orchestrator.serve.idempotency import Idempotency
    from sandcell_orchestrator.sessions.turn import trace_tag

    return trace_tag(Idempotency.scoped("v1/exec", NAMESPACE, header_key))


def turn_timelines(
    logs: dict[str, str], tags: dict[str, str], turns: list[str]
) -> dict[str, list[str]]:
    """Each of ``turns`` (``t121``): its trace lines from every worker's ``logs``
    (worker name: serve.log text), oldest first, each led by its worker's name and with
    the tag replaced by the turn's name. ``tags``: turn name -> trace tag."""
    wanted = {tags[turn]: turn for turn in turns if turn in tags}
    found: dict[str, list[tuple[str, str]]] = {turn: [] for turn in turns}
    for worker, text in logs.items():
        for entry in text.splitlines():
            _, marker, rest = entry.partition(f"{TRACE_LOGGER}: turn ")
            tag = rest.partition(" ")[0]
            if marker and tag in wanted:
                turn = wanted[tag]
                stamp = entry.partition(" DEBUG ")[0]
                found[turn].append((stamp, f"{stamp} {worker} {turn}{rest[len(tag) :]}"))
    # asctime sorts as text; a worker's lines keep their order (a stable sort).
    return {
        turn: [line for _, line in sorted(lines, key=lambda p: p[0])]
        for turn, lines in found.items()
    }


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
        self.lock = threading.RLock()
        """Held by start, stop, kill and a whole restart or wipe: two fault threads (a
        strike's timer may fire while another fault runs) never interleave their steps."""

    def start(self) -> None:
        with self.lock:
            if self.process is None or self.process.poll() is not None:
                self._start()

    def restart(self) -> None:
        with self.lock:
            self.stop()
            self.start()

    def wipe(self) -> None:
        """SIGKILL it, delete its files, start it empty: one step for other faults."""
        with self.lock:
            self.kill()
            for leftover in self.workdir.iterdir():
                if leftover.is_dir():
                    shutil.rmtree(leftover)
                else:
                    leftover.unlink()
            self.start()

    def _start(self) -> None:
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
        with self.lock:
            if self.process is not None and self.process.poll() is None:
                self.process.terminate()
                self.process.wait(timeout=15)
            self.process = None

    def kill(self) -> None:
        """SIGKILL redis-server and every process of its group, and wait until all have
        exited: a fork of it (the AOF rewrite redis starts on an empty directory) goes on
        writing into ``workdir`` after its parent died, so the files may be deleted only
        once the last one is gone."""
        with self.lock:
            self._kill()

    def _kill(self) -> None:
        if self.process is None:
            return
        group = []
        with contextlib.suppress(psutil.Error):
            group = [psutil.Process(self.process.pid)]
            group += group[0].children(recursive=True)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=15)
        _, alive = psutil.wait_procs(group, timeout=15)
        if alive:
            raise RuntimeError(f"redis-server processes did not exit: {alive}")
        self.process = None

    def generation(self, session_id: str) -> int:
        """The session's generation counter (0 if Redis is down or has none)."""
        with (
            contextlib.suppress(redis.RedisError, ValueError),
            redis.Redis.from_url(self.url, socket_timeout=2) as db,
        ):
            return int(db.get(f"sandcell:gen:{session_id}") or 0)
        return 0


class LatencyProxy:
    """A TCP proxy in front of S3: forwards, adds ``delay_s`` to every read when slowed,
    and refuses connections (closing the ones open) while stopped."""

    def __init__(self, target_port: int) -> None:
        self.port = free_port()
        self.target_port = target_port
        self.delay_s = 0.0
        self._listener: socket.socket | None = None
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.faults = threading.Lock()
        """Held through a whole outage or slow stretch: S3 faults run one after another."""

    def outage(self, seconds: float) -> None:
        with self.faults:
            self.stop()
            time.sleep(seconds)
            self.start()

    def slow(self, delay_s: float, seconds: float) -> None:
        with self.faults:
            self.delay_s = delay_s
            time.sleep(seconds)
            self.delay_s = 0.0

    def start(self) -> None:
        if self._listener is not None:
            return
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def stop(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        with self._lock:
            for sock in list(self._open):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            self._open.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._open.update((client, upstream))
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                if self.delay_s:
                    time.sleep(self.delay_s)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                with self._lock:
                    self._open.discard(sock)


def _alive(process: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    return False


def _describe(process: psutil.Process) -> str:
    """A leftover, for the report: what it runs and who its parent is."""
    with contextlib.suppress(psutil.Error):
        argv = " ".join(process.cmdline())[-120:]
        return f"pid {process.pid} ppid {process.ppid()} {process.status()}: {argv}"
    return f"pid {process.pid} (gone)"


@dataclass
class Worker:
    index: int
    root: Path
    port: int
    env: dict[str, str]
    runtime_dir: Path
    trace: bool = False
    """Started with the turn trace on (``--trace``)."""
    process: subprocess.Popen[bytes] | None = None
    lock: threading.RLock = field(default_factory=threading.RLock)
    """Held by start, kill and stop: two fault threads never start one worker twice."""
    started: list[subprocess.Popen[bytes]] = field(default_factory=list)
    """Every process this worker ever was: the end stops any still running."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, *, fresh_port: bool = False) -> None:
        """Start the worker and wait until it answers; ``fresh_port`` (a restart) listens
        on a newly picked port, which clients use from then on: the old one may have been
        taken (by a runner, say) while the worker was down. A worker that exits before it
        answers (its port taken in between after all) is started again on another."""
        with self.lock:
            self._start(fresh_port=fresh_port)

    def _start(self, *, fresh_port: bool) -> None:
        self.kill()
        for attempt in range(3):
            if fresh_port or attempt:
                self.port = free_port()
                self.env["SANDCELL_SERVE_PORT"] = str(self.port)
            with (self.root / "serve.log").open("ab") as out:
                self.process = subprocess.Popen(
                    serve_argv(trace=self.trace),
                    env=self.env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            self.started.append(self.process)
            process, url = self.process, self.url
            with contextlib.suppress(RuntimeError):
                wait_for(
                    lambda process=process, url=url: (
                        process.poll() is not None
                        or httpx.get(f"{url}/healthz", timeout=1).status_code == 200
                    ),
                    timeout_s=90,
                    what=f"worker {self.index}",
                )
            if process.poll() is None:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/healthz", timeout=5).status_code == 200:
                        return
                self.kill()
        raise RuntimeError(f"worker {self.index} did not come up (see {self.root}/serve.log)")

    def kill(self) -> None:
        with self.lock:
            if self.process is not None and self.process.poll() is None:
                self.process.kill()
                self.process.wait()

    def stop(self) -> None:
        """SIGINT (as by a deploy) and wait; SIGKILL its group past 30 s."""
        with self.lock:
            if self.process is not None:
                self._stop(self.process)

    def stop_all(self) -> None:
        """Stop every process this worker ever was that still runs (the end)."""
        with self.lock:
            for process in self.started:
                self._stop(process)

    @staticmethod
    def _stop(process: subprocess.Popen[bytes]) -> None:
        if process.poll() is not None:
            return
        process.send_signal(signal.SIGCONT)
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@dataclass
class Session:
    hint: str
    session_id: str
    committed: set[str] = field(default_factory=set)
    acked: list[str] = field(default_factory=list)
    unsaved: set[str] = field(default_factory=set)
    written: set[str] = field(default_factory=set)
    reported: set[str] = field(default_factory=set)
    """Lines already counted as duplicated or lost (each is counted once)."""


@dataclass
class Report:
    turns: int = 0
    acknowledged: int = 0
    durable: int = 0
    given_up: int = 0
    first_try: int = 0
    faults: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAULTS, 0))
    stages: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STAGES, 0))
    split_brains: int = 0
    lost: int = 0
    duplicated: int = 0
    duplicated_after_wipe: int = 0
    empty: int = 0
    from_nowhere: int = 0
    unsaved_acknowledged: int = 0
    unsaved_later_durable: int = 0
    unsaved_lost: int = 0
    leftovers: dict[str, int] = field(default_factory=dict)
    unreferenced: int = 0
    fault_failures: int = 0
    """Fault steps that raised (a fault only partly ran): the run proved less, it fails."""
    answers: dict[str, int] = field(default_factory=dict)
    calm_s: list[float] = field(default_factory=list)
    faulted_s: list[float] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    timeline: list[str] = field(default_factory=list)
    lost_turns: set[str] = field(default_factory=set)

    def summary(self, wall_s: float) -> dict[str, Any]:
        def pct(values: list[float], p: float) -> float | None:
            ordered = sorted(values)
            if not ordered:
                return None
            return round(ordered[min(len(ordered) - 1, int(p * len(ordered)))], 3)

        every = self.calm_s + self.faulted_s
        ok = (
            self.lost == self.duplicated == self.empty == self.from_nowhere == 0
            and self.unreferenced == 0
            and self.fault_failures == 0
            and not any(self.leftovers.values())
        )
        return {
            "wall_s": round(wall_s, 1),
            "turns": self.turns,
            "acknowledged": self.acknowledged,
            "durable": self.durable,
            "given_up": self.given_up,
            "first_try_share": round(self.first_try / self.turns, 3) if self.turns else None,
            "faults": self.faults,
            "faults_total": sum(self.faults.values()),
            "stages": self.stages,
            "split_brains": self.split_brains,
            "lost": self.lost,
            "lost_turns": sorted(self.lost_turns),
            "duplicated": self.duplicated,
            "duplicated_after_redis_wipe": self.duplicated_after_wipe,
            "empty_workspace": self.empty,
            "from_nowhere": self.from_nowhere,
            "unsaved_acknowledged": self.unsaved_acknowledged,
            "unsaved_later_durable": self.unsaved_later_durable,
            "unsaved_lost": self.unsaved_lost,
            "leftovers": self.leftovers,
            "unreferenced_checkpoints": self.unreferenced,
            "fault_failures": self.fault_failures,
            "answers": self.answers,
            "latency_p50_s": pct(every, 0.5),
            "latency_p99_s": pct(every, 0.99),
            "latency_calm_p50_s": pct(self.calm_s, 0.5),
            "latency_calm_p99_s": pct(self.calm_s, 0.99),
            "latency_faulted_p50_s": pct(self.faulted_s, 0.5),
            "latency_faulted_p99_s": pct(self.faulted_s, 0.99),
            "latency_mean_s": round(statistics.fmean(every), 3) if every else None,
            "problems": self.problems[:30],
            "timeline": self.timeline[-200:],
            "ok": ok,
        }


@dataclass(frozen=True)
class Strike:
    kind: str
    stage: str


class Chaos:
    def __init__(self, args: argparse.Namespace, base: Path) -> None:
        from sandcell_protocol import runtime_session_id

        self.args = args
        self.base = base
        self.rng = random.Random(args.seed)
        self.report = Report(faults=dict.fromkeys(args.kinds, 0))
        self.redis = Redis(base / "redis")
        self.moto_port = free_port()
        self.s3 = ThreadedMotoServer(ip_address="127.0.0.1", port=self.moto_port, verbose=False)
        self.proxy = LatencyProxy(self.moto_port)
        self.workers: list[Worker] = []
        self.sessions = []
        for n in range(args.sessions):
            hint = f"chaos-{n}-{uuid.uuid4().hex[:6]}"
            self.sessions.append(Session(hint, runtime_session_id(NAMESPACE, "u", hint)))
        self._mutex = threading.Lock()
        # One fault at a time: a fault is injected, waited out (worker back up,
        # S3 back), then the next may be scheduled.
        self._fault_free = threading.Event()
        self._fault_free.set()
        self._step = 0
        self.header_keys: dict[str, str] = {}
        """Each turn's ``Idempotency-Key`` (the same on every retry), by its name."""
        self._plan = self._schedule()
        self._stopped: set[int] = set()
        self._fired: set[str] = set()
        self._roots: set[str] = set()
        self._in_flight: set[str] = set()
        self._wiped: set[str] = set()
        """Lines in flight when Redis was wiped (their answers in Redis are gone)."""
        self._epoch = 0
        """Bumped by every fault: a turn that saw it change ran under a fault."""
        self._closing = False
        """Set once the faulted part is over: no strike fires after it (under the mutex)."""
        self._timers: list[threading.Timer] = []
        self._threads: list[threading.Thread] = []
        """Every strike timer and fault thread started, joined before the end's checks (a
        worker or Redis restarted during them would outlive the run, its runners too)."""
        self._active = 0
        """Fault threads running; ``_fault_free`` is set when it is 0."""

    # -- set-up -------------------------------------------------------------------

    def _schedule(self) -> dict[int, Strike]:
        """Which turn steps carry a strike, and which (kind, stage): every kind at every
        stage, round robin, spread evenly over the run."""
        combos = [Strike(k, s) for s in STAGES for k in self.args.kinds]
        count = self.args.faults
        if count <= 0:
            return {}
        spacing = max(1, (self.args.turns - 8) // count)
        first = 4
        return {
            first + n * spacing + self.rng.randrange(spacing): combos[n % len(combos)]
            for n in range(count)
        }

    def start(self) -> None:
        (self.base / "redis").mkdir()
        self.redis.start()
        self.s3.start()
        self.proxy.start()
        endpoint = f"http://127.0.0.1:{self.proxy.port}"
        client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id=S3_ACCESS,
            aws_secret_access_key=S3_SECRET,
            region_name="us-east-1",
        )
        client.create_bucket(Bucket=BUCKET)
        client.close()
        self.endpoint = endpoint
        shared = {k: v for k, v in os.environ.items() if not k.startswith("SANDCELL_")} | {
            "SANDCELL_REGISTRY_URL": self.redis.url,
            "SANDCELL_SNAPSHOT_URL": f"s3://{BUCKET}/chaos",
            "SANDCELL_S3_ENDPOINT": endpoint,
            "SANDCELL_S3_ACCESS_KEY": S3_ACCESS,
            "SANDCELL_S3_SECRET_KEY": S3_SECRET,
            "SANDCELL_API_KEYS": f"{KEY}={NAMESPACE}",
            "SANDCELL_IDEMPOTENCY_CLAIM_TTL_S": str(self.args.claim_ttl_s),
            # A killed worker's session waits out the lock TTL; a small one keeps the
            # run fast (the holder renews it every third of it while a turn runs).
            "SANDCELL_LOCK_TTL_S": str(self.args.lock_ttl_s),
            "SANDCELL_CHECKPOINT_RETRY_S": str(self.args.checkpoint_retry_s),
            "SANDCELL_CHECKPOINT_GRACE_S": str(self.args.grace_s),
            "SANDCELL_SWEEP_INTERVAL_S": str(self.args.sweep_s),
            "SANDCELL_LAUNCH_TIMEOUT_S": "10",
            "SANDCELL_HEALTH_TIMEOUT_S": "3",  # LAUNCH_BUDGET_S together
            "SANDCELL_EXECUTE_TIMEOUT_S": "30",
            "SANDCELL_CHECKPOINT_TIMEOUT_S": "10",
        }
        if self.args.provider == "docker":
            shared |= {
                "SANDCELL_PROVIDER": "docker",
                "DOCKER_HOST": self.args.docker_host,
                "SANDCELL_DOCKER_IMAGE": self.args.docker_image,
                "SANDCELL_LAUNCH_TIMEOUT_S": "30",
            }
        runtime = self.base / "sandboxes"
        for n in range(self.args.workers):
            root = self.base / f"w{n}"
            root.mkdir(mode=0o711)
            port = free_port()
            env = shared | {
                "SANDCELL_HOME": str(root / "home"),
                # Workers on one host share it (docs/deployment.md): each reaches the
                # sandboxes another launched through the record, as on Docker.
                "SANDCELL_LOCAL_RUNTIME_DIR": str(runtime),
                "SANDCELL_SERVE_PORT": str(port),
            }
            worker = Worker(n, root, port, env, runtime, trace=self.args.trace)
            worker.start()
            self.workers.append(worker)

    # -- the end --------------------------------------------------------------------

    def quiesce(self, *, cancel: bool) -> None:
        """No strike from now on: wait for (or cancel) the pending strike timers, then
        for every fault thread, so nothing restarts a worker or Redis after this."""
        with self._mutex:
            self._closing = True
            timers = list(self._timers)
        for timer in timers:
            if cancel:
                timer.cancel()
            timer.join()
        while True:
            with self._mutex:
                threads = [t for t in self._threads if t.is_alive()]
            if not threads:
                break
            for thread in threads:
                thread.join(timeout=180)
                if thread.is_alive():
                    self.report.problems.append(f"fault thread {thread.name} did not end")
                    return

    def close(self) -> None:
        self.quiesce(cancel=True)
        for worker in self.workers:
            self._resume(worker)
        self._check_objects()
        with httpx.Client(timeout=60) as client:
            for session in self.sessions:
                for _ in range(20):
                    worker = self.rng.choice(self.workers)
                    with contextlib.suppress(httpx.HTTPError):
                        response = client.delete(
                            f"{worker.url}/v1/sessions/{session.session_id}",
                            headers=self._auth(),
                        )
                        if response.status_code in (204, 404):
                            break
                    time.sleep(0.5)
        # Both sweepers pass once more (lost rows, collection) before the workers stop.
        time.sleep(2 * self.args.sweep_s)
        self._wait_for_remains()
        for worker in self.workers:
            worker.stop_all()
        time.sleep(0.5)
        self._check_leftovers()
        self.redis.stop()
        self.proxy.stop()
        with contextlib.suppress(Exception):
            self.s3.stop()

    def _check_objects(self) -> None:
        """No checkpoint object unreferenced past the collection window, once the
        sweepers have had a round after the window."""
        time.sleep(self.args.grace_s + 2 * self.args.sweep_s + 1)
        from sandcell_orchestrator.registry import SessionRecord

        client = boto3.client(
            "s3",
            endpoint_url=f"http://127.0.0.1:{self.moto_port}",
            aws_access_key_id=S3_ACCESS,
            aws_secret_access_key=S3_SECRET,
            region_name="us-east-1",
        )
        try:
            pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET)
            objects = [o for page in pages for o in page.get("Contents", [])]
        finally:
            client.close()
        now = time.time()
        with redis.Redis.from_url(self.redis.url) as db:
            for session in self.sessions:
                raw = db.get(f"sandcell:record:{session.session_id}")
                pointer = SessionRecord.from_json(raw).checkpoint_key if raw else None
                # All but the session's owner object (``owners/``, its listing's),
                # which is meant to live as long as the session.
                mine = [
                    o
                    for o in objects
                    if session.session_id in o["Key"] and "owners/" not in o["Key"]
                ]
                for item in mine:
                    # The record's checkpoint, and the result of the keyed turn that
                    # wrote it (``<checkpoint>.turn-<key>``), are referenced.
                    if pointer is not None and item["Key"].split(".turn-")[0].endswith(pointer):
                        continue
                    age_s = now - item["LastModified"].timestamp()
                    if age_s > self.args.grace_s + 2 * self.args.sweep_s:
                        self.report.unreferenced += 1
                        self.report.problems.append(
                            f"{session.hint}: {item['Key'].rsplit('/', 1)[-1]} unreferenced"
                            f" {age_s:.0f} s old"
                        )

    def _wait_for_remains(self) -> None:
        """Give the sweepers their window for what is left of dead sandboxes.

        A destroy that finds a runner's cgroups still busy (its zombie not yet reaped)
        leaves the root to the sweepers' remains check, which waits out a launch's
        budget from the root's last change before it takes a root for dead: a root
        left by the last DELETEs is gone only that long after them.
        """
        runtime = self.base / "sandboxes"
        begun = time.monotonic()
        first: list[str] | None = None
        while time.monotonic() < begun + LAUNCH_BUDGET_S + 3 * self.args.sweep_s:
            try:
                left = sorted(entry.name for entry in runtime.iterdir())
            except FileNotFoundError:  # no local sandbox ever (Docker)
                return
            first = left if first is None else first
            if not left:
                break
            time.sleep(0.5)
        if first:
            waited_s = time.monotonic() - begun
            self.report.timeline.append(f"end: waited {waited_s:.1f} s for the remains of {first}")

    def _check_leftovers(self) -> None:
        # A runner whose worker just stopped gets SIGTERM (PR_SET_PDEATHSIG) and drains
        # and unmounts first: leftovers are the processes still there after a while.
        ending = self._runners()
        _, runners = psutil.wait_procs(ending, timeout=self.args.leftover_wait_s)
        runners = [p for p in runners if _alive(p)]
        runtime = self.base / "sandboxes"
        roots = list(runtime.iterdir()) if runtime.exists() else []
        mounts = [
            line.split()[1]
            for line in Path("/proc/self/mounts").read_text().splitlines()
            if str(self.base) in line
        ]
        cgroups = self._cgroups()
        containers = self._containers()
        self.report.leftovers = {
            "runners": len(runners),
            "sandbox_roots": len(roots),
            "mounts": len(mounts),
            "cgroups": len(cgroups),
            "containers": len(containers),
        }
        for what, found in (
            ("runner", [_describe(p) for p in runners]),
            ("root", [self._describe_root(root) for root in roots]),
            ("mount", mounts),
            ("cgroup", cgroups),
            ("container", containers),
        ):
            if found:
                self.report.problems.append(f"{len(found)} {what}(s) left: {found[:3]}")
        for process in runners:
            with contextlib.suppress(psutil.Error):
                process.send_signal(signal.SIGKILL)
        psutil.wait_procs(runners, timeout=10)

    def _describe_root(self, root: Path) -> str:
        """A leftover root, for the report (CI keeps only the report): its age, what is
        in it, its runner's last words and what the workers' logs say of it."""
        try:
            age_s = time.time() - root.stat().st_mtime
            entries = sorted(entry.name for entry in root.iterdir())
        except OSError as exc:
            return f"{root}: {exc}"
        said = ""
        with contextlib.suppress(OSError):
            said = (root / "runner.log").read_text(errors="replace")[-300:]
        mentions = []
        for worker in self.workers:
            with contextlib.suppress(OSError):
                for line in (worker.root / "serve.log").read_text(errors="replace").splitlines():
                    if root.name in line:
                        mentions.append(f"w{worker.index}: {line[-200:]}")
        return (
            f"{root} ({age_s:.1f} s old, {entries}); runner.log ends {said!r};"
            f" the workers' logs: {mentions[-4:]}"
        )

    def timelines(self, problems: list[str]) -> dict[str, list[str]]:
        """The trace timelines of the turns ``problems`` name (``--trace``)."""
        turns = sorted(set(re.findall(r"\bt\d+\b", " ".join(problems))), key=lambda t: int(t[1:]))
        tags = {turn: trace_tag_of(key) for turn, key in self.header_keys.items()}
        logs = {}
        for worker in self.workers:
            with contextlib.suppress(OSError):
                logs[f"w{worker.index}"] = (worker.root / "serve.log").read_text(errors="replace")
        return turn_timelines(logs, tags, turns)

    def _cgroups(self) -> list[str]:
        """Job cgroups of this run's runners (named by their workspace roots)."""
        from sandcell_runner.jail.cgroup_reaper import instance_key

        self._remember_roots()
        keys = {instance_key(Path(root) / "workspaces") for root in self._roots}
        found = []
        for controller in Path("/sys/fs/cgroup").iterdir():
            for key in keys:
                node = controller / "sandcell" / key
                if node.exists() and any(p.is_dir() for p in node.iterdir()):
                    found.append(str(node))
        return found

    def _containers(self) -> list[str]:
        if self.args.provider != "docker":
            return []
        with self._engine() as engine:
            listed = engine.get("/containers/json", params={"all": "true"}).json()
        mine = {s.session_id for s in self.sessions}
        return [
            c["Id"][:12]
            for c in listed
            if any(sid in json.dumps(c.get("Labels") or {}) for sid in mine)
        ]

    def _remember_roots(self) -> None:
        """Note the local sandboxes' roots (their runners' cgroups are named from them)."""
        with contextlib.suppress(OSError):
            self._roots.update(str(entry) for entry in (self.base / "sandboxes").iterdir())

    @staticmethod
    def _auth() -> dict[str, str]:
        return {"Authorization": f"Bearer {KEY}"}

    def _sandbox_of(self, session: Session) -> str | None:
        """The session's sandbox id, as its record names it (None: no record)."""
        from sandcell_orchestrator.registry import SessionRecord

        with (
            contextlib.suppress(redis.RedisError, ValueError),
            redis.Redis.from_url(self.redis.url, socket_timeout=2) as db,
        ):
            raw = db.get(f"sandcell:record:{session.session_id}")
            return SessionRecord.from_json(raw).sandbox_id if raw else None
        return None

    def _runners(self, sandbox_id: str | None = "") -> list[psutil.Process]:
        """Runner and jail processes (of one sandbox, or of all) of this run: those that
        name its base directory in their command line or environment, never a live
        worker, this process or an ancestor (pytest), or redis-server (``--dir``)."""
        if sandbox_id is None:
            return []
        mine = {w.process.pid for w in self.workers if w.process is not None}
        mine |= {os.getpid(), *(p.pid for p in psutil.Process().parents())}
        if self.redis.process is not None:
            mine.add(self.redis.process.pid)
        marker = str(self.base / "sandboxes" / sandbox_id) if sandbox_id else str(self.base)
        found = []
        for process in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if process.pid in mine or process.status() == psutil.STATUS_ZOMBIE:
                    continue
                if marker in " ".join(process.cmdline()) or any(
                    marker in value for value in process.environ().values()
                ):
                    found.append(process)
        return found

    def _kill_sandbox(self, sandbox_id: str | None) -> None:
        """SIGKILL the sandbox's runner: its processes, or its container's."""
        if sandbox_id is None:
            return
        if self.args.provider == "docker":
            with self._engine() as engine, contextlib.suppress(httpx.HTTPError):
                engine.post(f"/containers/{sandbox_id}/kill", params={"signal": "KILL"})
            return
        for victim in self._runners(sandbox_id):
            with contextlib.suppress(psutil.Error):
                victim.send_signal(signal.SIGKILL)

    def _engine(self) -> httpx.Client:
        transport = httpx.HTTPTransport(uds=self.args.docker_host.removeprefix("unix://"))
        return httpx.Client(transport=transport, base_url="http://docker", timeout=30)

    # -- faults -------------------------------------------------------------------

    def _strike(self, strike: Strike, worker: Worker, session: Session, line: str) -> None:
        """Inject ``strike`` now, on the worker the turn went to; from the turn's thread
        (the slow parts go to a thread of their own, which clears ``_fault_free``)."""
        kind = strike.kind
        with self._mutex:
            if line in self._fired or self._closing:
                return
            self._fired.add(line)
            self._epoch += 1
        self._remember_roots()
        self.report.faults[kind] += 1
        self.report.stages[strike.stage] += 1
        self.report.timeline.append(f"{line}@{strike.stage}: {kind} w{worker.index}")
        if kind == "kill_worker":
            worker.kill()
            self._background(lambda: worker.start(fresh_port=True))
        elif kind == "kill_runner":
            self._kill_sandbox(self._sandbox_of(session))
        elif kind == "stop_worker":
            assert worker.process is not None
            before = self.redis.generation(session.session_id)
            worker.process.send_signal(signal.SIGSTOP)
            self._stopped.add(worker.index)
            self._background(self._split_brain, worker, session, before, line)
        elif kind == "restart_redis":
            self._background(self.redis.restart)
        elif kind == "wipe_redis":
            self._background(self._wipe_redis)
        elif kind == "stop_s3":
            self._background(self.proxy.outage, self.args.s3_outage_s)
        elif kind == "slow_s3":
            self._background(self.proxy.slow, self.args.s3_latency_s, self.args.s3_slow_s)
        elif kind == "restart_worker":

            def restart() -> None:
                worker.stop()
                worker.start(fresh_port=True)

            self._background(restart)

    def _background(self, work: Any, *args: Any) -> None:
        def run() -> None:
            try:
                work(*args)
            except Exception as exc:  # reported, and the run goes on (and fails)
                with self._mutex:  # two fault threads can fail at once
                    self.report.fault_failures += 1
                    self.report.problems.append(f"fault step failed: {type(exc).__name__}: {exc}")
            finally:
                with self._mutex:
                    self._active -= 1
                    if self._active == 0:
                        self._fault_free.set()

        thread = threading.Thread(target=run, name=f"fault-{len(self._threads)}", daemon=True)
        with self._mutex:
            # Registered before it starts: quiesce() joins every one, even one started by
            # a strike that passed its closing check just before.
            self._active += 1
            self._fault_free.clear()
            self._threads.append(thread)
        thread.start()

    def _later(self, delay_s: float, *args: Any) -> None:
        """``_strike(*args)`` in ``delay_s``, unless the run is closing by then."""
        timer = threading.Timer(delay_s, self._strike, args)
        timer.daemon = True
        with self._mutex:
            if self._closing:
                return
            self._timers.append(timer)
        timer.start()

    def _wipe_redis(self) -> None:
        with self._mutex:
            self._wiped |= self._in_flight
        self.redis.wipe()

    def _split_brain(self, worker: Worker, session: Session, before: int, line: str) -> None:
        """Keep ``worker`` stopped until another worker took its session (the generation
        moved past the stopped holder's) and its lock TTL passed, then wake it."""
        held_since = time.monotonic()
        deadline = held_since + self.args.stop_max_s
        taken = False
        while time.monotonic() < deadline:
            if self.redis.generation(session.session_id) > before:
                taken = time.monotonic() - held_since > self.args.lock_ttl_s
                if taken:
                    break
            time.sleep(0.1)
        if taken:
            self.report.split_brains += 1
            self.report.timeline.append(f"{line}: w{worker.index} woke after a takeover")
        self._resume(worker)

    def _resume(self, worker: Worker) -> None:
        if worker.process is not None and worker.process.poll() is None:
            worker.process.send_signal(signal.SIGCONT)
        self._stopped.discard(worker.index)

    # -- turns --------------------------------------------------------------------

    def _take_step(self) -> tuple[int, Strike | None]:
        with self._mutex:
            step = self._step
            self._step += 1
        strike = self._plan.get(step)
        if strike is not None:
            # Wait for the previous fault to be over (a worker back, S3 back).
            self._fault_free.wait(timeout=180)
        return step, strike

    def turn(self, step: int, session: Session, strike: Strike | None) -> None:
        line = f"t{step}"
        session.written.add(line)
        sleep_s = 0.0
        if strike is not None and strike.stage == "execute":
            sleep_s = 0.4
        if strike is not None and strike.kind == "restart_worker":
            sleep_s = self.args.long_execute_s
        code = (
            f"import time\nprint({STARTED!r}, flush=True)\ntime.sleep({sleep_s})\n"
            f"open('log', 'a').write({line!r} + '\\n')\nprint({EXECUTED!r}, flush=True)\n"
            "print(open('log').read(), end='')"
        )
        body = {
            "language": "python",
            "user_id": "u",
            "runtime_session_hint": session.hint,
            "code": code,
        }
        header_key = f"turn-{uuid.uuid4().hex}"
        headers = self._auth() | {"Idempotency-Key": header_key, "Accept": "application/x-ndjson"}
        started = time.monotonic()
        epoch, calm = self._epoch, self._fault_free.is_set()
        deadline = started + self.args.turn_deadline_s
        attempt = 0
        with self._mutex:
            self.report.turns += 1
            self._in_flight.add(line)
            self.header_keys[line] = header_key
        with httpx.Client(timeout=self.args.request_timeout_s) as client:
            while time.monotonic() < deadline:
                worker = self.workers[(step + attempt) % len(self.workers)]
                attempt += 1
                # A strike whose stage the first attempt never reached goes with the next.
                pending = strike if strike is not None and line not in self._fired else None
                outcome = self._attempt(client, worker, body, headers, pending, session, line)
                if isinstance(outcome, dict):
                    elapsed = time.monotonic() - started
                    calm = calm and self._epoch == epoch and self._fault_free.is_set()
                    with self._mutex:
                        (self.report.calm_s if calm else self.report.faulted_s).append(elapsed)
                        if attempt == 1:
                            self.report.first_try += 1
                        else:
                            self.report.timeline.append(f"{line}: answered on attempt {attempt}")
                        self.check(session, line, outcome)
                        self._in_flight.discard(line)
                    return
                if outcome == "stop":
                    break
                time.sleep(outcome)
        with self._mutex:
            self.report.given_up += 1
            self.report.problems.append(f"{line}: given up")

    def _attempt(
        self,
        client: httpx.Client,
        worker: Worker,
        body: dict[str, Any],
        headers: dict[str, str],
        strike: Strike | None,
        session: Session,
        line: str,
    ) -> dict[str, Any] | float | str:
        """One request; the result, or how long to wait before the next (or "stop")."""
        fire_at: dict[str, float] = {}
        if strike is not None:
            if strike.stage == "launch":
                self._later(self.rng.uniform(0.0, 0.05), strike, worker, session, line)
            else:
                fire_at = {strike.stage: 0.0}
        try:
            with client.stream(
                "POST", f"{worker.url}/v1/exec", json=body, headers=headers
            ) as response:
                if response.status_code != 200:
                    response.read()
                    return self._refused(response, line)
                for raw in response.iter_lines():
                    event = json.loads(raw)
                    if event.get("type") == "result":
                        if strike is not None and fire_at:
                            # No output reached us (a replayed answer): strike now.
                            self._strike(strike, worker, session, line)
                        self._count("200")
                        result: dict[str, Any] = event["result"]
                        return result
                    if "error" in event:
                        self._count(f"stream {event['error'].get('code')}")
                        return 0.3
                    data = event.get("data", "")
                    if strike is not None and fire_at:
                        if STARTED in data and "execute" in fire_at:
                            fire_at.clear()
                            self._strike(strike, worker, session, line)
                        elif EXECUTED in data and fire_at:
                            delay_s = (
                                0.0 if "checkpoint" in fire_at else self.rng.uniform(0.05, 0.25)
                            )
                            fire_at.clear()
                            self._later(delay_s, strike, worker, session, line)
        except httpx.HTTPError as exc:
            self._count(type(exc).__name__)
            return 0.2
        except json.JSONDecodeError:
            self._count("torn stream")
            return 0.2
        self._count("stream ended early")
        return 0.2

    def _refused(self, response: httpx.Response, line: str) -> float | str:
        code = ""
        with contextlib.suppress(ValueError, KeyError, TypeError):
            code = " " + str(response.json()["error"]["code"])
        self._count(f"{response.status_code}{code}")
        if response.status_code == 422:
            self.report.problems.append(f"{line}: 422 on a retry with its own key")
            return "stop"
        if response.status_code == 500:
            self.report.problems.append(f"{line}: 500 {response.text[:160]}")
        return min(float(response.headers.get("retry-after", "0.3") or 0.3), 1.0)

    def _count(self, answer: str) -> None:
        with self._mutex:
            self.report.answers[answer] = self.report.answers.get(answer, 0) + 1

    def check(self, session: Session, line: str, result: dict[str, Any]) -> None:
        """The invariants, at one answer (called under the mutex)."""
        report = self.report
        report.acknowledged += 1
        seen = [e for e in result["stdout"].splitlines() if not e.startswith("@")]
        counts: dict[str, int] = {}
        for entry in seen:
            counts[entry] = counts.get(entry, 0) + 1
        duplicated = [e for e, n in counts.items() if n > 1 and f"dup {e}" not in session.reported]
        session.reported.update(f"dup {e}" for e in duplicated)
        # A wiped Redis forgets idempotent answers and records; a keyed turn's result
        # is in the store (next to its checkpoint, and by its key), and a retry that
        # finds it there must not run it again. A duplicate of a turn in flight at a
        # wipe fails the run like any other; it is also counted apart, to tell them.
        after_wipe = [e for e in duplicated if e in self._wiped]
        report.duplicated_after_wipe += len(after_wipe)
        if after_wipe:
            report.timeline.append(f"{line}: applied twice after a Redis wipe: {after_wipe}")
        if duplicated:
            report.duplicated += len(duplicated)
            report.problems.append(f"{line}: applied twice: {duplicated}")
        lost = sorted(e for e in session.committed - counts.keys() if e not in session.reported)
        session.reported.update(lost)
        if lost:
            report.lost += len(lost)
            report.lost_turns.update(lost)
            report.problems.append(f"{line}: lost committed {lost}")
            if len(lost) == len(session.committed):
                report.empty += 1
        if line not in counts:
            report.problems.append(f"{line}: its own line is not in its answer")
            report.lost += 1
        nowhere = [e for e in seen if e not in session.written]
        if nowhere:
            report.from_nowhere += len(nowhere)
            report.problems.append(f"{line}: lines from nowhere: {nowhere}")
        gone = sorted(e for e in session.unsaved if e not in counts)
        for entry in gone:
            session.unsaved.discard(entry)
            report.unsaved_lost += 1
            report.timeline.append(f"{line}: unsaved {entry} lost (its answer had said so)")
        session.acked.append(line)
        self._remember_roots()
        if result.get("durable") is True:
            report.durable += 1
            became = session.unsaved & counts.keys()
            report.unsaved_later_durable += len(became)
            session.unsaved -= became
            session.committed |= counts.keys()
        else:
            report.unsaved_acknowledged += 1
            session.unsaved.add(line)
            report.timeline.append(f"{line}: answered durable={result.get('durable')}")

    def _client(self, session: Session) -> None:
        while True:
            step, strike = self._take_step()
            if step >= self.args.turns:
                return
            if time.monotonic() > self._budget_end:
                return
            self.turn(step, session, strike)

    def run(self) -> dict[str, Any]:
        begun = time.monotonic()
        self._budget_end = begun + self.args.budget_s
        threads = [
            threading.Thread(target=self._client, args=(s,), daemon=True) for s in self.sessions
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        # The last strikes fire (their timers are short) and are waited out; none after.
        self.quiesce(cancel=False)
        for worker in self.workers:
            self._resume(worker)
        # A last turn per session reads everything committed back.
        with self._mutex:
            last = self._step
            self._step += len(self.sessions)
        for n, session in enumerate(self.sessions):
            self.turn(last + n, session, None)
        return self.report.summary(time.monotonic() - begun)


def main(argv: list[str] | None = None) -> int:
    """Run once; the JSON report on stdout; 0 if every invariant held."""
    # moto's server logs every request through werkzeug.
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--bounded", action="store_true", help="the test suite's small run")
    parser.add_argument("--provider", choices=("local", "docker"), default="local")
    parser.add_argument("--docker-host", default=os.environ.get("SANDCELL_TEST_DOCKER_HOST"))
    parser.add_argument("--docker-image", default=os.environ.get("SANDCELL_TEST_DOCKER_IMAGE"))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--turns", type=int, default=1000)
    parser.add_argument("--faults", type=int, default=800)
    parser.add_argument("--budget-s", type=float, default=4 * 3600.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--lock-ttl-s", type=float, default=3.0)
    parser.add_argument("--stop-max-s", type=float, default=20.0)
    parser.add_argument("--claim-ttl-s", type=float, default=3.0)
    parser.add_argument("--checkpoint-retry-s", type=float, default=10.0)
    parser.add_argument("--s3-outage-s", type=float, default=10.0)
    parser.add_argument("--s3-latency-s", type=float, default=0.2)
    parser.add_argument("--s3-slow-s", type=float, default=5.0)
    parser.add_argument("--long-execute-s", type=float, default=3.0)
    parser.add_argument("--grace-s", type=float, default=5.0)
    parser.add_argument("--sweep-s", type=float, default=2.0)
    parser.add_argument(
        "--leftover-wait-s",
        type=float,
        default=15.0,
        help="how long runners of stopped workers may take to end before they count as left",
    )
    parser.add_argument("--request-timeout-s", type=float, default=20.0)
    parser.add_argument("--turn-deadline-s", type=float, default=120.0)
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    parser.add_argument(
        "--trace",
        action="store_true",
        help="turn trace on in the workers; on a failure, print the failed turns' timelines",
    )
    parser.add_argument(
        "--kinds", default=None, help=f"comma-separated fault kinds (default: all of {FAULTS})"
    )
    args = parser.parse_args(argv)
    if args.kinds is None:
        kinds = list(FAULTS)
    else:
        kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
        unknown = sorted(set(kinds) - set(FAULTS))
        if unknown or not kinds:
            parser.error(f"--kinds: unknown or empty {unknown}; known: {', '.join(FAULTS)}")
    args.kinds = kinds
    if args.provider == "docker" and not (args.docker_host and args.docker_image):
        parser.error("--provider docker needs --docker-host and --docker-image")
    if args.bounded:
        # Every kind at every stage once: 32 faults in 150 turns. The S3 outage is 4 s
        # (not 10) against a 2 s checkpoint retry budget, so some turns are answered
        # durable: false and must become durable at their session's next save.
        args.turns = min(args.turns, 150)
        args.faults = min(args.faults, len(kinds) * len(STAGES))
        args.budget_s = min(args.budget_s, 900.0)
        args.s3_outage_s = min(args.s3_outage_s, 4.0)
        args.checkpoint_retry_s = min(args.checkpoint_retry_s, 2.0)
        args.s3_slow_s = min(args.s3_slow_s, 3.0)
        args.long_execute_s = min(args.long_execute_s, 2.0)
        args.request_timeout_s = min(args.request_timeout_s, 10.0)
        args.turn_deadline_s = min(args.turn_deadline_s, 90.0)
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1 << 30)
    root = Path(tempfile.gettempdir()) / "sandcell-tests"
    root.mkdir(mode=0o711, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="chaos-", dir=root))
    os.chmod(base, 0o711)
    chaos = Chaos(args, base)
    wall_s = 0.0
    try:
        chaos.start()
        wall_s = chaos.run()["wall_s"]
    finally:
        chaos.close()
    summary = chaos.report.summary(wall_s) | {
        "seed": args.seed,
        "provider": args.provider,
        "workers": args.workers,
        "sessions": args.sessions,
        "s3_outage_s": args.s3_outage_s,
        "checkpoint_retry_s": args.checkpoint_retry_s,
        "lock_ttl_s": args.lock_ttl_s,
    }
    text = json.dumps(summary, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    if summary["ok"]:
        shutil.rmtree(base, ignore_errors=True)
    else:
        if args.trace:
            for turn, lines in chaos.timelines(chaos.report.problems).items():
                print(f"-- {turn} ({len(lines)} trace lines)", file=sys.stderr)
                for entry in lines:
                    print(f"   {entry}", file=sys.stderr)
        print(f"kept for a look: {base} (workers' serve.log)", file=sys.stderr)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
