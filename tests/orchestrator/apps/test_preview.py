"""The preview proxy: token then cookie, forwarding rules, WebSocket, against a fake runner."""

from __future__ import annotations

import json

import httpx
import pytest
import websockets
from websockets.asyncio.client import connect

from sandcell_orchestrator.apps.client import AppRunnerClient
from sandcell_orchestrator.apps.preview import COOKIE_NAME
from sandcell_protocol import ErrorBody, ErrorCode, decode

from .fake_runner import (
    CALLER_KEY,
    INSTANCE,
    PREVIEW_TOKEN,
    RUNNER_TOKEN,
    SESSION,
    Preview,
)


def _error(response: httpx.Response) -> ErrorBody:
    return decode(response.content, ErrorBody)


@pytest.mark.parametrize(
    "target",
    [
        f"/preview/{INSTANCE}/",
        f"/preview/{INSTANCE}/?token=wrong",
        f"/preview/app_unknown/?token={PREVIEW_TOKEN}",
    ],
)
async def test_no_valid_token_no_preview(preview: Preview, target: str) -> None:
    """Missing token, wrong token and unknown instance get the same 401; nothing is forwarded."""
    async with httpx.AsyncClient(base_url=preview.url) as client:
        response = await client.get(target)
    assert response.status_code == 401
    assert _error(response).error.code is ErrorCode.UNAUTHORIZED
    assert preview.runner.seen == []


async def test_a_deleted_instance_is_404_to_its_own_token_only(preview: Preview) -> None:
    """An open tab (its token or cookie) learns the instance was deleted: 404. A wrong
    token still gets the 401 an unknown instance gets."""
    async with httpx.AsyncClient(base_url=preview.url) as client:
        first = await client.get(f"/preview/{INSTANCE}/?token={PREVIEW_TOKEN}")
        assert first.status_code == 200
        await preview.instances.shutdown(preview.instance)
        gone = await client.get(f"/preview/{INSTANCE}/")  # the cookie the first visit set
        assert gone.status_code == 404
        assert _error(gone).error.code is ErrorCode.NOT_FOUND
        by_token = await client.get(f"/preview/{INSTANCE}/?token={PREVIEW_TOKEN}")
        assert by_token.status_code == 404
    async with httpx.AsyncClient(base_url=preview.url) as fresh:
        wrong = await fresh.get(f"/preview/{INSTANCE}/?token=wrong")
        assert wrong.status_code == 401


async def test_token_then_cookie(preview: Preview) -> None:
    """?token= is accepted once and answered with an HttpOnly, Lax cookie scoped to the prefix."""
    async with httpx.AsyncClient(base_url=preview.url) as client:
        first = await client.get(f"/preview/{INSTANCE}/index.html?a=1&token={PREVIEW_TOKEN}&b=2")
        assert first.status_code == 200
        cookie = first.headers["set-cookie"]
        assert f"{COOKIE_NAME}={PREVIEW_TOKEN}" in cookie
        assert "HttpOnly" in cookie
        assert "SameSite=lax" in cookie
        assert f"Path=/preview/{INSTANCE}/" in cookie
        assert first.headers["referrer-policy"] == "same-origin"
        second = await client.get(f"/preview/{INSTANCE}/api/data")
        assert second.status_code == 200
        assert "set-cookie" not in second.headers
    forwarded = first.json()
    assert forwarded["raw_path"] == "/v1/session/ports/8000/index.html"
    assert forwarded["query"] == "a=1&b=2"
    assert second.json()["raw_path"] == "/v1/session/ports/8000/api/data"


async def test_forwarded_headers(preview: Preview) -> None:
    """The runner gets its own token, the session and the prefix; never the caller's secrets
    (nor the preview token in the Referer of a page opened with it)."""
    async with httpx.AsyncClient(base_url=preview.url) as client:
        response = await client.get(
            f"/preview/{INSTANCE}/x?token={PREVIEW_TOKEN}",
            headers={
                "Authorization": f"Bearer {CALLER_KEY}",
                "Cookie": f"{COOKIE_NAME}=stale; theme=dark",
                "X-Forwarded-Prefix": "/evil/",
                # What a page opened with ?token= sends with each request it makes.
                "Referer": f"{preview.url}/preview/{INSTANCE}/?a=1&token={PREVIEW_TOKEN}&b=2",
            },
        )
    headers = response.json()["headers"]
    assert headers["referer"] == f"{preview.url}/preview/{INSTANCE}/?a=1&b=2"
    assert headers["authorization"] == f"Bearer {RUNNER_TOKEN}"
    assert headers["x-runtime-session-id"] == SESSION
    assert headers["x-forwarded-prefix"] == f"/preview/{INSTANCE}/"
    assert headers["cookie"] == "theme=dark"
    assert CALLER_KEY not in json.dumps(headers)
    assert PREVIEW_TOKEN not in json.dumps(headers)


async def test_app_answers_pass_through(preview: Preview) -> None:
    """The dev server's status, body and cookies reach the browser unchanged."""
    async with httpx.AsyncClient(base_url=preview.url) as client:
        response = await client.get(f"/preview/{INSTANCE}/missing?token={PREVIEW_TOKEN}")
    assert response.status_code == 404
    assert response.content == b"nope"
    assert "app=1; Path=/" in response.headers.get_list("set-cookie")


@pytest.mark.parametrize("escape", ["%2e%2e/%2e%2e/files/x", "a/%2E%2E/b", "%2e/x"])
async def test_dot_segments_are_refused(preview: Preview, escape: str) -> None:
    """No encoding of '..' can climb out of the ports route into the runner's own routes."""
    async with httpx.AsyncClient(base_url=preview.url) as client:
        url = httpx.URL(f"{preview.url}/preview/{INSTANCE}/?token={PREVIEW_TOKEN}")
        url = url.copy_with(raw_path=f"/preview/{INSTANCE}/{escape}?token={PREVIEW_TOKEN}".encode())
        response = await client.get(url)
    assert response.status_code == 400
    assert _error(response).error.code is ErrorCode.INVALID_PATH
    assert preview.runner.seen == []


async def test_runtime_error_reports_are_forwarded_and_wake_the_webhook_check(
    preview: Preview,
) -> None:
    """The injected reporter's POST goes through like any path, then pokes the supervisor."""
    async with httpx.AsyncClient(base_url=preview.url) as client:
        client.cookies.set(COOKIE_NAME, PREVIEW_TOKEN, path=f"/preview/{INSTANCE}/")
        response = await client.post(
            f"/preview/{INSTANCE}/__sandcell/runtime-errors", json={"message": "boom"}
        )
    assert response.status_code == 200
    assert response.json()["body"] == '{"message":"boom"}'
    assert response.json()["raw_path"] == "/v1/session/ports/8000/__sandcell/runtime-errors"
    assert preview.reports == [1]


async def test_prefix_without_slash_redirects_keeping_the_token(preview: Preview) -> None:
    async with httpx.AsyncClient(base_url=preview.url) as client:
        response = await client.get(f"/preview/{INSTANCE}?token={PREVIEW_TOKEN}")
    assert response.status_code == 307
    assert response.headers["location"] == f"/preview/{INSTANCE}/?token={PREVIEW_TOKEN}"


async def test_preview_traffic_counts_as_activity(preview: Preview) -> None:
    preview.now[0] = 5000.0
    async with httpx.AsyncClient(base_url=preview.url) as client:
        await client.get(f"/preview/{INSTANCE}/?token={PREVIEW_TOKEN}")
    assert preview.instance.last_active == 5000.0


async def test_unreachable_runner_is_a_502(preview: Preview) -> None:
    """A sandbox whose runner does not answer is a retryable 502 busy (the runner's own 502
    app_not_responding is for an app that does not answer), with no secret in it."""
    await preview.instance.runner.close()
    preview.instance.runner = AppRunnerClient(
        "http://127.0.0.1:9", token=RUNNER_TOKEN, session_id=SESSION
    )
    async with httpx.AsyncClient(base_url=preview.url) as client:
        response = await client.get(f"/preview/{INSTANCE}/?token={PREVIEW_TOKEN}")
    assert response.status_code == 502
    assert _error(response).error.code is ErrorCode.BUSY
    assert RUNNER_TOKEN not in response.text


async def test_websocket_is_proxied_with_the_runner_token(preview: Preview) -> None:
    """WebSocket frames go both ways; the runner sees its token and the prefix."""
    ws_url = preview.url.replace("http://", "ws://")
    async with connect(f"{ws_url}/preview/{INSTANCE}/hmr?token={PREVIEW_TOKEN}") as socket:
        await socket.send("ping")
        assert await socket.recv() == "echo:ping"
    (seen,) = [item["ws_headers"] for item in preview.runner.seen if "ws_headers" in item]
    assert seen["x-forwarded-prefix"] == f"/preview/{INSTANCE}/"
    assert seen["x-runtime-session-id"] == SESSION


async def test_websocket_without_token_is_refused(preview: Preview) -> None:
    ws_url = preview.url.replace("http://", "ws://")
    with pytest.raises(websockets.exceptions.InvalidStatus):
        async with connect(f"{ws_url}/preview/{INSTANCE}/hmr"):
            pass
    assert preview.runner.seen == []
