"""The shell examples in README.md and docs/ stay true: each CLI example runs as written.

Every ```sh block whose commands are all ``./scripts/sandcell`` calls (exec, sessions,
files) or plain file set-up (``printf``, ``echo``, ``cat``) is run line by line, in
a fresh directory with a fresh ``SANDCELL_HOME``, the way a reader pastes it. Each
line must exit 0, and a comment line right under a command (``# [(42,)]``) is that
command's expected output. Blocks that need a service, cloud credentials or a
key (``serve``, ``curl``, ``export``) are not run here; their surfaces have tests
of their own. A test also checks that this rule still finds the README's
multi-turn example, so it cannot quietly select nothing.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from .conftest import ROOT, Cli

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"^```sh\n(.*?)^```", re.MULTILINE | re.DOTALL)
_RUNNABLE = re.compile(r"(\./scripts/sandcell (exec|sessions|files) |printf |echo |cat )")


@dataclass(frozen=True)
class Step:
    command: str
    expected: str | None


@dataclass(frozen=True)
class Example:
    where: str
    steps: tuple[Step, ...]


def _examples() -> list[Example]:
    examples = []
    for path in DOCS:
        text = path.read_text()
        for match in _BLOCK.finditer(text):
            lines = [line for line in match.group(1).splitlines() if line.strip()]
            commands = [line for line in lines if not line.lstrip().startswith("#")]
            if not commands or not all(_RUNNABLE.match(line) for line in commands):
                continue
            steps: list[Step] = []
            for line in lines:
                if line.lstrip().startswith("#"):
                    if steps and steps[-1].expected is None:
                        steps[-1] = Step(steps[-1].command, line.lstrip()[1:].strip())
                    continue
                steps.append(Step(line, None))
            lineno = text[: match.start()].count("\n") + 1
            if any(seen.steps == tuple(steps) for seen in examples):
                continue  # the same example in two documents runs once
            examples.append(Example(f"{path.relative_to(ROOT)}:{lineno}", tuple(steps)))
    return examples


EXAMPLES = _examples()


def test_the_rule_finds_the_readme_examples() -> None:
    """The selection is not empty: the README's main job and multi-turn session are in."""
    readme = [e for e in EXAMPLES if e.where.startswith("README.md")]
    commands = [step.command for example in readme for step in example.steps]
    assert any("--session demo" in c and "sqlite3" in c for c in commands), commands
    assert any(step.expected == "[(42,)]" for e in readme for step in e.steps)


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.where for e in EXAMPLES])
def test_example_runs_as_written(example: Example, cli: Cli, tmp_path: Path) -> None:
    """Each line of the example exits 0 and prints what its comment says."""
    workdir = tmp_path / "reader"
    workdir.mkdir()
    # The reader's checkout: scripts/sandcell resolves its link back to this repository.
    (workdir / "scripts").mkdir()
    (workdir / "scripts" / "sandcell").symlink_to(ROOT / "scripts" / "sandcell")
    for step in example.steps:
        done = subprocess.run(
            ["bash", "-c", step.command],
            cwd=workdir,
            env=cli.env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert done.returncode == 0, (example.where, step.command, done.stderr)
        if step.expected is not None:
            assert done.stdout.strip() == step.expected, (example.where, step.command)
