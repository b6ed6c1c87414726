"""SandboxHandle's commands, files and git: rules checked against a fake, runs on a real runner."""

from __future__ import annotations

import traceback

import pytest

from sandcell_orchestrator.errors import (
    RunnerRequestError,
    SandboxCommandError,
    SandboxTimeoutError,
    SandboxUnavailableError,
    SessionRequiredError,
)
from sandcell_orchestrator.handle import (
    CommandResult,
    SandboxHandle,
    validate_branch,
    validate_remote_url,
)
from sandcell_orchestrator.runner.client import RunnerClient
from sandcell_protocol import RunStatus, runtime_session_id

from .conftest import FakeRunner, json_response, result

SESSION = runtime_session_id("ns", "user", "handle")
AUTH = "Bearer ghp_handleSecret0123456789"


def _handle(runner: RunnerClient, session_id: str | None = None) -> SandboxHandle:
    return SandboxHandle(
        sandbox_id="sb-1", provider="test", runner=runner, session_id=session_id, endpoint=None
    )


# -- commands on a real (stateless) runner ---------------------------------------------


async def test_run_returns_output_of_a_successful_command(client: RunnerClient) -> None:
    """Exit 0: a CommandResult with both streams; env reaches the command."""
    handle = _handle(client)
    outcome = await handle.commands.run('echo "$GREETING"; echo warn >&2', env={"GREETING": "hi"})
    assert outcome == CommandResult(
        exit_code=0, stdout="hi\n", stderr="warn\n", status="ok", wall_ms=outcome.wall_ms
    )


async def test_non_zero_exit_raises_with_exit_code_and_output(client: RunnerClient) -> None:
    """SandboxCommandError carries exit_code, stdout and stderr."""
    handle = _handle(client)
    with pytest.raises(SandboxCommandError) as caught:
        await handle.commands.run("echo partial; echo broken >&2; exit 3")
    assert caught.value.exit_code == 3
    assert caught.value.stdout == "partial\n"
    assert caught.value.stderr == "broken\n"
    assert "exited 3" in str(caught.value)


async def test_a_command_past_its_timeout_raises_timeout(client: RunnerClient) -> None:
    """The runner kills the job at timeout_s and the handle says so."""
    handle = _handle(client)
    with pytest.raises(SandboxTimeoutError):
        await handle.commands.run("sleep 5", timeout_s=0.5)


async def test_commands_without_a_session_run_stateless(client: RunnerClient) -> None:
    """No session: each command gets a fresh workspace."""
    handle = _handle(client)
    await handle.commands.run("echo x > left-behind")
    outcome = await handle.commands.run("ls -A")
    assert outcome.stdout == ""


# -- rules, checked against a fake runner -----------------------------------------------


async def test_cwd_is_validated_and_quoted() -> None:
    """cwd becomes a quoted `cd --`; a path outside the workspace never leaves the client."""
    fake = FakeRunner()
    async with fake.client() as client:
        handle = _handle(client, SESSION)
        await handle.commands.run("pwd", cwd="my dir/$(x)")
        with pytest.raises(RunnerRequestError) as caught:
            await handle.commands.run("pwd", cwd="../etc")
    assert caught.value.code == "invalid_path"
    (sent,) = fake.executes
    assert sent.language == "bash"
    assert sent.code == "cd -- 'my dir/$(x)' || exit\npwd"


async def test_files_need_a_session() -> None:
    """Without a session every file operation raises SessionRequiredError, sending nothing."""
    fake = FakeRunner()
    async with fake.client() as client:
        files = _handle(client).files
        for operation in (
            files.read("a"),
            files.read_bytes("a"),
            files.write("a", "x"),
            files.remove("a"),
            files.list(),
        ):
            with pytest.raises(SessionRequiredError):
                await operation
    assert fake.requests == []


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (RunStatus.INTERNAL_ERROR, SandboxUnavailableError),
        (RunStatus.MEMORY_LIMIT, SandboxCommandError),
        (RunStatus.SIGNALED, SandboxCommandError),
    ],
)
async def test_other_run_statuses_are_errors(status: RunStatus, expected: type[Exception]) -> None:
    """Only status ok with exit 0 is success; a runner failure is retryable unavailability."""
    fake = FakeRunner(handler=lambda request: json_response(result(exit_code=None, status=status)))
    async with fake.client() as client:
        with pytest.raises(expected):
            await _handle(client).commands.run("true")


@pytest.mark.parametrize(
    "name", ["main", "feature/x-1", "release/1.2.3", "user_name/topic.v2", "a" * 200]
)
def test_valid_branch_names(name: str) -> None:
    assert validate_branch(name) == name


@pytest.mark.parametrize(
    "name",
    [
        "",
        "-x",
        ".hidden",
        "a..b",
        "a//b",
        "a/",
        "a.",
        "x.lock",
        "a/b.lock/c",
        "a/.b",
        "a@{1}",
        "a b",
        "a~1",
        "a^",
        "a:b",
        "a?",
        "a*",
        "a[",
        "a\\b",
        "$(id)",
        "a;b",
        "é",
        "a" * 201,
    ],
)
def test_invalid_branch_names_are_refused(name: str) -> None:
    """A conservative subset of check-ref-format; nothing that a shell or git could misread."""
    with pytest.raises(RunnerRequestError):
        validate_branch(name)


@pytest.mark.parametrize(
    "url",
    [
        "https://github.com/org/repo.git",
        "https://git.example.com:8443/a/b",
        "remote.git",
        "sub/dir/repo.git",
        "/tmp/repo.git",
    ],
)
def test_valid_remote_urls(url: str) -> None:
    assert validate_remote_url(url) == url


@pytest.mark.parametrize(
    "url",
    [
        "http://github.com/org/repo",
        "https://user:pw@github.com/org/repo",
        "https://token@github.com/org/repo",
        "ssh://git@github.com/org/repo",
        "git@github.com:org/repo.git",
        "ext::sh -c touch% /tmp/pwned",
        "file:///etc",
        "-uhelp",
        "--upload-pack=touch x",
        "../outside.git",
        "a/../../b",
        "https://github.com/org/repo with space",
        "https://github.com/a\nb",
    ],
)
def test_invalid_remote_urls_are_refused(url: str) -> None:
    """https without credentials, or a local path: no ssh, no ext::, no options, no '..'."""
    with pytest.raises(RunnerRequestError):
        validate_remote_url(url)


async def test_git_credentials_travel_in_the_environment_only() -> None:
    """The header reaches git as GIT_CONFIG_* for that invocation: not in the command
    text, never via `git config`, a file or the URL."""
    fake = FakeRunner()
    async with fake.client() as client:
        git = _handle(client, SESSION).git
        await git.clone("https://example.com/org/repo.git", path="repo", auth_header=AUTH)
        await git.push("origin", "main", path="repo", auth_header=AUTH)
    for sent in fake.executes:
        assert "ghp_" not in sent.code
        assert "git config" not in sent.code
        assert "git -C" in sent.code
        count = int(sent.env["GIT_CONFIG_COUNT"])
        pairs = {
            sent.env[f"GIT_CONFIG_KEY_{i}"]: sent.env[f"GIT_CONFIG_VALUE_{i}"] for i in range(count)
        }
        assert pairs["http.extraHeader"] == f"Authorization: {AUTH}"
        assert pairs["core.hooksPath"] == "/dev/null"
        assert sent.env["GIT_CONFIG_GLOBAL"] == "/dev/null"
        assert sent.env["GIT_TERMINAL_PROMPT"] == "0"


async def test_git_errors_never_echo_the_credential() -> None:
    """Whatever git prints, the header value is scrubbed from message, stdout and stderr."""
    echo = f"fatal: remote said {AUTH} / {AUTH.split()[1]} is bad"
    fake = FakeRunner(
        handler=lambda request: json_response(
            result(exit_code=128, stdout=echo, stderr=echo, status=RunStatus.ERROR)
        )
    )
    async with fake.client() as client:
        with pytest.raises(SandboxCommandError) as caught:
            await _handle(client, SESSION).git.clone(
                "https://example.com/r.git", path="r", auth_header=AUTH
            )
    exc = caught.value
    assert exc.exit_code == 128
    assert "[redacted]" in exc.stderr
    texts = [str(exc), repr(exc), exc.stdout, exc.stderr, "".join(traceback.format_exception(exc))]
    for text in texts:
        assert "ghp_handleSecret" not in text


async def test_a_credential_that_is_not_a_header_value_is_refused() -> None:
    """CR/LF in auth_header would split the header: refused before anything runs."""
    fake = FakeRunner()
    async with fake.client() as client:
        with pytest.raises(RunnerRequestError):
            await _handle(client, SESSION).git.push(auth_header="Bearer x\r\nEvil: 1")
    assert fake.executes == []


async def test_real_git_failure_does_not_echo_the_credential(client: RunnerClient) -> None:
    """A clone that fails in a real jail reports git's error without the header."""
    with pytest.raises(SandboxCommandError) as caught:
        await _handle(client).git.clone("https://127.0.0.1:1/x.git", path="x", auth_header=AUTH)
    assert caught.value.exit_code != 0
    for text in (str(caught.value), caught.value.stdout, caught.value.stderr):
        assert "ghp_handleSecret" not in text


async def test_handle_exposes_its_ids_and_closes_its_client() -> None:
    """The handle is what feature code holds: ids, endpoint, the runner; close is idempotent."""
    fake = FakeRunner()
    client = fake.client()
    handle = SandboxHandle(
        sandbox_id="sb-9", provider="local", runner=client, session_id=SESSION, endpoint="e"
    )
    assert (handle.sandbox_id, handle.provider, handle.session_id, handle.endpoint) == (
        "sb-9",
        "local",
        SESSION,
        "e",
    )
    assert handle.runner is client
    await handle.close()
    await handle.close()
