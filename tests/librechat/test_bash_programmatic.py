"""The client's bash programmatic tool (``createBashProgrammaticToolCallingTool``, 3.9.2)
against ``POST /exec/programmatic`` with ``lang: "bash"``: each tool is a shell function
taking one JSON string argument, its stdout the tool's result. Before, the body's ``lang``
was ignored and the bash ran as Python (a SyntaxError)."""

from __future__ import annotations

from typing import Any

from tests.librechat.conftest import KEY_A, Driver, Serve


def bash_ptc(driver: Driver, serve: Serve, code: str, *tools: str) -> dict[str, Any]:
    return driver.invoke(
        tool="bashptc",
        params={"baseUrl": serve.base, "authHeaders": {"X-API-Key": KEY_A}},
        args={"code": code},
        ptc_tools=list(tools),
    )


def test_bash_code_calls_tools_in_rounds(serve: Serve, driver: Driver) -> None:
    """Two calls from background jobs at once, then one by a hyphenated tool's bash name
    with a number result, then a failing tool (its message on stderr, a non-zero status);
    a JSON result is one compact JSON value; files written to /mnt/data are kept."""
    code = (
        '{ sf=$(get_weather \'{"city": "SF"}\'); printf \'%s\\n\' "$sf" > /mnt/data/sf.json; } &\n'
        '{ ny=$(get_weather \'{"city": "NYC"}\'); printf \'%s\\n\' "$ny" > /mnt/data/ny.json; } &\n'
        "wait\n"
        'echo "sf $(cat /mnt/data/sf.json) ny $(cat /mnt/data/ny.json)"\n'
        'total=$(add_numbers \'{"a": 6, "b": 9}\')\n'
        'echo "total $total"\n'
        "if fail '{}' 2>/tmp/err; then echo no; else echo \"caught $(cat /tmp/err)\"; fi\n"
    )
    done = bash_ptc(driver, serve, code, "get_weather", "add-numbers", "fail")
    assert done["ok"], done
    assert done["content"].startswith(
        'stdout:\nsf {"city":"SF","temp_c":6} ny {"city":"NYC","temp_c":9}\n'
        "total 15\ncaught the tool broke\n"
    ), done
    kept = {f["name"]: f for f in done["artifact"]["files"]}
    assert set(kept) == {"sf.json", "ny.json"}
    with serve.client() as client:
        got = client.get(
            f"/download/{kept['sf.json']['storage_session_id']}/{kept['sf.json']['id']}",
            params={"kind": "user", "id": "anonymous"},
        )
    assert got.content == b'{"city":"SF","temp_c":6}\n'


def test_a_failing_script_is_an_execution_error(serve: Serve, driver: Driver) -> None:
    """A script that exits non-zero after a tool call is ``status: error`` with the exit
    code as the client words it, and its stderr."""
    code = 'city=$(get_weather \'{"city": "Oslo"}\')\necho "bad $city" >&2\nexit 3\n'
    failed = bash_ptc(driver, serve, code, "get_weather")
    assert not failed["ok"]
    assert "Execution exited with code 3" in failed["error"], failed
    assert 'bad {"city":"Oslo","temp_c":12}' in failed["error"], failed


def test_the_wire_of_a_bash_round(serve: Serve) -> None:
    """Over plain HTTP: the call's input is the JSON argument decoded, a string result is
    the function's stdout as sent; a ``lang`` that is neither Python nor bash is 400."""
    with serve.client() as client:
        first = client.post(
            "/exec/programmatic",
            json={
                "lang": "bash",
                "code": 'echo "got $(lookup \'{"q": [1, 2]}\')"',
                "tools": [{"name": "lookup"}],
            },
        ).json()
        assert first["status"] == "tool_call_required", first
        (call,) = first["tool_calls"]
        assert (call["name"], call["input"]) == ("lookup", {"q": [1, 2]})
        answer = {"call_id": call["id"], "result": "plain text", "is_error": False}
        done = client.post(
            "/exec/programmatic",
            json={"continuation_token": first["continuation_token"], "tool_results": [answer]},
        ).json()
        assert (done["status"], done["stdout"]) == ("completed", "got plain text\n"), done
        ruby = client.post("/exec/programmatic", json={"lang": "ruby", "code": "puts 1"})
    assert (ruby.status_code, ruby.json()["message"]) == (400, "Unsupported language")


def test_bash_tool_names_are_normalized_as_the_client_does(driver: Driver) -> None:
    """The function names match the client's normalizeToBashIdentifier."""
    from sandcell_orchestrator.serve.librechat.programmatic import bash_name

    names = ["get_weather", "add-numbers", "my tool", "9lives", "if", "a.b/c", "x-y z", "local"]
    expected = driver.invoke(tool="normalize_bash", args={}, names=names)["content"]
    assert [bash_name(name) for name in names] == expected


def test_an_attached_workspace_is_refused_as_a_capability(serve: Serve, driver: Driver) -> None:
    """The bash tool with a ``workspaceId`` (LibreChat's attached project, persistent across
    calls) posts to /exec/programmatic with ``X-LibreChat-Code-Workspace-ID``; sandcell has
    no such workspace, so it answers the capability code the client words as "does not
    provide a stateful workspace ... Do not retry", never a run that tells the model its
    project files persist when they do not."""
    refused = driver.invoke(
        tool="bash",
        params={
            "baseUrl": serve.base,
            "authHeaders": {"X-API-Key": KEY_A},
            "workspaceId": "project-1",
        },
        args={"command": "echo hi > notes.txt; cat notes.txt"},
    )
    assert not refused["ok"], refused
    assert "does not provide a stateful workspace" in refused["error"], refused
    assert "Do not retry" in refused["error"], refused


# Tools named like what a shell (and the call code) uses: builtins, special builtins,
# programs, and the old and new helpers' names (``sc-ptc-call``'s bash name is
# ``sc_ptc_call``); ``local`` and ``unset`` become ``local_tool`` / ``unset_tool``.
SHELL_NAMED_TOOLS = (
    *("read", "printf", "cat", "mkfifo", "rm", "break", "builtin", "command", "enable"),
    *("type", "exec", "eval", "set", "trap", "true", "test", "readarray", "hash"),
    *("_sc_ptc_call", "sc_ptc_call", "local", "unset"),
)


def test_tools_named_like_shell_commands_are_called_as_tools(serve: Serve, driver: Driver) -> None:
    """Every tool named like a builtin, a program or the call code's own helper is called
    with its argument and answers its own result, from background jobs (all at once, in
    one round: the client allows 20) and in the script itself. Before, the call code ran
    those names and so the tools: the results were empty (the script "completed"), and a
    tool named ``mkfifo`` recursed until bash crashed."""
    names = " ".join(f"{n}_tool" if n in ("local", "unset") else n for n in SHELL_NAMED_TOOLS)
    code = (
        f"for t in {names}; do\n"
        '  { r=$("$t" "{\\"n\\": \\"$t\\"}"); echo "$t=$r" > "/tmp/r.$t"; } &\n'
        "done\n"
        "wait\n"
        f'for t in {names}; do echo "$(</tmp/r.$t)"; done\n'
        'r=$(cat \'{"n": "again"}\')\n'
        'echo "again=$r"\n'
    )
    done = bash_ptc(driver, serve, code, *SHELL_NAMED_TOOLS)
    assert done["ok"], done
    expected = "".join(
        f"{bash}={name} ok {bash}\n"
        for name, bash in zip(SHELL_NAMED_TOOLS, names.split(), strict=True)
    )
    assert done["content"].startswith(f"stdout:\n{expected}again=cat ok again\n"), done


def test_a_script_past_an_argument_s_limit_runs(serve: Serve, driver: Driver) -> None:
    """200 KB of bash (past the 128 KiB one exec argument holds) calls its tool and
    completes, as does a short script given 5,000 tools; both were ``status: error``
    "Argument list too long: 'bash'" (the script was passed as ``bash -c``)."""
    code = "x='" + "a" * 200_000 + "'\n" + 'echo "${#x} $(get_weather \'{"city": "Rome"}\')"\n'
    done = bash_ptc(driver, serve, code, "get_weather")
    assert done["ok"], done
    assert done["content"].startswith('stdout:\n200000 {"city":"Rome","temp_c":12}'), done
    with serve.client() as client:
        many = client.post(
            "/exec/programmatic",
            json={
                "lang": "bash",
                "code": "echo $(t4999 '{}') done",
                "tools": [{"name": f"t{i}"} for i in range(5000)],
            },
        ).json()
        assert many["status"] == "tool_call_required", many
        (call,) = many["tool_calls"]
        assert call["name"] == "t4999", call
        answer = {"call_id": call["id"], "result": "ok", "is_error": False}
        done = client.post(
            "/exec/programmatic",
            json={"continuation_token": many["continuation_token"], "tool_results": [answer]},
        ).json()
    assert (done["status"], done["stdout"]) == ("completed", "ok done\n"), done
