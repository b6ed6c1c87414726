"""The turn trace: one DEBUG line of ``sandcell_orchestrator.sessions.turn`` per step of a
turn (held, attached, committed; the applied check after a wiped registry), tagged with
a prefix of the turn's stored idempotency key, naming its fields, and never showing the
client's key, the whole stored key, the code, its output or the API key. And
``scripts/chaos.py --trace`` maps those tags back to its turns' names."""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import sys
import uuid
from pathlib import Path
from types import ModuleType

import httpx
import pytest

from sandcell_orchestrator.bootstrap import open_services
from sandcell_orchestrator.config import OrchestratorSettings
from sandcell_orchestrator.serve.app import create_app
from sandcell_orchestrator.serve.idempotency import Idempotency
from sandcell_orchestrator.sessions.turn import TRACE_KEY_CHARS, trace_tag
from sandcell_orchestrator.testing import clean_environ
from sandcell_protocol import runtime_session_id
from tests.orchestrator.apps.http_server import serve_asgi

API_KEY = "trace-key-0123456789abcdef"
TURN_LOGGER = "sandcell_orchestrator.sessions.turn"
SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "chaos.py"
# The code and its output carry a marker that must never reach a log line.
SECRET = "s3cr3t-" + uuid.uuid4().hex[:8]
CODE = f"open('log', 'a').write({SECRET!r}); print(open('log').read())"


def _trace_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == TURN_LOGGER and r.levelno == logging.DEBUG
    ]


def _fields(line: str) -> dict[str, str]:
    return dict(re.findall(r"(\w[\w-]*)=(\S+)", line))


async def test_a_keyed_turn_traces_its_steps_by_a_digest_of_its_key(
    tmp_path: Path, runtime_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=TURN_LOGGER)
    env = {
        "SANDCELL_HOME": str(tmp_path / "home"),
        "SANDCELL_LOCAL_RUNTIME_DIR": str(runtime_dir),
        "SANDCELL_API_KEYS": f"{API_KEY}=tenant-a",
    }
    hint, header_key = f"h-{uuid.uuid4().hex[:8]}", f"client-secret-{uuid.uuid4().hex}"
    stored = Idempotency.scoped("v1/exec", "tenant-a", header_key)
    tag = trace_tag(stored)
    session_id = runtime_session_id("tenant-a", "u", hint)
    body = {"language": "python", "user_id": "u", "runtime_session_hint": hint, "code": CODE}
    auth = {"Authorization": f"Bearer {API_KEY}"}
    settings = OrchestratorSettings.from_env(clean_environ(**env))
    async with (
        open_services(settings) as services,
        serve_asgi(create_app(settings, services=services), lifespan="on") as url,
        httpx.AsyncClient(base_url=url, timeout=120) as client,
    ):
        first = await client.post(
            "/v1/exec", json=body, headers=auth | {"Idempotency-Key": header_key}
        )
        assert first.status_code == 200, first.text
        assert SECRET in first.text
        # An unkeyed turn is traced too, as "-".
        second = await client.post("/v1/exec", json=body, headers=auth)
        assert second.status_code == 200, second.text
        deleted = await client.delete(f"/v1/sessions/{session_id}", headers=auth)
        assert deleted.status_code == 204, deleted.text

    lines = _trace_lines(caplog)
    keyed = [line for line in lines if line.startswith(f"turn {tag} ")]
    # No record: the registry may have forgotten it (a wiped Redis looks the same), so
    # the keyed turn asks the store whether it was applied before it runs.
    steps = ["held", "attached", "applied-check", "committed"]
    assert [line.split()[2] for line in keyed] == steps, lines
    held, attached, check, committed = (_fields(line) for line in keyed)
    assert held["session"] == session_id[:11]
    assert set(held) >= {"generation", "record", "adopted", "forgot", "checkpoint"}
    assert (held["record"], held["forgot"]) == ("False", "True")
    assert check["found"] == "False"
    assert (attached["launched"], attached["restored"]) == ("True", "False")
    assert attached["sandbox"] != "-"
    assert committed["durable"] == "True"
    assert committed["checkpoint"] != "-"
    assert committed["generation"] == held["generation"]
    unkeyed = [line for line in lines if line.startswith("turn - ")]
    assert [line.split()[2] for line in unkeyed] == ["held", "attached", "committed"], lines
    assert _fields(unkeyed[0])["record"] == "True"

    everything = caplog.text + "\n".join(lines)
    assert len(tag) == TRACE_KEY_CHARS
    for secret in (header_key, stored, SECRET, API_KEY):
        assert secret not in everything


def _chaos() -> ModuleType:
    spec = importlib.util.spec_from_file_location("chaos_script", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("chaos_script", module)
    spec.loader.exec_module(module)
    return module


def test_chaos_trace_maps_tags_back_to_turns_across_workers() -> None:
    chaos = _chaos()
    keys = {"t7": "turn-aaa", "t8": "turn-bbb"}
    tags = {turn: chaos.trace_tag_of(key) for turn, key in keys.items()}
    assert tags["t7"] == trace_tag(Idempotency.scoped("v1/exec", "chaos", "turn-aaa"))

    def entry(stamp: str, tag: str, rest: str) -> str:
        return f"2026-12-07 20:00:{stamp} DEBUG {TURN_LOGGER}: turn {tag} {rest}"

    logs = {
        "w0": "\n".join(
            [
                entry("01,100", tags["t7"], "held session=rt_1 generation=3"),
                "2026-12-07 20:00:01,200 INFO other: noise",
                entry("03,000", tags["t7"], "committed session=rt_1 durable=True"),
            ]
        ),
        "w1": "\n".join(
            [
                entry("02,500", tags["t7"], "held session=rt_1 generation=4"),
                entry("02,600", tags["t8"], "held session=rt_2 generation=1"),
            ]
        ),
    }
    timelines = chaos.turn_timelines(logs, tags, ["t7", "t9"])
    assert timelines["t9"] == []
    assert [line.split()[2:5] for line in timelines["t7"]] == [
        ["w0", "t7", "held"],
        ["w1", "t7", "held"],
        ["w0", "t7", "committed"],
    ]
    assert all(tags["t7"] not in line for line in timelines["t7"])
    assert json.dumps(timelines)  # printable as it is
