"""``sandcell instances …``: every app-instance route from a shell, against a real serve."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

from sandcell_orchestrator.testing import clean_environ

from .conftest import KEY_A, StartApi


async def test_the_instances_cli_drives_every_route(start_api: StartApi) -> None:
    """create, ls, get, write (committed), run (a failing command exits 1), logs, errors,
    analysis, rm; then the instance is gone (exit 2, not_found)."""
    api = await start_api()
    env = clean_environ(SANDCELL_URL=api.url, SANDCELL_API_KEY=KEY_A)

    async def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "sandcell_orchestrator", "instances", *args],
            input=stdin,
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
            check=False,
        )

    created = await cli("create", "static-site", "demo", "--env", "MODE=test")
    assert created.returncode == 0, created.stderr
    answer = json.loads(created.stdout)
    instance_id = answer["instance_id"]
    assert answer["status"] == "ready"
    assert "?token=" in answer["url"]

    listed = json.loads((await cli("ls")).stdout)
    assert [i["instance_id"] for i in listed["instances"]] == [instance_id]
    info = json.loads((await cli("get", instance_id)).stdout)
    assert (info["template"], info["project_name"]) == ("static-site", "demo")

    wrote = await cli(
        "write", instance_id, "hello.txt", "-", "--message", "Add hello", stdin="hi\n"
    )
    assert wrote.returncode == 0, wrote.stderr
    written = json.loads(wrote.stdout)
    assert written["written"] == ["hello.txt"]
    assert written["commit"]

    ran = await cli("run", instance_id, "cat hello.txt", "echo $MODE", "git log --oneline -1")
    assert ran.returncode == 0, ran.stderr
    results = json.loads(ran.stdout)["results"]
    assert [r["stdout"] for r in results[:2]] == ["hi\n", "test\n"]
    assert "Add hello" in results[2]["stdout"]
    failed = await cli("run", instance_id, "exit 3", "--timeout-s", "5")
    assert failed.returncode == 1
    assert json.loads(failed.stdout)["results"][0]["exit_code"] == 3

    assert (await cli("logs", instance_id, "--lines", "5")).returncode == 0
    errors = await cli("errors", instance_id)
    assert json.loads(errors.stdout) == {"errors": []}
    assert (await cli("errors", instance_id, "--clear")).returncode == 0
    analysis = json.loads((await cli("analysis", instance_id)).stdout)
    assert set(analysis) == {"diagnostics", "tools"}

    removed = await cli("rm", instance_id)
    assert (removed.returncode, removed.stdout) == (0, "")
    gone = await cli("get", instance_id)
    assert gone.returncode == 2
    assert gone.stderr.startswith("sandcell: 404 not_found:")
    no_key = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "sandcell_orchestrator", "instances", "ls"],
        capture_output=True,
        text=True,
        env=clean_environ(SANDCELL_URL=api.url),
        check=False,
    )
    assert no_key.returncode == 2
    assert "SANDCELL_API_KEY" in no_key.stderr
