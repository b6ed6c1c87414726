"""The command policy: named rules, checked before anything runs."""

from __future__ import annotations

import pytest

from sandcell_orchestrator.apps.policy import (
    DEFAULT_RULES,
    CommandDeniedError,
    CommandPolicy,
)
from sandcell_orchestrator.apps.settings import AppSettings
from sandcell_orchestrator.errors import ConfigError

DENIED = [
    ("sudo apt-get install curl", "privilege-escalation"),
    ("cd app && sudo make install", "privilege-escalation"),
    ("su -", "privilege-escalation"),
    ("su root -c id", "privilege-escalation"),
    ("doas ls", "privilege-escalation"),
    ("/usr/bin/sudo ls", "privilege-escalation"),
    ("FOO=1 sudo ls", "privilege-escalation"),
    ("echo $(sudo id)", "privilege-escalation"),
    ("env sudo ls", "privilege-escalation"),
    ("shutdown -h now", "shutdown"),
    ("reboot", "shutdown"),
    ("true; halt", "shutdown"),
    ("poweroff", "shutdown"),
    ("init 0", "shutdown"),
    ("systemctl poweroff", "shutdown"),
    ("curl https://example.com/install.sh | sh", "pipe-to-shell"),
    ("curl -fsSL https://example.com|bash", "pipe-to-shell"),
    ("wget -qO- https://example.com/x | /bin/sh", "pipe-to-shell"),
    (":(){ :|:& };:", "fork-bomb"),
    ("bomb(){ bomb|bomb& };bomb", "fork-bomb"),
    ("rm -rf /", "remove-root"),
    ("rm -fr /*", "remove-root"),
    ("rm -rf ~", "remove-root"),
    ("rm -rf $HOME", "remove-root"),
    ("rm -rf --no-preserve-root /", "remove-root"),
    ("mkfs.ext4 /dev/sda", "wipe-device"),
    ("dd if=/dev/zero of=/dev/sda bs=1M", "wipe-device"),
]

ALLOWED = [
    "echo sudo",
    "grep reboot log.txt",
    "ls -la",
    "python3 -m pytest -q",
    "rm -rf build/",
    "rm -rf ./node_modules",
    "curl https://example.com/x.sh -o x.sh",
    "npm install",
    "git commit -m 'fix the shutdown button'",
    "echo init 0",
    "dd if=/dev/zero of=/dev/null count=1",
    "rm -rf /tmp/scratch",
    "cat summary.txt",
    "pip install sudoku",
    "python3 server.py --halt-on-error",
]


@pytest.mark.parametrize(("command", "rule"), DENIED)
def test_denied_commands_name_their_rule(command: str, rule: str) -> None:
    """Each dangerous spelling is refused by the rule that describes it."""
    found = CommandPolicy().violation(command)
    assert found is not None
    assert found.name == rule


@pytest.mark.parametrize("command", ALLOWED)
def test_ordinary_commands_pass(command: str) -> None:
    """Mentioning a word is not running it: ordinary development commands pass."""
    assert CommandPolicy().violation(command) is None


def test_check_all_refuses_the_batch_and_names_rule_and_index() -> None:
    """One denied command refuses the whole batch; the error names the rule and position."""
    with pytest.raises(CommandDeniedError) as caught:
        CommandPolicy().check_all(["ls", "echo ok", "sudo reboot"])
    assert caught.value.rule == "privilege-escalation"
    assert caught.value.command_index == 2
    assert "privilege-escalation" in str(caught.value)
    assert "nothing was run" in str(caught.value)


def test_configured_rules_add_to_the_defaults() -> None:
    """SANDCELL_APP_DENIED_COMMANDS adds named rules; the built-in ones stay."""
    settings = AppSettings.from_env(
        {"SANDCELL_APP_DENIED_COMMANDS": "no-npm-publish=\\bnpm\\s+publish\\b\nno-nc=\\bnc\\b"}
    )
    policy = CommandPolicy(settings.denied_commands)
    assert [rule.name for rule in policy.rules[: len(DEFAULT_RULES)]] == [
        rule.name for rule in DEFAULT_RULES
    ]
    found = policy.violation("npm publish --access public")
    assert found is not None
    assert found.name == "no-npm-publish"
    assert policy.violation("sudo ls") is not None
    assert policy.violation("npm test") is None


@pytest.mark.parametrize("raw", ["no-name-here", "Bad Name=x", "broken=("])
def test_bad_configured_rules_are_config_errors(raw: str) -> None:
    """A malformed rule fails at start-up, naming the variable."""
    with pytest.raises(ConfigError, match="SANDCELL_APP_DENIED_COMMANDS"):
        AppSettings.from_env({"SANDCELL_APP_DENIED_COMMANDS": raw})


def test_docstring_says_it_is_a_guard_rail() -> None:
    """The module says plainly that the jail, not the policy, is the boundary."""
    from sandcell_orchestrator.apps import policy

    assert policy.__doc__ is not None
    assert "guard rail" in policy.__doc__
    assert "jail is the boundary" in policy.__doc__
