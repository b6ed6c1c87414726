"""The ``sandcell`` CLI's main job, as a user runs it: separate processes, fresh home."""

from __future__ import annotations

import ast
import json
import os
import pwd
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sandcell_orchestrator.cli import CLI_NAMESPACE
from sandcell_protocol import ExecuteResult, RunStatus, decode, runtime_session_id

from .conftest import Cli, runner_processes


def session_id(hint: str) -> str:
    return runtime_session_id(CLI_NAMESPACE, pwd.getpwuid(os.getuid()).pw_name, hint)


def assert_clean(cli: Cli) -> None:
    """After a CLI call: no runner process and no runner root left behind."""
    assert runner_processes(cli.runtime_dir) == []
    assert not cli.runtime_dir.exists() or list(cli.runtime_dir.iterdir()) == []


def test_main_job_from_any_directory(cli: Cli, tmp_path: Path) -> None:
    """``scripts/sandcell exec "print(6*7)"`` prints 42 and exits 0, run from elsewhere."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = cli.run("exec", "print(6*7)", script=True, cwd=elsewhere)
    assert (done.returncode, done.stdout) == (0, "42\n"), done.stderr
    assert "Traceback" not in done.stderr
    assert_clean(cli)


def test_session_files_persist_across_processes(cli: Cli) -> None:
    """Two calls with one --session see each other's files, though each is its own process."""
    first = cli.run("exec", "--session", "demo", "open('notes.txt', 'w').write('kept')")
    assert first.returncode == 0, first.stderr
    assert "sandcell: files: notes.txt" in first.stderr
    assert_clean(cli)
    assert cli.checkpoint_files(session_id("demo"))

    second = cli.run("exec", "--session", "demo", "print(open('notes.txt').read())")
    assert (second.returncode, second.stdout) == (0, "kept\n"), second.stderr
    other = cli.run("exec", "--session", "other", "import os; print(os.listdir('.'))")
    assert (other.returncode, other.stdout) == (0, "[]\n"), other.stderr
    assert_clean(cli)


def test_file_is_delivered(cli: Cli, tmp_path: Path) -> None:
    """--file PATH puts the file in the workspace under its base name."""
    data = tmp_path / "data.csv"
    data.write_text("a,b\n1,2\n")
    done = cli.run("exec", "--file", str(data), "print(open('data.csv').read(), end='')")
    assert (done.returncode, done.stdout) == (0, "a,b\n1,2\n"), done.stderr


def test_missing_file_is_one_line(cli: Cli, tmp_path: Path) -> None:
    done = cli.run("exec", "--file", str(tmp_path / "absent"), "print(1)")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1
    assert "absent" in done.stderr


def test_json_output_decodes_as_execute_result(cli: Cli) -> None:
    done = cli.run("exec", "--json", "print('hi')")
    assert done.returncode == 0, done.stderr
    result = decode(done.stdout, ExecuteResult)
    assert (result.status, result.stdout, result.exit_code) == (RunStatus.OK, "hi\n", 0)


def test_code_from_stdin(cli: Cli) -> None:
    done = cli.run("exec", "-", stdin="import sys\nprint(sys.argv[0] != '', 2 + 2)\n")
    assert (done.returncode, done.stdout) == (0, "True 4\n"), done.stderr


def test_exit_code_mirrors_the_job(cli: Cli) -> None:
    """exit(3) exits 3, with the job's stderr and a status line on stderr."""
    done = cli.run("exec", "import sys; print('out'); print('err', file=sys.stderr); exit(3)")
    assert done.returncode == 3
    assert done.stdout == "out\n"
    assert done.stderr.startswith("err\n")
    assert "sandcell: status error, exit code 3" in done.stderr


def test_a_traceback_starts_at_the_users_code(cli: Cli) -> None:
    """An uncaught error's traceback has no wrapper frame (File "<string>"); exit 1."""
    done = cli.run("exec", "def f():\n    1/0\nf()\n")
    assert done.returncode == 1
    assert done.stderr.startswith(
        'Traceback (most recent call last):\n  File "/mnt/job/main.py", line 3, in <module>\n'
    ), done.stderr
    assert "<string>" not in done.stderr
    assert "ZeroDivisionError: division by zero\n" in done.stderr


def test_timeout_exits_124(cli: Cli) -> None:
    """A timeout names its limit and the flag that changes it."""
    done = cli.run("exec", "--timeout-s", "0.5", "while True: pass")
    assert done.returncode == 124, done.stderr
    assert "status timeout" in done.stderr
    assert "time limit of 0.5 s (--timeout-s N changes it" in done.stderr
    assert_clean(cli)


def test_ctrl_c_keeps_what_the_job_wrote_like_a_timeout(cli: Cli) -> None:
    """SIGINT mid-turn: the output so far is printed, stderr says the job was stopped and
    what the session kept, exit 130; the next turn sees the interrupted turn's file (the
    rule a timeout follows too)."""
    assert cli.run("exec", "--session", "int", "open('kept', 'w').write('1')").returncode == 0
    call = subprocess.Popen(
        [
            # A terminal's Ctrl-C reaches a CLI whose SIGINT is at its default; a test
            # command started in the background by a non-interactive shell inherits
            # SIGINT ignored (which Python then keeps), so the child restores it.
            sys.executable,
            "-c",
            "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL);"
            " os.execv(sys.argv[1], sys.argv[1:])",
            *cli.command(),
            "exec",
            "--session",
            "int",
            "open('partial', 'w').write('x')\nprint('started', flush=True)\n"
            "import time\ntime.sleep(60)",
        ],
        env=cli.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert call.stdout is not None
    assert call.stdout.readline() == "started\n"
    call.send_signal(signal.SIGINT)
    _, stderr = call.communicate(timeout=120)
    assert call.returncode == 130, stderr
    assert "sandcell: interrupted: the job was stopped\n" in stderr
    assert "session 'int' keeps what the job wrote before it stopped" in stderr
    listing = cli.run("exec", "--session", "int", "import os; print(sorted(os.listdir('.')))")
    assert listing.stdout == "['kept', 'partial']\n", listing.stderr
    timed_out = cli.run(
        "exec",
        "--session",
        "int",
        "--timeout-s",
        "1",
        "open('late', 'w').write('y')\nwhile 1: pass",
    )
    assert timed_out.returncode == 124
    assert "session 'int' keeps what the job wrote before it was stopped" in timed_out.stderr
    listing = cli.run("exec", "--session", "int", "import os; print(sorted(os.listdir('.')))")
    assert listing.stdout == "['kept', 'late', 'partial']\n", listing.stderr
    assert_clean(cli)


def test_sessions_list_and_destroy(cli: Cli) -> None:
    """list shows the session; destroy removes it and its checkpoint."""
    assert cli.run("exec", "--session", "demo", "open('f', 'w').write('x')").returncode == 0
    sid = session_id("demo")

    listing = cli.run("sessions", "list")
    assert listing.returncode == 0, listing.stderr
    assert f"{sid}  suspended" in listing.stdout  # its row outlives the call
    assert listing.stdout.rstrip().endswith("demo")
    rows = json.loads(cli.run("sessions", "list", "--json").stdout)
    assert [(r["session_id"], r["hint"], r["checkpoint"]) for r in rows] == [(sid, "demo", True)]

    destroyed = cli.run("sessions", "destroy", "demo")
    assert (destroyed.returncode, destroyed.stdout) == (0, f"destroyed {sid}\n"), destroyed.stderr
    assert not cli.checkpoint_files(sid)
    assert sid not in cli.run("sessions", "list").stdout
    again = cli.run("sessions", "destroy", sid)
    assert again.returncode == 1
    assert "no session" in again.stderr

    fresh = cli.run("exec", "--session", "demo", "import os; print(os.listdir('.'))")
    assert fresh.stdout == "[]\n", fresh.stderr
    assert_clean(cli)


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["exec", "--session", "no spaces", "print(1)"], {}, "--session"),
        (["exec", "print(1)"], {"SANDCELL_PROVIDER": "nope"}, "SANDCELL_PROVIDER"),
        (["exec", "print(1)"], {"SANDCELL_RUNTIME_SESSION_MODE": "strict"}, "session hint"),
        (["exec", "--language", "cobol", "print(1)"], {}, "cobol"),
        (["sessions", "destroy", "not a hint"], {}, "--session"),
        (["sessions", "list"], {"SANDCELL_LOG_LEVEL": "loud"}, "SANDCELL_LOG_LEVEL"),
    ],
)
def test_errors_are_one_line_and_exit_2(
    cli: Cli, args: list[str], env: dict[str, str], message: str
) -> None:
    """Errors from sandcell are one clear line on stderr and exit 2; never a traceback."""
    done = cli.run(*args, env=env)
    assert done.returncode == 2, done
    assert done.stderr.startswith("sandcell: "), done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert message in done.stderr
    assert "Traceback" not in done.stderr
    assert_clean(cli)


@pytest.mark.parametrize(
    ("asked", "level"), [(None, "WARNING"), ("debug", "DEBUG"), ("ERROR", "ERROR")]
)
def test_the_log_level_is_the_commands_own_unless_set(
    cli: Cli, asked: str | None, level: str
) -> None:
    """``SANDCELL_LOG_LEVEL`` (either case) sets the process's logging level; unset, a
    command keeps its own (``serve`` info, the others warning)."""
    probe = (
        "import logging, sys; from sandcell_orchestrator.cli import main;"
        " code = main(['sessions', 'list']);"
        " print(logging.getLevelName(logging.getLogger().level)); sys.exit(code)"
    )
    env = {**cli.env, **({} if asked is None else {"SANDCELL_LOG_LEVEL": asked})}
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == level


def test_parallel_calls_on_one_session_never_lose_a_turn(cli: Cli) -> None:
    """Three ``sandcell exec --session race`` processes at once: each turn is either
    kept (exit 0, its file is there afterwards) or refused as busy (exit 75, one
    line saying so, its file never made); none exits 0 and then vanishes."""
    calls = [
        subprocess.Popen(
            [
                *cli.command(),
                "exec",
                "--session",
                "race",
                f"import time; open('turn{i}', 'w').write('{i}'); time.sleep(0.5)",
            ],
            env=cli.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(3)
    ]
    outcomes = [(call.wait(timeout=300), call.communicate()[1]) for call in calls]
    kept = {f"turn{i}" for i, (code, _) in enumerate(outcomes) if code == 0}
    for code, stderr in outcomes:
        if code != 0:
            assert code == 75, stderr
            assert stderr.startswith("sandcell: session 'race' is busy"), stderr
            assert "did not run" in stderr
    assert kept, outcomes
    listing = cli.run("exec", "--session", "race", "import os; print(sorted(os.listdir('.')))")
    assert listing.returncode == 0, listing.stderr
    assert sorted(ast.literal_eval(listing.stdout)) == sorted(kept)
    assert_clean(cli)


def test_output_is_printed_as_the_job_produces_it(cli: Cli) -> None:
    """A line printed before a sleep is on the CLI's stdout before the job ends (the job's
    own end time, printed last, is later than when we read the line); the summary comes
    after the job's stderr."""
    code = (
        "import sys, time\n"
        "print('early', flush=True)\n"
        "time.sleep(1.5)\n"
        "print('end', time.time())\n"
        "print('bye', file=sys.stderr)\n"
        "open('f', 'w').write('x')\n"
    )
    call = subprocess.Popen(
        [*cli.command(), "exec", code],
        env=cli.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert call.stdout is not None
    assert call.stdout.readline() == "early\n"
    early_at_s = time.time()
    rest, stderr = call.communicate(timeout=300)
    assert call.returncode == 0, stderr
    job_end_s = float(rest.split()[-1])
    assert early_at_s < job_end_s
    assert stderr == "bye\nsandcell: files: f\n"


def test_env_out_and_the_files_commands(cli: Cli, tmp_path: Path) -> None:
    """--env reaches the job, --out writes the turn's files locally, and files ls/get/put
    work on the session's workspace between turns (put is kept for the next turn)."""
    out_dir = tmp_path / "out"
    done = cli.run(
        "exec",
        "--session",
        "fs",
        "--env",
        "GREETING=hi there",
        "--out",
        str(out_dir),
        "import os; os.makedirs('sub'); open('sub/a.txt', 'w').write(os.environ['GREETING'])",
    )
    assert done.returncode == 0, done.stderr
    assert (out_dir / "sub" / "a.txt").read_text() == "hi there"

    listing = cli.run("files", "ls", "--session", "fs")
    assert listing.returncode == 0, listing.stderr
    assert [line.split()[::2] for line in listing.stdout.splitlines()] == [["dir", "sub"]]
    fetched = cli.run("files", "get", "--session", "fs", "sub/a.txt", "-")
    assert (fetched.returncode, fetched.stdout) == (0, "hi there"), fetched.stderr

    local = tmp_path / "notes.md"
    local.write_text("# notes\n")
    put = cli.run("files", "put", "--session", "fs", str(local), "docs/notes.md")
    assert put.returncode == 0, put.stderr
    seen = cli.run("exec", "--session", "fs", "print(open('docs/notes.md').read(), end='')")
    assert (seen.returncode, seen.stdout) == (0, "# notes\n"), seen.stderr
    copy = tmp_path / "copy.md"
    got = cli.run("files", "get", "--session", "fs", "docs/notes.md", str(copy))
    assert got.returncode == 0, got.stderr
    assert copy.read_text() == "# notes\n"
    bad = cli.run("exec", "--env", "NOEQUALS", "print(1)")
    assert bad.returncode == 2
    assert "KEY=VALUE" in bad.stderr
    assert_clean(cli)


def test_usual_language_aliases_are_accepted(cli: Cli) -> None:
    """py means python, shell means sh; an unknown name lists what is offered."""
    done = cli.run("exec", "--language", "py", "print(1 + 1)")
    assert (done.returncode, done.stdout) == (0, "2\n"), done.stderr
    shell = cli.run("exec", "--language", "shell", "echo $((2 + 3))")
    assert (shell.returncode, shell.stdout) == (0, "5\n"), shell.stderr
    unknown = cli.run("exec", "--language", "cobol", "DISPLAY 1")
    assert "offered: " in unknown.stderr
    assert "python" in unknown.stderr


def test_wait_s_queues_parallel_calls_instead_of_refusing(cli: Cli) -> None:
    """With --wait-s, two calls on one session at once both run, one after the other,
    and both turns are kept."""
    calls = [
        subprocess.Popen(
            [
                *cli.command(),
                "exec",
                "--session",
                "queue",
                "--wait-s",
                "120",
                f"import time; open('turn{i}', 'w').write('{i}'); time.sleep(0.5)",
            ],
            env=cli.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outcomes = [(call.wait(timeout=300), call.communicate()[1]) for call in calls]
    assert [code for code, _ in outcomes] == [0, 0], outcomes
    listing = cli.run("exec", "--session", "queue", "import os; print(sorted(os.listdir('.')))")
    assert listing.stdout == "['turn0', 'turn1']\n", listing.stderr
    assert_clean(cli)
