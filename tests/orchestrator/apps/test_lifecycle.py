"""Lifecycle: the health loop restarts dead dev servers, recovers dead runners; idle shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal

import httpx

from .conftest import StartApi, sandbox_processes
from .test_instances import eventually


async def test_a_killed_dev_server_shows_exited_and_the_health_loop_restarts_it(
    start_api: StartApi,
) -> None:
    api = await start_api(SANDCELL_APP_HEALTH_INTERVAL_S="2")
    created = await api.create("python-web")
    instance_id = created["instance_id"]
    (instance,) = api.apps.instances.all()
    process = await instance.runner.process("dev")
    assert process is not None
    assert process.state == "running"
    if process.pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGKILL)
    else:
        await instance.runner.stop_process("dev")

    async def shown_exited() -> bool:
        info = (await api.get(f"/v1/instances/{instance_id}")).json()
        return bool(info["dev_server"] == "exited")

    await eventually(shown_exited, timeout_s=5, interval_s=0.05)

    async def running_again() -> bool:
        info = (await api.get(f"/v1/instances/{instance_id}")).json()
        return bool(info["dev_server"] == "running" and info["status"] == "ready")

    await eventually(running_again)
    async with httpx.AsyncClient() as client:
        assert (await client.get(created["url"])).status_code == 200


async def test_a_dead_runner_is_recovered_from_its_checkpoint_keeping_id_and_url(
    start_api: StartApi,
) -> None:
    """Kill the runner: the instance comes back in a new sandbox, same id, URL and files."""
    api = await start_api(SANDCELL_APP_HEALTH_INTERVAL_S="1")
    created = await api.create("python-web")
    instance_id = created["instance_id"]
    written = await api.write(instance_id, {"notes.txt": "keep me\n"}, message="Add notes")
    assert written.status_code == 200
    (instance,) = api.apps.instances.all()

    async def checkpointed() -> bool:
        return not instance.dirty

    await eventually(checkpointed)
    old_sandbox = instance.handle.sandbox_id
    state = json.loads((api.runtime_dir / old_sandbox / "sandbox.json").read_text())
    os.killpg(state["pid"], signal.SIGKILL)

    async def recovered() -> bool:
        info = (await api.get(f"/v1/instances/{instance_id}")).json()
        return bool(
            instance.handle.sandbox_id != old_sandbox
            and info["status"] == "ready"
            and info["dev_server"] == "running"
        )

    await eventually(recovered, timeout_s=60)
    async with httpx.AsyncClient() as client:
        page = await client.get(created["url"])
    assert page.status_code == 200
    notes = await api.run(instance_id, "cat notes.txt", "git log --format=%s -1")
    first, second = notes.json()["results"]
    assert first["stdout"] == "keep me\n"
    assert second["stdout"] == "Add notes\n"
    assert not (api.runtime_dir / old_sandbox).exists()


async def test_idle_instances_are_shut_down_and_preview_traffic_keeps_one_alive(
    start_api: StartApi,
) -> None:
    api = await start_api(SANDCELL_APP_IDLE_TIMEOUT_S="3")
    idle = await api.create("static-site")
    busy = await api.create("static-site")
    async with httpx.AsyncClient() as client:
        await client.get(busy["url"])
        for _ in range(12):
            await asyncio.sleep(0.5)
            assert (
                await client.get(f"{api.url}/preview/{busy['instance_id']}/")
            ).status_code == 200

        async def idle_gone() -> bool:
            return (await api.get(f"/v1/instances/{idle['instance_id']}")).status_code == 404

        await eventually(idle_gone, timeout_s=10)
        assert (await api.get(f"/v1/instances/{busy['instance_id']}")).status_code == 200
        assert (await client.get(idle["url"])).status_code == 404  # its tab learns it is gone
    runners = [
        p for p in sandbox_processes(api.runtime_dir) if "sandcell_runner" in " ".join(p.cmdline())
    ]
    assert len(runners) == 1
