"""A context client over real HTTP, and a PNG header reader."""

from __future__ import annotations

import base64
import json
import struct
import threading
import time
from typing import Any

import httpx

from tests.fixtures.runner_process import RunnerProcess
from tests.runner.session.helpers import SessionClient

NDJSON = "application/x-ndjson"


PLOT_CELL = (
    "import matplotlib.pyplot as plt\n"
    "fig = plt.figure(figsize=(4, 3), dpi=50)\n"
    "plt.plot([1, 2, 3], [1, 4, 9])\n"
    "plt.show()"
)
"""A cell that shows one 200x150 px figure."""


class ContextClient(SessionClient):
    """One runtime session's contexts on one runner."""

    def __init__(self, runner: RunnerProcess, session_id: str | None = None) -> None:
        super().__init__(runner, session_id)

    def create(self, **body: Any) -> str:
        response = self.http.post("/v1/session/contexts", json={"language": "python", **body})
        assert response.status_code == 201, response.text
        context_id: str = response.json()["context_id"]
        return context_id

    def run_raw(self, context_id: str, code: str, **fields: Any) -> httpx.Response:
        return self.http.post(
            f"/v1/session/contexts/{context_id}/run", json={"code": code, **fields}
        )

    def run(self, context_id: str, code: str, **fields: Any) -> dict[str, Any]:
        """The one-object answer of a run (asserting 200)."""
        response = self.run_raw(context_id, code, **fields)
        assert response.status_code == 200, response.text
        result: dict[str, Any] = response.json()
        return result

    def stream(self, context_id: str, code: str, **fields: Any) -> list[dict[str, Any]]:
        """The NDJSON events of a run, in order."""
        with self.http.stream(
            "POST",
            f"/v1/session/contexts/{context_id}/run",
            json={"code": code, **fields},
            headers={"Accept": NDJSON},
        ) as response:
            assert response.status_code == 200, response.read()
            assert response.headers["content-type"].startswith(NDJSON)
            return [json.loads(line) for line in response.iter_lines() if line]

    def main_text(self, context_id: str, code: str) -> str:
        result = self.run(context_id, code)
        assert result["status"] == "ok", result
        mains = [r for r in result["results"] if r["is_main_result"]]
        assert len(mains) == 1, result
        text: str = mains[0]["data"]["text/plain"]
        return text


def png_size(data_b64: str) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk."""
    data = base64.b64decode(data_b64)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def interrupt_while_running(
    client: ContextClient, ctx: str, code: str, *, settle_s: float
) -> dict[str, Any]:
    """Runs ``code`` in ``ctx`` on a thread, interrupts it once the context is busy and
    ``settle_s`` more have passed (time to get into the code), and returns the answer."""
    answer: dict[str, Any] = {}

    def run() -> None:
        answer.update(client.run(ctx, code))

    runner = threading.Thread(target=run)
    runner.start()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        state = client.http.get("/v1/session/contexts").json()["contexts"]
        if any(c["context_id"] == ctx and c["state"] == "busy" for c in state):
            break
        time.sleep(0.05)
    time.sleep(settle_s)
    response = client.http.post(f"/v1/session/contexts/{ctx}/interrupt")
    assert response.status_code == 200, response.text
    runner.join(timeout=20)
    assert not runner.is_alive()
    return answer
