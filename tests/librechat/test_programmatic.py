"""Programmatic tool calling (``POST /exec/programmatic``) driven by the real client's
``createProgrammaticToolCallingTool``: the code awaits tools, the client runs them
between rounds, the code continues in its code context."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sandcell_orchestrator.serve.librechat.programmatic import python_name
from tests.librechat.conftest import KEY_A, KEY_B, Driver, Serve
from tests.librechat.test_auth_limits import token


def ptc(driver: Driver, serve: Serve, code: str, *tools: str) -> dict[str, Any]:
    return driver.invoke(
        tool="ptc",
        params={"baseUrl": serve.base, "authHeaders": {"X-API-Key": KEY_A}},
        args={"code": code},
        ptc_tools=list(tools),
    )


def test_two_round_trips_with_parallel_calls_then_completion(serve: Serve, driver: Driver) -> None:
    """Round 1 awaits two tools at once (one tool_call_required with both), round 2 one
    more with a hyphenated name; the code keeps its variables across rounds, prints,
    writes a file, and completes; a failing tool raises in the code."""
    code = (
        "sf, ny = await asyncio.gather(get_weather(city='SF'), get_weather(city='NYC'))\n"
        "print('weather', sf['temp_c'], ny['temp_c'])\n"
        "total = await add_numbers(a=sf['temp_c'], b=ny['temp_c'])\n"
        "open('/mnt/data/total.txt', 'w').write(str(total))\n"
        "try:\n"
        "    await fail()\n"
        "except RuntimeError as exc:\n"
        "    print('caught', exc)\n"
        "print('total', total)\n"
    )
    done = ptc(driver, serve, code, "get_weather", "add-numbers", "fail")
    assert done["ok"], done
    assert done["content"].startswith("stdout:\nweather 6 9\ncaught the tool broke\ntotal 15"), done
    (kept,) = done["artifact"]["files"]
    assert kept["name"] == "total.txt"
    with serve.client() as client:
        got = client.get(
            f"/download/{kept['storage_session_id']}/{kept['id']}",
            params={"kind": "user", "id": "anonymous"},
        )
    assert got.content == b"15"


def test_errors_tokens_and_tenants(serve: Serve, driver: Driver) -> None:
    """An exception in the code is status error with its message; a continuation token is
    bound to its tenant (another tenant's use is an unknown token) and single-use."""
    broken = ptc(
        driver, serve, "await get_weather(city='x')\nraise ValueError('nope')\n", "get_weather"
    )
    assert not broken["ok"]
    assert "failed" in broken["error"], broken
    assert "ValueError: nope" in broken["error"], broken

    with serve.client() as a, serve.client(KEY_B) as b:
        first = a.post(
            "/exec/programmatic",
            json={
                "code": "print(await get_weather(city='Oslo'))",
                "tools": [{"name": "get_weather"}],
            },
        ).json()
        assert first["status"] == "tool_call_required", first
        (call,) = first["tool_calls"]
        assert call["name"] == "get_weather"
        assert call["input"] == {"city": "Oslo"}
        answer = {"call_id": call["id"], "result": '{"temp_c": 1}', "is_error": False}
        body = {"continuation_token": first["continuation_token"], "tool_results": [answer]}
        stolen = b.post("/exec/programmatic", json=body)
        assert stolen.status_code == 400
        assert stolen.json()["error"] == "invalid_continuation"
        # The other tenant's attempt leaves the run to its owner, once.
        finished = a.post("/exec/programmatic", json=body).json()
        assert finished["status"] == "completed", finished
        assert finished["stdout"] == "{'temp_c': 1}\n"
        again = a.post("/exec/programmatic", json=body)
        assert again.status_code == 400


def test_tool_names_are_normalized_as_the_client_does(driver: Driver) -> None:
    """The names the code calls tools by match the client's normalizeToPythonIdentifier."""
    names = ["get_weather", "add-numbers", "my tool", "9lives", "class", "match", "a.b/c", "x-y z"]
    expected = driver.invoke(tool="normalize", args={}, names=names)["content"]
    assert [python_name(name) for name in names] == expected


def test_cancel_is_scoped_to_the_tenant_of_the_request_id(serve: Serve) -> None:
    """``X-Librechat-Code-Request-Id`` is the caller's: another tenant sending the same id
    (a run of its own, or a cancel) neither reaches nor unregisters this tenant's run, and
    the owner's cancel still interrupts it."""
    request_id = {"x-librechat-code-request-id": "req-shared-1"}
    slow = {"code": "import time\ntime.sleep(60)\n", "tools": [], "timeout": 90_000}
    with serve.client() as a, serve.client(KEY_B) as b, ThreadPoolExecutor(1) as pool:
        running = pool.submit(a.post, "/exec/programmatic", json=slow, headers=request_id)
        time.sleep(1.0)  # registered before its sandbox is even acquired
        assert not running.done()
        own = b.post("/exec/programmatic", json={"code": "print(1)"}, headers=request_id)
        assert own.json()["status"] == "completed", own.text
        foreign = b.post("/exec/programmatic/cancel", json={"request_id": "req-shared-1"})
        assert foreign.status_code == 404
        assert not running.done()
        cancelled = a.post("/exec/programmatic/cancel", json={"request_id": "req-shared-1"})
        assert cancelled.status_code == 200, cancelled.text
        assert cancelled.json() == {"status": "cancelled"}
        assert running.result(timeout=60).json()["status"] == "error"


def test_a_negative_timeout_is_400(serve: Serve) -> None:
    """``timeout`` is milliseconds, not negative: a 400, as on ``/exec``; without a key
    even a malformed body is a 401."""
    with serve.client() as client:
        answer = client.post("/exec/programmatic", json={"code": "print(1)", "timeout": -5})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"] == "bad_request"
    with serve.client(None) as stranger:
        for route in ("/exec/programmatic", "/exec/programmatic/cancel"):
            assert stranger.post(route, content=b"{").status_code == 401, route


def test_an_api_key_programmatic_output_downloads_for_librechats_user(
    serve: Serve, driver: Driver
) -> None:
    """The client's programmatic tool names no user (its factory has no ``user_id``), and
    LibreChat downloads every output as its user (``?kind=user&id=<user>``): with an API
    key the output was owned by a made-up ``anonymous`` and answered 404. It is now the
    tenant's, and still another tenant's 404; a token's user is never shown it."""
    done = ptc(driver, serve, "open('/mnt/data/ptc-out.txt', 'w').write('made')\nprint(1)\n")
    assert done["ok"], done
    (kept,) = done["artifact"]["files"]
    where = f"/download/{kept['storage_session_id']}/{kept['id']}"
    query = {"kind": "user", "id": "user-1"}
    with serve.client() as a, serve.client(KEY_B) as b:
        got = a.get(where, params=query)
        assert (got.status_code, got.content) == (200, b"made")
        assert b.get(where, params=query).status_code == 404
    # The serve's JWT tenant is tenant-a, KEY_A's: a token's user owns only its own.
    with serve.client(None, Authorization=f"Bearer {token(sub='user-1')}") as vouched:
        assert vouched.get(where, params=query).status_code == 404


def test_a_programmatic_run_names_the_inputs_it_deleted(serve: Serve, driver: Driver) -> None:
    """As on /exec: an input the code removes (after a tool round) is in the artifact's
    ``deleted_files``, so the client drops it from the conversation's session."""
    uploaded = serve.upload([("gone.txt", b"x"), ("kept.txt", b"y")], batch=True).json()
    refs = [
        {
            "id": item["fileId"],
            "resource_id": "user-1",
            "name": item["filename"],
            "storage_session_id": uploaded["storage_session_id"],
            "kind": "user",
        }
        for item in uploaded["files"]
    ]
    code = (
        "import os\n"
        "w = await get_weather(city='Rome')\n"
        "os.remove('/mnt/data/gone.txt')\n"
        "print(w['temp_c'], sorted(os.listdir('/mnt/data')))\n"
    )
    done = driver.invoke(
        tool="ptc",
        params={"baseUrl": serve.base, "authHeaders": {"X-API-Key": KEY_A}},
        args={"code": code},
        ptc_tools=["get_weather"],
        _injected_files=refs,
    )
    assert done["ok"], done
    assert done["content"].startswith("stdout:\n12 ['kept.txt']"), done
    assert done["artifact"]["deleted_files"] == ["gone.txt"]


def test_a_named_session_answers_its_id_and_status_which_the_client_echoes(
    serve: Serve, driver: Driver
) -> None:
    """With the stateful profile's hint the completed answer carries runtime_session_id and
    runtime_status (new, then reused), which the client echoes in its artifact beside
    session_id; a run in a session of its own (no hint) names none."""
    params = {
        "baseUrl": serve.base,
        "authHeaders": {"X-API-Key": KEY_A},
        "statefulSessions": True,
        "executionProfile": "stateful",
        "runtimeSessionHint": "ptc-conv-1",
    }
    code = "print(await add_numbers(a=1, b=2))\nopen('/mnt/data/kept.txt', 'w').write('x')\n"
    answers = [
        driver.invoke(tool="ptc", params=params, args={"code": code}, ptc_tools=["add-numbers"])
        for _ in range(2)
    ]
    for answer in answers:
        assert answer["ok"], answer
        assert answer["content"].startswith("stdout:\n3"), answer
    first, second = (answer["artifact"] for answer in answers)
    assert first["runtime_session_id"].startswith("rt_"), first
    assert first["runtime_status"] == "new"
    assert second["runtime_session_id"] == first["runtime_session_id"]
    assert second["runtime_status"] == "reused"

    alone = ptc(driver, serve, code, "add-numbers")
    assert alone["ok"], alone
    assert "runtime_session_id" not in alone["artifact"], alone
    assert "runtime_status" not in alone["artifact"], alone
