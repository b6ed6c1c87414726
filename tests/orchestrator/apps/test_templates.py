"""Templates: manifest parsing, the registry over directories and git repositories."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
from pathlib import Path

import pytest

from sandcell_orchestrator.apps.settings import SHIPPED_TEMPLATES_DIR, AppSettings
from sandcell_orchestrator.apps.templates import (
    MANIFEST_NAME,
    TemplateError,
    TemplateNotFoundError,
    TemplateRegistry,
    parse_manifest,
)
from sandcell_orchestrator.errors import ConfigError

MINIMAL = b'preview_port = 8080\n[start]\ncommand = "python3 -m http.server $PORT"\n'


def test_shipped_templates_are_the_default_and_parse() -> None:
    """With no SANDCELL_TEMPLATES, the repository's templates/ are configured."""
    settings = AppSettings.from_env({})
    assert set(settings.templates) >= {"python-web", "static-site"}
    for name in ("python-web", "static-site"):
        manifest = parse_manifest((SHIPPED_TEMPLATES_DIR / name / MANIFEST_NAME).read_bytes())
        assert manifest.start.command
        assert manifest.preview_port == 8000


def test_manifest_defaults() -> None:
    """The ready check defaults to the preview port, any HTTP answer, 30 s."""
    manifest = parse_manifest(MINIMAL)
    assert manifest.install is None
    assert manifest.ready_port == 8080
    assert manifest.ready.path is None
    assert manifest.ready.timeout_s == 30.0


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        (MINIMAL + b"colour = 'blue'\n", "colour"),
        (b'preview_port = 8080\n[start]\ncmd = "x"\n', "cmd"),
        (b"preview_port = 8080\n", "start"),
        (b'preview_port = 0\n[start]\ncommand = "x"\n', "preview_port"),
        (MINIMAL + b'[ready]\npath = "no-slash"\n', "path"),
        (b"this is not toml", "template"),
    ],
)
def test_bad_manifests_are_refused(text: bytes, fragment: str) -> None:
    """Unknown keys, missing sections and bad values fail at load, naming the field."""
    with pytest.raises(TemplateError, match=fragment):
        parse_manifest(text)


def _make_template(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / MANIFEST_NAME).write_bytes(MINIMAL)
    (root / "index.html").write_text("<h1>hi</h1>")
    (root / "bin").mkdir()
    (root / "bin" / "run.sh").write_text("#!/bin/sh\necho run\n")
    os.chmod(root / "bin" / "run.sh", 0o755)
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "x.pyc").write_bytes(b"\0")
    (root / "link").symlink_to("/etc/passwd")
    return root


async def test_directory_templates_copy_regular_files_with_their_exec_bit(tmp_path: Path) -> None:
    """Regular files only (no symlink out, no caches), executables stay executable."""
    root = _make_template(tmp_path / "tpl")
    template = await TemplateRegistry({"tpl": str(root)}).load("tpl")
    files = {item.path: item for item in template.files}
    assert sorted(files) == ["bin/run.sh", "index.html", MANIFEST_NAME]
    assert files["bin/run.sh"].mode == 0o755
    assert files["index.html"].mode == 0o644
    assert files["index.html"].data == b"<h1>hi</h1>"


async def test_git_templates_are_cloned_at_a_ref(tmp_path: Path) -> None:
    """A git+ source is cloned on the host (at #ref), read, and the clone removed."""
    root = _make_template(tmp_path / "repo")
    env = {**os.environ, "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_CONFIG_NOSYSTEM": "1"}

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(root), *args], check=True, env=env, capture_output=True)

    git("init", "-q", "-b", "main")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    git("tag", "v1")
    (root / "index.html").write_text("<h1>two</h1>")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "two")
    registry = TemplateRegistry({"head": f"git+file://{root}", "tagged": f"git+file://{root}#v1"})
    head = {item.path: item.data for item in (await registry.load("head")).files}
    tagged = {item.path: item.data for item in (await registry.load("tagged")).files}
    assert head["index.html"] == b"<h1>two</h1>"
    assert tagged["index.html"] == b"<h1>hi</h1>"
    assert ".git" not in {path.split("/")[0] for path in head}


async def test_git_clone_failure_is_a_template_error(tmp_path: Path) -> None:
    """A repository that cannot be cloned fails the load with git's own last line."""
    registry = TemplateRegistry({"gone": f"git+file://{tmp_path}/missing"})
    with pytest.raises(TemplateError, match="cloning the template failed"):
        await registry.load("gone")


async def test_unknown_template_names_the_configured_ones(tmp_path: Path) -> None:
    root = _make_template(tmp_path / "tpl")
    with pytest.raises(TemplateNotFoundError, match="configured: tpl"):
        await TemplateRegistry({"tpl": str(root)}).load("nope")


async def test_a_missing_manifest_is_a_template_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(TemplateError, match=MANIFEST_NAME):
        await TemplateRegistry({"empty": str(tmp_path / "empty")}).load("empty")


def test_settings_read_from_the_environment(tmp_path: Path) -> None:
    """Every variable is read from the mapping given (never os.environ)."""
    settings = AppSettings.from_env(
        {
            "SANDCELL_TEMPLATES": f"a={tmp_path}, b=git+https://example.com/b.git#main",
            "SANDCELL_APP_HEALTH_INTERVAL_S": "5",
            "SANDCELL_APP_IDLE_TIMEOUT_S": "60",
            "SANDCELL_APP_WEBHOOK_SECRET": "s" * 32,
            "SANDCELL_APP_GIT_AUTHOR": "App Bot <bot@example.com>",
            "SANDCELL_PUBLIC_URL": "https://apps.example.com/",
        }
    )
    assert settings.templates == {"a": str(tmp_path), "b": "git+https://example.com/b.git#main"}
    assert settings.health_interval_s == 5.0
    assert settings.idle_timeout_s == 60.0
    assert settings.git_author.name == "App Bot"
    assert settings.git_author.email == "bot@example.com"
    assert settings.public_url == "https://apps.example.com"
    assert "s" * 32 not in repr(settings)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("SANDCELL_TEMPLATES", "noequals"),
        ("SANDCELL_TEMPLATES", "x=relative/dir"),
        ("SANDCELL_APP_HEALTH_INTERVAL_S", "soon"),
        ("SANDCELL_APP_IDLE_TIMEOUT_S", "-1"),
        ("SANDCELL_APP_WEBHOOK_SECRET", "short"),
        ("SANDCELL_APP_GIT_AUTHOR", "no email"),
        ("SANDCELL_PUBLIC_URL", "ftp://x"),
    ],
)
def test_bad_settings_name_the_variable(name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=name):
        AppSettings.from_env({name: value})


async def test_a_cancelled_clone_does_not_run_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a timed-out clone was killed: a load cancelled meanwhile (an instance
    create whose caller went) left git cloning on into the scratch directory that
    the load's ``finally`` removed. Here ``git`` is a stand-in that never ends."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    pid_file = tmp_path / "git.pid"
    fake = bin_dir / "git"
    fake.write_text(
        f"#!/bin/sh\necho $$ > {pid_file}.tmp\nmv {pid_file}.tmp {pid_file}\nexec sleep 600\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    registry = TemplateRegistry({"slow": "git+https://example.invalid/slow.git"})
    load = asyncio.create_task(registry.load("slow"))
    async with asyncio.timeout(60):
        while not pid_file.exists():
            await asyncio.sleep(0.01)
    pid = int(pid_file.read_text())
    try:
        load.cancel()
        with pytest.raises(asyncio.CancelledError):
            await load
        assert not _alive(pid), "the clone ran on after its load was cancelled"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"
