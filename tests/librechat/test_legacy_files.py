"""Older LibreChat servers' file calls (``api/server/services/Files/Code`` before codeEnvRef).

Before each run such a server lists the file's storage session
(``GET /files/{session_id}?detail=summary``, plus ``entity_id`` for an agent's file,
with only its API key), finds the file by ``name`` and re-uploads it unless the entry's
``lastModified`` is under 23 hours old. An agent's files are uploaded with an
``entity_id`` form field and ``User-Id``: they are the agent's, seen by every user of
the agent in the tenant, and by nobody in another tenant.
"""

from __future__ import annotations

import re
import subprocess
from datetime import UTC, datetime
from typing import Any

import httpx

from tests.librechat.conftest import KEY_A, KEY_B, Driver, Serve
from tests.librechat.test_auth_limits import token

ISO_MS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
UNKNOWN = "Zz0123456789abcdefghi"
"""A well-formed id nothing has."""


def legacy_upload(
    serve: Serve, name: str, body: bytes, *, user: str, entity_id: str | None = None
) -> tuple[str, str]:
    """As an older LibreChat's ``uploadCodeEnvFile``: ``entity_id`` (if any), the file,
    ``User-Id``; its answer names the storage session ``session_id``."""
    data = {} if entity_id is None else {"entity_id": entity_id}
    with serve.client(KEY_A, **{"User-Id": user}) as client:
        answer = client.post("/upload", data=data, files=[("file", (name, body))])
    assert answer.status_code == 200, answer.text
    got = answer.json()
    return got["session_id"], got["files"][0]["fileId"]


def entry_of(listing: httpx.Response, session: str, file_id: str) -> dict[str, Any] | None:
    """The listing's entry for the file, found as the old server finds it (by name)."""
    assert listing.status_code == 200, listing.text
    entries: list[dict[str, Any]] = listing.json()
    return next((e for e in entries if e["name"].startswith(f"{session}/{file_id}")), None)


def test_a_summary_listing_has_last_modified_as_javascript_reads_it(serve: Serve) -> None:
    """``detail=summary`` entries carry ``lastModified`` (they had none, so an older
    LibreChat re-uploaded every file before every run): an ISO 8601 UTC string to the
    millisecond, the upload's time, which JavaScript's ``Date`` reads back exactly, and
    the same as the object info's."""
    before = datetime.now(UTC).replace(microsecond=0)
    session, file_id = legacy_upload(serve, "notes.txt", b"notes\n", user="user-1")
    after = datetime.now(UTC)
    with serve.client(KEY_A) as client:
        entry = entry_of(
            client.get(f"/files/{session}", params={"detail": "summary"}), session, file_id
        )
        assert entry is not None
        info = client.get(f"/sessions/{session}/objects/{file_id}").json()
    modified = entry["lastModified"]
    assert isinstance(modified, str), entry
    assert ISO_MS.match(modified), entry
    assert modified == info["lastModified"]
    assert before <= datetime.strptime(modified, "%Y-%m-%dT%H:%M:%S.%f%z") <= after
    read_back = subprocess.run(
        ["node", "-e", "console.log(new Date(process.argv[1]).toISOString())", modified],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    assert read_back == modified


def test_an_agent_file_is_its_agents_within_the_tenant_only(serve: Serve, driver: Driver) -> None:
    """A file uploaded with ``entity_id`` is the agent's: another user of the tenant who
    names the entity (``?entity_id=``, or today's ``kind=agent&id=``) lists, inspects and
    downloads it, and the legacy client primes it; without the entity, with another
    entity, or from another tenant it is exactly what a missing file is. An entity id
    never reaches a user's own file."""
    agent = "agent_abc123"
    session, file_id = legacy_upload(
        serve, "agent.csv", b"a,b\n1,2\n", user="owner-1", entity_id=agent
    )
    private, private_id = legacy_upload(serve, "private.txt", b"mine\n", user="owner-1")
    summary = {"detail": "summary"}

    with serve.client(KEY_A, **{"User-Id": "user-2"}) as other:
        seen = entry_of(
            other.get(f"/files/{session}", params={**summary, "entity_id": agent}), session, file_id
        )
        assert seen is not None
        assert seen["metadata"] == {"original-filename": "agent.csv"}
        assert ISO_MS.match(seen["lastModified"])
        where = {"entity_id": agent}
        assert other.get(f"/sessions/{session}/objects/{file_id}", params=where).status_code == 200
        assert other.get(f"/download/{session}/{file_id}", params=where).content == b"a,b\n1,2\n"
        today = {"kind": "agent", "id": agent}
        assert other.get(f"/download/{session}/{file_id}", params=today).status_code == 200

        # Not without the entity (the file is not user-2's), nor with another one.
        for query in ({}, {"entity_id": "agent_other"}):
            assert (
                entry_of(
                    other.get(f"/files/{session}", params={**summary, **query}), session, file_id
                )
                is None
            )
            assert (
                other.get(f"/sessions/{session}/objects/{file_id}", params=query).status_code == 404
            )
        # Nor does an entity id open a user's own file, even one named like its user.
        for entity in (agent, "owner-1"):
            query = {"entity_id": entity}
            assert other.get(f"/files/{private}", params={**summary, **query}).json() == []
            assert other.get(f"/download/{private}/{private_id}", params=query).status_code == 404

    # A token's user (the one identity the service verifies) gets the same, no more.
    with serve.client(None, Authorization=f"Bearer {token(sub='user-3')}") as verified:
        assert (
            verified.get(f"/download/{session}/{file_id}", params={"entity_id": agent}).status_code
            == 200
        )
        assert (
            verified.get(
                f"/download/{private}/{private_id}", params={"entity_id": agent}
            ).status_code
            == 404
        )

    # Another tenant naming the entity gets exactly the answers for ids nothing has.
    with serve.client(KEY_B) as stranger:
        for sid, fid in ((session, file_id), (UNKNOWN, UNKNOWN)):
            query = {"entity_id": agent}
            assert stranger.get(f"/files/{sid}", params={**summary, **query}).json() == []
            info = stranger.get(f"/sessions/{sid}/objects/{fid}", params=query)
            download = stranger.get(f"/download/{sid}/{fid}", params=query)
            assert (info.status_code, info.json()) == (
                404,
                {"error": "not_found", "message": "file not found"},
            )
            assert (download.status_code, download.json()) == (404, info.json())

    # The older client's run primes it by its legacy ref.
    run = driver.invoke(
        version="legacy",
        params={"LIBRECHAT_CODE_API_KEY": KEY_A},
        args={"lang": "py", "code": "print(open('agent.csv').read().splitlines()[1])"},
        _injected_files=[{"id": file_id, "name": "agent.csv", "session_id": session}],
    )
    assert run["ok"], run
    assert run["content"].startswith("stdout:\n1,2"), run


def test_an_entity_id_must_be_an_id(serve: Serve) -> None:
    """An ``entity_id`` that breaks the id rule (a control character) is a 400."""
    with serve.client(KEY_A, **{"User-Id": "user-1"}) as client:
        answer = client.post(
            "/upload", data={"entity_id": "agent\x01x"}, files=[("file", ("x.txt", b"x"))]
        )
    assert answer.status_code == 400, answer.text
    assert "entity_id" in answer.json()["message"]
