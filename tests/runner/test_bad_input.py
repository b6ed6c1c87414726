"""Bad input never reaches a 500 (issue 14, item 8): a real runner, real nsjail, real HTTP.

Each case answers a well-formed 200 result or a 4xx with a protocol error code,
and the runner keeps serving. Hostile file trees and inline-file sets generated
by Hypothesis check the same property beyond the cases found by hand.
"""

from __future__ import annotations

import base64
import itertools
import json
import string
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandcell_protocol import ErrorCode, ExecuteResult, decode, unescape_name
from sandcell_protocol.env_vars import MAX_ENV_BYTES, env_bytes
from tests.fixtures.paths import traversable_dir
from tests.fixtures.runner_process import RunnerProcess, running_runner
from tests.golden import load_golden
from tests.runner.helpers import b64, execute, execute_raw

GOLDEN = load_golden()
SESSION = "rt_" + "b" * 64


@pytest.fixture(scope="module")
def runner() -> Iterator[RunnerProcess]:
    """One session-enabled runner for the module: stateless jobs and one bound session."""
    with (
        traversable_dir() as root,
        running_runner(root, env={"SANDCELL_RUNNER_SESSIONS": "1"}) as process,
    ):
        yield process


def _post(runner: RunnerProcess, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(
        runner.url + "/v1/execute",
        json=body,
        headers=runner.headers(**headers),
        timeout=120,
    )


def _assert_serving(runner: RunnerProcess) -> None:
    assert httpx.get(runner.url + "/health", timeout=10).json()["status"] == "ok"
    assert execute(runner, language="sh", code="echo alive")["stdout"] == "alive\n"


def _files(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {item["name"]: item for item in result["files"]}


def test_a_file_name_that_is_not_utf8_is_surfaced_escaped(runner: RunnerProcess) -> None:
    """b'\\xc3.txt' next to a plain file: both surface, the odd one under the protocol's
    escaping (the golden wire name), with its content; a link to a non-UTF-8 target too."""
    code = (
        "import os\n"
        "open(b'\\xc3.txt', 'wb').write(b'odd')\n"
        "open('plain.txt', 'w').write('plain')\n"
        "os.symlink(b'\\xff\\xfe', b'link')\n"
    )
    result = execute(runner, language="python", code=code)
    assert result["status"] == "ok", result
    decode(json.dumps(result).encode(), ExecuteResult)
    files = _files(result)
    vector = next(v for v in GOLDEN["escaped_name"] if v["raw_hex"] == b"\xc3.txt".hex())
    assert set(files) == {"plain.txt", vector["name"], "link"}
    assert unescape_name(vector["name"]) == b"\xc3.txt"
    assert base64.b64decode(files[vector["name"]]["content_b64"]) == b"odd"
    assert base64.b64decode(files["plain.txt"]["content_b64"]) == b"plain"
    assert unescape_name(files["link"]["symlink_target"]) == b"\xff\xfe"
    _assert_serving(runner)


def test_a_file_a_thousand_directories_deep_is_surfaced(runner: RunnerProcess) -> None:
    """A 2,008-byte path (1,000 directories) is walked without recursion, and surfaced."""
    code = (
        "import os\n"
        "for _ in range(1000):\n"
        "    os.mkdir('d'); os.chdir('d')\n"
        "open('test.txt', 'w').write('deep')\n"
    )
    result = execute(runner, language="python", code=code)
    assert result["status"] == "ok", result
    (item,) = result["files"]
    assert item["name"] == "d/" * 1000 + "test.txt"
    assert len(item["name"]) == 2008
    assert base64.b64decode(item["content_b64"]) == b"deep"
    _assert_serving(runner)


@pytest.mark.parametrize("order", [("dir", "dir/test.txt"), ("dir/test.txt", "dir")])
def test_inline_file_and_a_file_under_it_is_a_400(
    runner: RunnerProcess, order: tuple[str, str]
) -> None:
    """``dir`` and ``dir/test.txt`` in one request, in either order: 400 invalid_path."""
    body = {
        "language": "sh",
        "code": "ls",
        "inline_files": [{"name": name, "content_b64": b64("x")} for name in order],
    }
    response = execute_raw(runner, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "invalid_path"
    _assert_serving(runner)


def test_session_inline_file_over_a_directory_is_a_400(runner: RunnerProcess) -> None:
    """An inline file whose name the session's workspace holds as a directory: 400, and
    the session's files, listed with a non-UTF-8 name escaped, are still there."""
    header = {"X-Runtime-Session-Id": SESSION}
    made = _post(
        runner,
        {"language": "python", "code": "import os; os.mkdir('dir'); open(b'dir/\\xc3', 'w')"},
        **header,
    )
    assert made.status_code == 200, made.text
    body = {"language": "sh", "code": "ls", "inline_files": [{"name": "dir", "content_b64": ""}]}
    response = execute_raw(runner, body, **header)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "invalid_path"
    listing = httpx.get(
        runner.url + "/v1/session/files/dir", headers=runner.headers(**header), timeout=30
    )
    assert listing.status_code == 200, listing.text
    assert [entry["name"] for entry in listing.json()["entries"]] == ["\\xc3"]
    _assert_serving(runner)


# -- properties ---------------------------------------------------------------------

_component = st.one_of(
    st.binary(min_size=1, max_size=12).map(lambda b: b.replace(b"/", b"_").replace(b"\0", b"_")),
    st.sampled_from([b"a", b"b", b"\xc3", b"\xff\xfe", b"a\\b", b"x" * 255, b"..", b"."]),
)
_entry = st.tuples(
    st.lists(_component, min_size=1, max_size=4),
    st.sampled_from(["file", "dir", "symlink", "fifo", "deep"]),
    st.binary(max_size=16),
)

# The job builds the tree from the spec on stdin, ignoring what the tree makes impossible
# (a file where a directory was asked for, '..' out of the workspace, ...).
_BUILD = r"""
import json, os, sys
root = os.getcwd()
for parts, kind, extra in json.load(sys.stdin):
    parts = [bytes.fromhex(p) for p in parts]
    path = b"/".join(parts)
    try:
        os.chdir(root)
        if len(parts) > 1:
            os.makedirs(b"/".join(parts[:-1]), exist_ok=True)
        if kind == "file":
            # O_NONBLOCK: where an earlier entry made a fifo, a plain open would
            # wait for a reader until the job's timeout (ENXIO instead).
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK, 0o644)
            with os.fdopen(fd, "wb") as out:
                out.write(bytes.fromhex(extra))
        elif kind == "dir":
            os.makedirs(path, exist_ok=True)
        elif kind == "symlink":
            os.symlink(bytes.fromhex(extra) or b"/etc/passwd", path)
        elif kind == "fifo":
            os.mkfifo(path)
        elif kind == "deep":
            os.makedirs(path, exist_ok=True)
            os.chdir(path)
            for _ in range(1100 + len(extra)):
                os.mkdir(b"d")
                os.chdir(b"d")
            open(b"leaf", "wb").write(b"leaf")
    except (OSError, ValueError):
        pass
"""


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(tree=st.lists(_entry, min_size=1, max_size=8))
def test_hostile_file_trees_never_give_a_5xx(
    runner: RunnerProcess, tree: list[tuple[list[bytes], str, bytes]]
) -> None:
    """Whatever tree a job leaves, the answer is a valid 200 result whose names unescape."""
    spec = [[[p.hex() for p in parts], kind, extra.hex()] for parts, kind, extra in tree]
    response = _post(
        runner,
        {"language": "python", "code": _BUILD, "stdin": json.dumps(spec), "timeout_ms": 60_000},
    )
    assert response.status_code == 200, response.text
    result = decode(response.content, ExecuteResult)
    # The job's own end may be a timeout on a loaded machine; the runner's never a fault.
    assert result.status in ("ok", "timeout"), result.stderr
    for item in result.files:
        assert unescape_name(item.name)
        if item.symlink_target is not None:
            unescape_name(item.symlink_target)
    assert httpx.get(runner.url + "/health", timeout=10).json()["status"] == "ok"


_inline_name = st.one_of(
    st.sampled_from(
        ["a", "a/b", "a/b/c", "./a", "a//b", "b", "..", "../a", "/abs", "a\\b", "é/ü", ".", ""]
    ),
    st.text(max_size=20),
    st.just("x" * 256),
)
_inline = st.fixed_dictionaries(
    {
        "name": _inline_name,
        "content_b64": st.one_of(st.binary(max_size=32).map(b64), st.sampled_from(["!!", "A"])),
        "executable": st.booleans(),
    }
)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(files=st.lists(_inline, max_size=5), session=st.booleans())
def test_hostile_inline_file_sets_never_give_a_5xx(
    runner: RunnerProcess, files: list[dict[str, Any]], session: bool
) -> None:
    """Any set of inline files is run (200) or refused with a 4xx and a protocol code."""
    headers = {"X-Runtime-Session-Id": SESSION} if session else {}
    response = execute_raw(
        runner, {"language": "sh", "code": "true", "inline_files": files}, **headers
    )
    assert response.status_code < 500, response.text
    if response.status_code != 200:
        assert response.json()["error"]["code"] in set(ErrorCode)
        assert response.status_code in (400, 413), response.text
    else:
        decode(response.content, ExecuteResult)


def test_the_runner_is_unchanged_after_the_properties(runner: RunnerProcess) -> None:
    """After every hostile input above: healthy, same languages, and it still runs jobs."""
    health = httpx.get(runner.url + "/health", headers=runner.headers(), timeout=10).json()
    assert health["status"] == "ok"
    assert {"python", "sh"} <= set(health["languages"])
    assert "internal error" not in runner.log().lower()
    assert "Traceback" not in runner.log()
    _assert_serving(runner)


def test_a_path_number_past_int_parsing_is_a_404_not_a_500(runner: RunnerProcess) -> None:
    """A pid or port path segment of more digits than ``int()`` parses (4300) matches no
    route (404 ``not_found``); it raised in the router's converter, a 500."""
    headers = runner.headers(**{"X-Runtime-Session-Id": SESSION})
    digits = "9" * 5000
    for method, path in (
        ("GET", f"/v1/session/sandbox/processes/{digits}/events"),
        ("POST", f"/v1/session/sandbox/processes/{digits}/signal"),
        ("GET", f"/v1/session/ports/{digits}/x"),
    ):
        answer = httpx.request(method, runner.url + path, headers=headers, timeout=60)
        assert answer.status_code == 404, answer.text
        assert answer.json()["error"]["code"] == ErrorCode.NOT_FOUND
    _assert_serving(runner)


# Names a POSIX file may have: a newline anywhere (at the end too), other control
# characters, DEL. Starlette's ``path`` converter (``.*``) matched none with a newline
# inside, and ``ends\n`` as ``ends`` (``$`` matches before a final newline).
_ODD_NAMES = ["a\nb", "ends\n", "\n", "ctl\t\r\x01\x1b\x7f\nx"]


def test_any_posix_file_name_moves_through_the_file_routes(runner: RunnerProcess) -> None:
    """PUT, GET, list and DELETE of names holding a newline and other control characters
    (in a directory whose name has one too), and of a file a job made; NUL and ``..``
    are still 400 ``invalid_path``, a missing file the same 404 as any."""
    with httpx.Client(
        base_url=runner.url,
        headers=runner.headers(**{"X-Runtime-Session-Id": SESSION}),
        timeout=60,
    ) as client:

        def url(path: str) -> str:
            return "/v1/session/files/" + quote(path, safe="/")

        made = client.post(
            "/v1/execute",
            json={
                "language": "python",
                "code": "import os; os.makedirs('odd\\nd'); "
                "open('odd\\nd/job\\nmade', 'w').write('by a job')",
            },
        )
        assert made.status_code == 200, made.text
        assert client.get(url("odd\nd/job\nmade")).content == b"by a job"
        for name in _ODD_NAMES:
            path = f"odd\nd/{name}"
            written = client.put(url(path), content=name.encode())
            assert written.status_code == 200, (name, written.text)
            assert written.json()["name"] == name
            read = client.get(url(path))
            assert read.status_code == 200, (name, read.text)
            assert read.content == name.encode()
        listing = client.get(url("odd\nd") + "/")
        assert listing.status_code == 200, listing.text
        assert {e["name"] for e in listing.json()["entries"]} == {"job\nmade", *_ODD_NAMES}
        # "ends\n" was written as itself, not as "ends".
        never = client.get(url("odd\nd/ends"))
        assert never.status_code == 404, never.text
        assert never.json()["error"]["code"] == ErrorCode.NOT_FOUND
        for name in [*_ODD_NAMES, "job\nmade"]:
            removed = client.delete(url(f"odd\nd/{name}"))
            assert removed.status_code == 204, (name, removed.text)
            gone = client.get(url(f"odd\nd/{name}"))
            assert gone.status_code == 404, gone.text
            assert gone.json()["error"] == {
                **never.json()["error"],
                "message": f"no such file: odd\nd/{name}",
            }
        assert never.json()["error"]["message"] == "no such file: odd\nd/ends"
        for bad in ("odd%0Ad/a%00b", "odd%0Ad/%2E%2E/%2E%2E/x", "a%0A/%2E%2E/%2E%2E/x"):
            refused = client.put("/v1/session/files/" + bad, content=b"x")
            assert refused.status_code == 400, (bad, refused.text)
            assert refused.json()["error"]["code"] == ErrorCode.INVALID_PATH
        assert client.delete(url("odd\nd")).status_code == 204
    _assert_serving(runner)


def test_an_environment_past_the_jails_room_is_a_400(runner: RunnerProcess) -> None:
    """Variables too large for the jail's configuration could never start a job: it was
    the runner's 500 ``internal`` ("job configuration too large"), at every run. Past
    ``MAX_ENV_BYTES`` (as ``env_bytes`` counts, escapes included) it is a 400 naming the
    limit, never the value; at the limit, escapes and all, the job runs."""
    room = MAX_ENV_BYTES - len("A=")
    fits = {"A": "x" * (room - 2 * 4 - 2 * 2) + "\n\x01" + '"\\'}
    assert env_bytes(fits) == MAX_ENV_BYTES
    ran = execute(runner, language="sh", code='printf %s "$A" | wc -c', env=fits)
    assert ran["stdout"].strip() == str(room - 8), ran
    for env in ({"A": "y" * (room + 1)}, {"A": "\n" * (room // 4 + 1)}, {"A": "z" * (1 << 20)}):
        refused = execute_raw(runner, {"language": "sh", "code": "true", "env": env})
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["code"] == ErrorCode.BAD_REQUEST
        assert f"more than the {MAX_ENV_BYTES}" in error["message"]
        assert "yyy" not in error["message"]
        assert "zzz" not in error["message"]
    _assert_serving(runner)


def _most_variables() -> dict[str, str]:
    """As many variables as ``validate_env`` admits: distinct names as short as names
    go (``[A-Za-z_][A-Za-z0-9_]*``), empty values, up to ``MAX_ENV_BYTES``."""
    first = string.ascii_letters + "_"
    names = (
        head + "".join(tail)
        for size in itertools.count(0)
        for head in first
        for tail in itertools.product(first + string.digits, repeat=size)
    )
    env: dict[str, str] = {}
    size = 0
    for name in names:
        size += env_bytes({name: ""})
        if size > MAX_ENV_BYTES:
            break
        env[name] = ""
    assert env_bytes(env) <= MAX_ENV_BYTES
    return env


def test_as_many_variables_as_the_env_rule_admits_run(runner: RunnerProcess) -> None:
    """Each variable is a line of the jail's configuration (``envar: "…"``), 10 bytes
    more than ``env_bytes`` counts: 5,000 empty ones (30,000 bytes by ``env_bytes``)
    made 83 KB, past the old 60,000-byte cap, the runner's 500 "environment too big" at
    every run. Whatever the rule admits now runs, the most variables too."""
    many = {f"V{i:04d}": "" for i in range(5000)}
    ran = execute(runner, language="sh", code="env | grep -c '^V[0-9]'", env=many)
    assert ran["stdout"].strip() == "5000", ran
    most = _most_variables()
    assert len(most) == 13_149  # nsjail_config.MAX_CONFIG_BYTES's arithmetic
    ran = execute(runner, language="sh", code="env | wc -l", env=most)
    assert ran["exit_code"] == 0, ran
    assert int(ran["stdout"]) >= len(most), ran
    # Python jobs may start from a warm interpreter (the zygote), sent the environment.
    ran = execute(runner, language="python", code="import os; print(len(os.environ))", env=most)
    assert int(ran["stdout"]) >= len(most), ran
    _assert_serving(runner)
