"""The command policy: patterns a command of the app-instance API may not match.

**This is a guard rail, not a security boundary.** The jail is the boundary:
commands already run as an unprivileged, pinned UID in their own namespaces with
no route out, so ``sudo`` fails and ``reboot`` reaches nothing. The policy exists
so an agent that writes such a command gets a clear, immediate "no" naming the
rule (and learns not to), instead of a confusing failure or a wasted minute; a
determined caller can always spell a command so no regex sees it.

Rules match anywhere in the command text with ``re.search``. Most anchor on a
command position (start, after ``;``, ``&``, ``|``, ``(``, a backtick, ``$(``,
or a wrapper such as ``env``/``nohup``/``xargs``), so ``echo sudo`` and
``grep reboot log.txt`` pass while ``cd x && sudo make`` does not.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..errors import SandcellError

__all__ = ["DEFAULT_RULES", "CommandDeniedError", "CommandPolicy", "PolicyRule"]

# Where a command word can start: the beginning, after a separator or an opening
# substitution, or after wrappers that run their arguments as a command; optional
# VAR=value assignments and a directory prefix (/usr/bin/sudo) come before it.
_AT_COMMAND = (
    r"(?:^|[;&|(`\n{]|\$\()\s*"
    r"(?:(?:env|nohup|exec|xargs|time|command|builtin|nice|timeout\s+\S+)\s+(?:-\S+\s+)*)*"
    r"(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*"
    r"(?:\S*/)?"
)
_END = r"(?=$|[\s;&|)`])"


@dataclass(frozen=True, slots=True)
class PolicyRule:
    """A named pattern; a command that matches it is refused."""

    name: str
    pattern: str
    description: str

    def __post_init__(self) -> None:
        re.compile(self.pattern)


DEFAULT_RULES: tuple[PolicyRule, ...] = (
    PolicyRule(
        "privilege-escalation",
        _AT_COMMAND + r"(?:sudo|su|doas|pkexec|runuser|setpriv|chroot)" + _END,
        "changing user or gaining privileges (sudo, su, doas, ...)",
    ),
    PolicyRule(
        "shutdown",
        _AT_COMMAND
        + r"(?:shutdown|reboot|halt|poweroff|kexec|init\s+[06]|telinit\s+[06]"
        + r"|systemctl\s+(?:\S+\s+)*(?:poweroff|reboot|halt|kexec|suspend|hibernate))"
        + _END,
        "shutting down or rebooting the machine",
    ),
    PolicyRule(
        "pipe-to-shell",
        r"\b(?:curl|wget|fetch)\b[^|;&\n]*\|\s*(?:sudo\s+)?(?:\S*/)?"
        r"(?:ba|z|da|k|c|tc|fi)?sh" + _END,
        "piping a download into a shell",
    ),
    PolicyRule(
        "fork-bomb",
        r"(?P<f>[A-Za-z_:][A-Za-z0-9_:]*)\s*\(\s*\)\s*\{[^}]*(?P=f)\s*\|\s*(?P=f)\s*&",
        "a fork bomb",
    ),
    PolicyRule(
        "remove-root",
        _AT_COMMAND
        + r"rm\s+(?:-\S+\s+|--\s+)*(?:(?:/|/\*|~|~/|~/\*|\$HOME|\$\{HOME\}|/\.\*?)['\"]?)"
        + _END
        + r"|--no-preserve-root",
        "deleting the root or home directory",
    ),
    PolicyRule(
        "wipe-device",
        _AT_COMMAND
        + r"(?:mkfs(?:\.\w+)?|wipefs|fdisk|parted)"
        + _END
        + r"|\bdd\b[^;&|\n]*\bof=/dev/(?!null\b|zero\b|stdout\b|stderr\b)",
        "formatting or overwriting a block device",
    ),
)
"""The built-in rules; ``SANDCELL_APP_DENIED_COMMANDS`` adds to them, never replaces."""


class CommandDeniedError(SandcellError):
    """A command matched a policy rule; nothing was run. ``rule`` names the rule."""

    def __init__(self, *, rule: PolicyRule, command_index: int) -> None:
        # Our words (the rule's name and description): the caller's to read.
        said = (
            f"command {command_index} denied by policy rule '{rule.name}': {rule.description}"
            " (nothing was run)"
        )
        super().__init__(said, public_detail=said)
        self.rule = rule.name
        self.command_index = command_index


class CommandPolicy:
    """Checks commands against the built-in rules plus configured ones."""

    def __init__(
        self,
        extra: Iterable[tuple[str, str]] = (),
        *,
        rules: Sequence[PolicyRule] = DEFAULT_RULES,
    ) -> None:
        self.rules: tuple[PolicyRule, ...] = (
            *rules,
            *(
                PolicyRule(name, pattern, f"matches configured pattern {name}")
                for name, pattern in extra
            ),
        )
        self._compiled = [(rule, re.compile(rule.pattern)) for rule in self.rules]

    def __repr__(self) -> str:
        return f"CommandPolicy(rules={[rule.name for rule in self.rules]})"

    def violation(self, command: str) -> PolicyRule | None:
        """The first rule ``command`` breaks, or ``None``."""
        for rule, pattern in self._compiled:
            if pattern.search(command):
                return rule
        return None

    def check_all(self, commands: Sequence[str]) -> None:
        """Raise ``CommandDeniedError`` for the first denied command (checked before any runs)."""
        for index, command in enumerate(commands):
            rule = self.violation(command)
            if rule is not None:
                raise CommandDeniedError(rule=rule, command_index=index)
