#!/usr/bin/env python3
"""What keeping keyed stateless answers in the snapshot store costs (issue 20).

A keyed stateless ``/v1/exec`` (no session hint) now does one store GET when its
claim is new (is there an answer a wiped registry forgot?) and one store PUT after
its run, before it answers. This measures, on the directory store and on moto's S3
server (loopback; a real S3 adds its own round trips):

- the GET of a missing answer and the PUT of a small answer, alone (p50 / p95)
- a stateless ``print(1)`` through ``sandcell serve`` in process (SQLite registry),
  without a key and with a fresh key each call (p50 / p95): the difference is the
  GET, the PUT and the registry's claim and answer writes

Usage: .venv/bin/python scripts/bench_idempotency.py [--calls 30] [--ops 200]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
from tests.fixtures.paths import traversable_dir  # noqa: E402
from tests.orchestrator.apps.http_server import serve_asgi  # noqa: E402
from tests.orchestrator.conftest import running_s3  # noqa: E402
from tests.orchestrator.serve.fleet import fleet_env  # noqa: E402

from sandcell_orchestrator.bootstrap import open_services  # noqa: E402
from sandcell_orchestrator.config import OrchestratorSettings  # noqa: E402
from sandcell_orchestrator.serve.app import create_app  # noqa: E402
from sandcell_orchestrator.sessions.stateless_answers import (  # noqa: E402
    StatelessAnswer,
    StatelessAnswers,
)
from sandcell_orchestrator.testing import clean_environ  # noqa: E402

KEY = "bench-key-0123456789abcdef"
CALL = json.dumps({"language": "python", "user_id": "u", "code": "print(1)"}).encode()
# 450 bytes: 600 characters of base64 in the stored JSON, as before the typed API.
ANSWER = StatelessAnswer(fingerprint="0" * 64, status=200, body=b"x" * 450)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def line(name: str, values: list[float]) -> str:
    return f"  {name:<34} p50 {statistics.median(values):7.2f} ms   p95 {pct(values, 95):7.2f} ms"


async def timed(work: Callable[[], Awaitable[object]]) -> float:
    started = time.perf_counter()
    await work()
    return (time.perf_counter() - started) * 1000


async def store_ops(answers: StatelessAnswers, ops: int) -> None:
    gets, puts = [], []
    for _ in range(ops):
        stored_key = uuid.uuid4().hex * 2
        gets.append(await timed(lambda k=stored_key: answers.read_result(k)))
        puts.append(await timed(lambda k=stored_key: answers.put_result(k, ANSWER)))
    print(line("GET of a missing answer", gets))
    print(line("PUT of a 0.6 KiB answer", puts))


async def bench(env: dict[str, str], *, calls: int, ops: int) -> None:
    settings = OrchestratorSettings.from_env(clean_environ(**env))
    async with (
        open_services(settings) as services,
        serve_asgi(create_app(settings, services=services), lifespan="on") as url,
        httpx.AsyncClient(base_url=url, timeout=120) as client,
    ):
        await store_ops(services.manager.stateless_answers, ops)
        auth = {"Authorization": f"Bearer {KEY}"}

        async def call(key: str | None) -> None:
            headers = auth | ({"Idempotency-Key": key} if key else {})
            answer = await client.post("/v1/exec", content=CALL, headers=headers)
            assert answer.status_code == 200, answer.text

        for _ in range(3):  # warm up the runner image and the pool
            await call(None)
        plain, keyed = [], []
        for _ in range(calls):  # interleaved: load drifts hit both alike
            plain.append(await timed(lambda: call(None)))
            keyed.append(await timed(lambda: call(uuid.uuid4().hex)))
        print(line("stateless /v1/exec, no key", plain))
        print(line("stateless /v1/exec, keyed", keyed))
        extra = statistics.median(keyed) - statistics.median(plain)
        print(f"  keyed - unkeyed (p50)              {extra:7.2f} ms")


async def main(calls: int, ops: int) -> None:
    with traversable_dir("bench-idem-") as base:
        env = {
            "SANDCELL_HOME": str(base / "home"),
            "SANDCELL_LOCAL_RUNTIME_DIR": str(base / "sandboxes"),
            "SANDCELL_API_KEYS": f"{KEY}=tenant-a",
        }
        print("directory store:")
        await bench(env, calls=calls, ops=ops)
        with running_s3() as s3:
            s3_env = fleet_env("", s3, prefix="bench")
            del s3_env["SANDCELL_REGISTRY_URL"]
            print("moto S3 (loopback):")
            await bench(
                env | s3_env | {"SANDCELL_HOME": str(base / "home-s3")}, calls=calls, ops=ops
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--ops", type=int, default=200)
    args = parser.parse_args()
    asyncio.run(main(args.calls, args.ops))
