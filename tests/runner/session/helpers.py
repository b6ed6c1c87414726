"""Helpers for session tests: a session client over real HTTP, and host-side tree digests."""

from __future__ import annotations

import hashlib
import io
import json
import os
import stat
import tarfile
from pathlib import Path
from typing import Any

import httpx

from sandcell_protocol import PROTOCOL_VERSION, runtime_session_id
from tests.fixtures.runner_process import RunnerProcess


def new_session_id(hint: str = "chat") -> str:
    return runtime_session_id("tests", os.urandom(8).hex(), hint)


class SessionClient:
    """Talks to one runner as one runtime session."""

    def __init__(self, runner: RunnerProcess, session_id: str | None = None) -> None:
        self.runner = runner
        self.session_id = session_id or new_session_id()
        self.http = httpx.Client(
            base_url=runner.url,
            headers={**runner.headers(), "X-Runtime-Session-Id": self.session_id},
            timeout=120,
        )

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> SessionClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def execute(self, code: str, language: str = "python", **fields: Any) -> dict[str, Any]:
        response = self.http.post(
            "/v1/execute", json={"language": language, "code": code, **fields}
        )
        assert response.status_code == 200, response.text
        result: dict[str, Any] = response.json()
        return result

    def checkpoint(self, encoding: str = "gzip") -> bytes:
        response = self.http.get("/v1/session/checkpoint", headers={"Accept-Encoding": encoding})
        assert response.status_code == 200, response.text
        return response.content

    def restore(self, archive: bytes, sha256: str | None = None) -> httpx.Response:
        headers = {"X-Sandcell-Checkpoint-Sha256": sha256} if sha256 else {}
        return self.http.post("/v1/session/restore", content=archive, headers=headers)

    def workspace(self) -> Path:
        """The bound session's workspace on the host (the newest ws-N)."""
        candidates = sorted(
            (self.runner.workspace_root / "session").glob("ws-*"),
            key=lambda p: int(p.name.split("-")[1]),
        )
        assert candidates, "no session workspace"
        return candidates[-1]


def tree_digest(root: Path) -> str:
    """A digest of names, types, modes, owners, link targets and file bytes (no links followed)."""
    digest = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            path = Path(dirpath) / name
            st = path.lstat()
            rel = str(path.relative_to(root))
            digest.update(f"{rel}\0{st.st_mode}\0{st.st_uid}\0".encode())
            if stat.S_ISLNK(st.st_mode):
                digest.update(os.readlink(path).encode())
            elif stat.S_ISREG(st.st_mode):
                digest.update(path.read_bytes())
    return digest.hexdigest()


def make_archive(session_id: str, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    """A gzip checkpoint-shaped archive with a valid meta member plus ``members``."""
    buffer = io.BytesIO()
    meta = json.dumps({"session_id": session_id, "protocol": PROTOCOL_VERSION}).encode()
    with tarfile.open(fileobj=buffer, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo(".sandcell-checkpoint.json")
        info.size = len(meta)
        tar.addfile(info, io.BytesIO(meta))
        root = tarfile.TarInfo("workspace")
        root.type = tarfile.DIRTYPE
        root.mode = 0o700
        tar.addfile(root)
        for info, data in members:
            if data is not None:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.addfile(info)
    return buffer.getvalue()
