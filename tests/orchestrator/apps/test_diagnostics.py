"""Diagnostics an agent fixes its code with: analysis, runtime errors (+ webhook), logs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.parse
from typing import Any

import httpx

from sandcell_orchestrator.apps.webhooks import SIGNATURE_HEADER, verify_signature

from .conftest import WEBHOOK_SECRET, StartApi
from .test_instances import eventually

BROKEN = "def ok():\n    return 1\n\n\ndef broken(:\n    pass\n"
LINT = "import os\n\nVALUE = 1\n"
THROWING_JS = (
    'document.getElementById("message").textContent = "about to fail";\nundefinedFunction();\n'
)


async def test_syntax_error_and_ruff_finding_with_positions(start_api: StartApi) -> None:
    """A syntax error and an unused import appear with file, line and column."""
    api = await start_api()
    created = await api.create("python-web")
    instance_id = created["instance_id"]
    baseline = (await api.get(f"/v1/instances/{instance_id}/analysis")).json()
    assert baseline["diagnostics"] == [], baseline
    assert (await api.write(instance_id, {"broken.py": BROKEN, "lint.py": LINT})).status_code == 200
    response = await api.get(f"/v1/instances/{instance_id}/analysis")
    assert response.status_code == 200, response.text
    result = response.json()
    tools = {tool["tool"]: tool for tool in result["tools"]}
    assert tools["ruff"]["available"] is True
    found = result["diagnostics"]
    syntax = [d for d in found if d["file"] == "broken.py"]
    assert syntax, found
    assert all(d["line"] == 5 and d["severity"] == "error" for d in syntax), syntax
    assert any(d["column"] == 12 for d in syntax), syntax
    unused = [d for d in found if d["file"] == "lint.py"]
    assert unused == [
        {
            "file": "lint.py",
            "line": 1,
            "column": 8,
            "severity": unused[0]["severity"],
            "code": "F401",
            "message": unused[0]["message"],
            "tool": "ruff",
        }
    ], found
    assert "os" in unused[0]["message"]


async def test_browser_error_is_deduplicated_and_sent_once_to_the_webhook(
    start_api: StartApi, browser: Any
) -> None:
    """A page that throws, loaded twice: one record counted twice, one signed webhook."""
    api = await start_api()
    hook = f"{api.receiver_url}/hook"
    created = await api.create("static-site", webhook_url=hook)
    instance_id = created["instance_id"]
    assert (await api.write(instance_id, {"app.js": THROWING_JS})).status_code == 200
    page = await browser.new_page()
    for _ in range(2):
        await page.goto(created["url"])
        await page.wait_for_function(
            "document.getElementById('message').textContent === 'about to fail'"
        )

    async def counted_twice() -> list[dict[str, Any]] | None:
        errors = (await api.get(f"/v1/instances/{instance_id}/runtime-errors")).json()["errors"]
        return errors if errors and errors[0]["count"] >= 2 else None

    errors = await eventually(counted_twice)
    assert len(errors) == 1, errors
    (record,) = errors
    assert record["source"] == "browser"
    assert record["category"] == "reference"
    assert "undefinedFunction" in record["message"]

    (call,) = await api.receiver.wait_for(1)
    assert verify_signature(WEBHOOK_SECRET, call.body, call.headers[SIGNATURE_HEADER.lower()])
    payload = json.loads(call.body)
    assert payload["instance_id"] == instance_id
    assert payload["error"]["fingerprint"] == record["fingerprint"]
    # A few more polls: a known fingerprint is not sent again.
    await asyncio.sleep(2)
    assert len(api.receiver.calls) == 1


async def test_server_side_traceback_is_collected(start_api: StartApi) -> None:
    """A Python traceback in the dev server's output becomes a runtime error."""
    api = await start_api()
    created = await api.create("python-web")
    instance_id = created["instance_id"]
    source = (await api.run(instance_id, "cat app.py")).json()["results"][0]["stdout"]
    source = source.replace(
        '    "/api/hello": hello,\n', '    "/api/hello": hello,\n    "/api/boom": lambda: 1 / 0,\n'
    )
    assert (await api.write(instance_id, {"app.py": source})).status_code == 200
    async with httpx.AsyncClient() as client:
        await client.get(created["url"])

        async def boomed() -> bool:
            with contextlib.suppress(httpx.HTTPError):
                await client.get(f"{api.url}/preview/{instance_id}/api/boom")
            errors = (await api.get(f"/v1/instances/{instance_id}/runtime-errors")).json()
            return any(e["type"] == "ZeroDivisionError" for e in errors["errors"])

        await eventually(boomed)
    errors = (await api.get(f"/v1/instances/{instance_id}/runtime-errors")).json()["errors"]
    (record,) = [e for e in errors if e["type"] == "ZeroDivisionError"]
    assert record["source"] == "process:dev"
    assert record["file"] is not None
    assert record["file"].endswith("app.py")
    cleared = await api.client.delete(
        f"/v1/instances/{instance_id}/runtime-errors", headers=api.auth()
    )
    assert cleared.status_code == 204
    assert (await api.get(f"/v1/instances/{instance_id}/runtime-errors")).json()["errors"] == []


async def test_logs_with_lines_and_filter(start_api: StartApi) -> None:
    """The dev server's output: the last N lines, and a regex filter."""
    api = await start_api()
    created = await api.create("python-web")
    instance_id = created["instance_id"]
    async with httpx.AsyncClient() as client:
        await client.get(created["url"])
        for _ in range(5):
            await client.get(f"{api.url}/preview/{instance_id}/api/hello")
    everything = (await api.get(f"/v1/instances/{instance_id}/logs")).json()
    assert any("serving on port 8000" in line for line in everything["lines"])
    last = (await api.get(f"/v1/instances/{instance_id}/logs", lines=3)).json()
    assert len(last["lines"]) == 3
    assert last["lines"] == everything["lines"][-3:]
    hello = (await api.get(f"/v1/instances/{instance_id}/logs", filter="GET /api/hel+o")).json()
    assert len(hello["lines"]) == 5
    assert all("GET /api/hello" in line for line in hello["lines"])


INLINE_THROW = (
    "<!doctype html><html><body><p id='message'>loaded</p>\n"
    "<script>document.getElementById('message').textContent = 'inline';\n"
    "undefinedInline();</script></body></html>\n"
)


async def test_a_browser_error_never_shows_the_preview_token(
    start_api: StartApi, browser: Any
) -> None:
    """An inline script's frame names the page URL, ?token= included: the runtime-errors
    answer and the webhook carry it redacted, never the token itself."""
    api = await start_api()
    created = await api.create("static-site", webhook_url=f"{api.receiver_url}/hook")
    instance_id = created["instance_id"]
    token = urllib.parse.parse_qs(urllib.parse.urlsplit(created["url"]).query)["token"][0]
    assert (await api.write(instance_id, {"index.html": INLINE_THROW})).status_code == 200
    page = await browser.new_page()
    await page.goto(created["url"])
    await page.wait_for_function("document.getElementById('message').textContent === 'inline'")

    async def reported() -> httpx.Response | None:
        response = await api.get(f"/v1/instances/{instance_id}/runtime-errors")
        found = response.json()["errors"]
        return response if any("undefinedInline" in e["message"] for e in found) else None

    response = await eventually(reported)
    assert token not in response.text
    (record,) = [e for e in response.json()["errors"] if "undefinedInline" in e["message"]]
    assert record["top_frame"] is not None
    assert "token=[redacted]" in record["top_frame"], record
    (call,) = await api.receiver.wait_for(1)
    assert token.encode() not in call.body
