"""The documentation and the configuration readers name the same variables.

An operator configures sandcell from README.md, docs/ and images/README.md; the
processes read their environment through one reader each
(``OrchestratorSettings.from_env``, ``RunnerSettings.from_env``). This test
records every variable those readers look up (in each configuration that reads
more: every provider, S3 snapshots, a token file) and checks both directions:

- every ``SANDCELL_*`` variable a reader looks up is named in the docs, so a new
  setting cannot ship undocumented;
- every ``SANDCELL_*`` variable the docs name is looked up by a reader, or is one
  of the few read elsewhere (``OTHER_READERS``, each checked against the file that
  reads it), so a renamed or removed setting cannot linger in the docs.

The docs may abbreviate a name after a full one in the same line, as
```SANDCELL_RUNNER_UID_MIN` / `_UID_MAX``: a backticked ``_SUFFIX`` stands for the
full name with some trailing words replaced by it.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

from sandcell_orchestrator.config import OrchestratorSettings
from sandcell_orchestrator.providers.docker_settings import DockerSettings
from sandcell_orchestrator.providers.local_settings import LocalSettings
from sandcell_runner.config import RunnerSettings

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "images" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

OTHER_READERS: dict[str, tuple[str, str]] = {
    # name: (the file that reads it, why it is not a setting of a reader above)
    "SANDCELL_URL": ("packages/orchestrator/src/sandcell_orchestrator/cli/instances.py", "client"),
    "SANDCELL_API_KEY": (
        "packages/orchestrator/src/sandcell_orchestrator/cli/instances.py",
        "client",
    ),
    "SANDCELL_DEBUG": ("packages/orchestrator/src/sandcell_orchestrator/cli/__init__.py", "CLI"),
    "SANDCELL_PYTHON": ("scripts/sandcell", "the set-up script's interpreter"),
    "SANDCELL_DEBIAN_MIRROR": ("scripts/build-runner-image", "image build"),
    "SANDCELL_TEST_DOCKER_HOST": ("scripts/services-podman", "the test services"),
    "SANDCELL_TEST_DOCKER_IMAGE": ("scripts/services-podman", "the test services"),
    "SANDCELL_KEY": ("docs/librechat.md", "a compose substitution the example defines"),
    "SANDCELL_RUNNER_SPAWN_HELPER": (
        "docs/performance.md",
        "a removed switch in a benchmark's history",
    ),
}

_NAME = re.compile(r"SANDCELL_[A-Z0-9_]+")
_FULL_THEN_SHORT = re.compile(r"`(SANDCELL_[A-Z0-9_]*[A-Z0-9])`|`(_[A-Z0-9_]*[A-Z0-9])`")


class _Recording(Mapping[str, str]):
    """An environment that remembers every name looked up in it."""

    def __init__(self, values: Mapping[str, str]) -> None:
        self._values = dict(values)
        self.looked_up: set[str] = set()

    def __getitem__(self, key: str) -> str:
        self.looked_up.add(key)
        return self._values[key]

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            self.looked_up.add(key)
        return key in self._values

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


_HOME = {"HOME": "/home/operator"}
_ORCHESTRATOR_CONFIGURATIONS: list[dict[str, str]] = [
    {},
    {"SANDCELL_PROVIDER": "docker"},
    {
        "SANDCELL_PROVIDER": "lambda-microvm",
        "SANDCELL_MICROVM_IMAGE": "arn:aws:lambda:us-east-1:1:microvm-image/sandcell",
        "SANDCELL_MICROVM_ROLE_ARN": "arn:aws:iam::123456789012:role/sandcell",
    },
    # Unset keys: the reader falls back to the AWS / MinIO names.
    {"SANDCELL_SNAPSHOT_URL": "s3://snapshots/prefix"},
    {
        "SANDCELL_SNAPSHOT_URL": "s3://snapshots/prefix",
        "SANDCELL_S3_ACCESS_KEY": "access",
        "SANDCELL_S3_SECRET_KEY": "secret-key-value",
    },
]
_TOKEN = "t" * 24
_RUNNER_CONFIGURATIONS: list[dict[str, str]] = [
    {"SANDCELL_RUNNER_TOKEN": _TOKEN},
    {"SANDCELL_RUNNER_TOKEN_FILE": "/run/secrets/runner-token"},
]


def _read_by_the_readers() -> set[str]:
    names: set[str] = set()
    for extra in _ORCHESTRATOR_CONFIGURATIONS:
        env = _Recording({**_HOME, **extra})
        # A configuration the reader refuses still looked its names up.
        with contextlib.suppress(Exception):
            OrchestratorSettings.from_env(env)
        names |= env.looked_up
    for extra in _RUNNER_CONFIGURATIONS:
        env = _Recording(extra)
        with contextlib.suppress(Exception):
            RunnerSettings.from_env(env, read_token_file=lambda _path: _TOKEN)
        names |= env.looked_up
    return {name for name in names if name.startswith("SANDCELL_")}


def _written_out(text: str) -> set[str]:
    """Full names; a name ending in ``_`` is a prefix (``SANDCELL_RUNNER_*``), not a variable."""
    return {name for name in _NAME.findall(text) if not name.endswith("_")}


def _abbreviated(text: str) -> set[str]:
    """Each ```_SUFFIX``` after a full name on its line, as every name it could stand for."""
    candidates: set[str] = set()
    for line in text.splitlines():
        last: list[str] | None = None
        for full, short in _FULL_THEN_SHORT.findall(line):
            if full:
                last = full.split("_")
            elif last is not None:
                for keep in range(1, len(last)):
                    candidates.add("_".join(last[:keep]) + short)
    return candidates


def _documented() -> tuple[set[str], set[str]]:
    text = "\n".join(path.read_text() for path in DOCS)
    return _written_out(text), _abbreviated(text)


def test_the_readers_are_recorded() -> None:
    """The recording sees the readers' lookups (so the checks below are not vacuous)."""
    read = _read_by_the_readers()
    assert {"SANDCELL_PROVIDER", "SANDCELL_DOCKER_IMAGE", "SANDCELL_MICROVM_IMAGE"} <= read
    assert {
        "SANDCELL_S3_ACCESS_KEY",
        "SANDCELL_RUNNER_TOKEN_FILE",
        "SANDCELL_RUNNER_UID_MAX",
    } <= read
    assert len(read) > 120, len(read)


def test_every_variable_a_reader_looks_up_is_documented() -> None:
    written, abbreviated = _documented()
    missing = sorted(_read_by_the_readers() - written - abbreviated)
    assert not missing, f"read at start-up but named in no doc (README.md, docs/): {missing}"


def test_every_documented_variable_is_read() -> None:
    written, _ = _documented()
    unread = sorted(written - _read_by_the_readers() - OTHER_READERS.keys())
    assert not unread, f"named in the docs but read by no configuration reader: {unread}"


def test_the_other_readers_still_read_their_variables() -> None:
    for name, (where, _why) in OTHER_READERS.items():
        assert name in (ROOT / where).read_text(), (name, where)


# What a provider sets per runner itself; the operator's value never reaches it.
_SET_BY_THE_PROVIDER = {
    "SANDCELL_RUNNER_TOKEN",
    "SANDCELL_RUNNER_TOKEN_FILE",
    "SANDCELL_RUNNER_HOST",
    "SANDCELL_RUNNER_PORT",
    "SANDCELL_RUNNER_SESSIONS",
    "SANDCELL_WORKSPACE_ROOT",
    "SANDCELL_INPUT_CACHE_DIR",
}


def _read_by_the_runner() -> set[str]:
    names: set[str] = set()
    for extra in _RUNNER_CONFIGURATIONS:
        env = _Recording(extra)
        with contextlib.suppress(Exception):
            RunnerSettings.from_env(env, read_token_file=lambda _path: _TOKEN)
        names |= env.looked_up
    return {name for name in names if name.startswith("SANDCELL_")}


def test_every_runner_setting_reaches_a_launched_runner() -> None:
    """A runner setting the operator sets on ``sandcell`` reaches the runners its local
    and Docker providers start, including those named without ``SANDCELL_RUNNER_``
    (``SANDCELL_CHECKPOINT_MAX_MEMBERS`` once stayed behind: the runner used its default)."""
    wanted = _read_by_the_runner() - _SET_BY_THE_PROVIDER
    assert {"SANDCELL_CHECKPOINT_MAX_MEMBERS", "SANDCELL_CHECKPOINT_MAX_BYTES"} <= wanted
    env = dict.fromkeys(wanted, "7")
    local = LocalSettings.from_env(env).runner_env
    assert not sorted(wanted - local.keys()), "not passed to local runners"
    # A container has its own nsjail, and the host's file server URL may not reach it.
    in_the_image = {"SANDCELL_NSJAIL", "SANDCELL_FILE_SERVER_URL"}
    docker = DockerSettings.from_env(env).runner_env
    assert not sorted(wanted - in_the_image - docker.keys()), "not passed to Docker runners"
