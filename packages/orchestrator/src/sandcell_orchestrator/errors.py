"""The orchestrator's errors. Vendor errors are translated into these at each boundary.

SandcellError
├── ConfigError                   a setting is invalid (names the variable)
├── SandboxError
│   ├── SandboxCommandError       a command exited non-zero (exit_code, stdout, stderr)
│   ├── SandboxTimeoutError       a command or execution ran past its deadline
│   ├── SandboxUnavailableError   retryable: launch, health, network, quarantine, capacity
│   │   └── RunnerAnswerError     an answer past this side's cap (too large, too slow)
│   │       └── AnswerTooLargeError         past its cap in bytes
│   │           └── AnswerCeilingError      past the ceiling, below the runner's stated limit
│   ├── SandboxNotFoundError      the sandbox is gone
│   ├── ContextLostError          a code context's interpreter is gone (restart it)
│   └── RunnerRequestError        the runner refused a request (bad input, bad path, ...)
├── SessionError
│   ├── SessionBusyError          retryable: another worker holds the session
│   ├── SessionRequiredError      strict mode without a hint
│   ├── SessionConflictError      the runner is bound to another session
│   └── LockLostError             our lease expired or was taken: work in flight aborts
├── ProtocolMismatchError         the runner speaks another protocol major
├── CheckpointError               snapshot put/get/restore failed
│   └── ArchiveRejectedError      the runner refused an archive
├── InputMissingError             an input ref could not be delivered
└── RegistryError                 the session registry failed
"""

from __future__ import annotations


class SandcellError(Exception):
    """Base of every orchestrator error. ``retryable`` tells callers whether to retry.

    The message is for logs: it may name a runner's route or address. What a served
    API may answer to its caller is ``public_detail`` (None: nothing beyond what the
    error's class says), the part that describes the caller's own request: a
    runner's words on an input it refused, the id of an input that is missing.
    """

    retryable: bool = False

    def __init__(self, message: str = "", *, public_detail: str | None = None) -> None:
        super().__init__(message)
        self.public_detail = public_detail


class ConfigError(SandcellError):
    """A configuration value is invalid; the message names the variable."""


class SandboxError(SandcellError):
    """Something went wrong with a sandbox."""


class SandboxCommandError(SandboxError):
    """A command exited non-zero."""

    def __init__(self, message: str, *, exit_code: int | None, stdout: str, stderr: str) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.stdout = stdout
        self.stderr = stderr


class SandboxTimeoutError(SandboxError):
    """A command or execution ran past its deadline."""


class SandboxUnavailableError(SandboxError):
    """The sandbox cannot serve now; retrying (possibly on a new sandbox) may succeed."""

    retryable = True


class RunnerAnswerError(SandboxUnavailableError):
    """A runner's answer went past what this side reads: too many bytes, or too slow.

    The runner lives in the sandbox's container or VM, so tenant code that took it
    over can answer anything; the read stops at the cap and the sandbox is treated
    as unavailable (a 503 to the caller), never as a reason to buffer more.
    """


class AnswerTooLargeError(RunnerAnswerError):
    """A runner's answer went past its cap in bytes (``cap``; None: not known)."""

    def __init__(
        self, message: str = "", *, cap: int | None = None, public_detail: str | None = None
    ) -> None:
        super().__init__(message, public_detail=public_detail)
        self.cap = cap


class AnswerCeilingError(AnswerTooLargeError):
    """A runner's answer went past a cap this side holds *below* the runner's stated limit.

    The runner is configured to answer more than this orchestrator reads (its
    ``SANDCELL_RUNNER_*`` limits above the ``SANDCELL_ANSWER_*`` ceiling): a
    configuration mismatch, so the same call fails again; ``public_detail`` names the
    variables to raise.
    """

    retryable = False


class SandboxNotFoundError(SandboxError):
    """The sandbox does not exist (any more)."""


class ContextLostError(SandboxError):
    """A code context's interpreter is gone (killed, crashed, or not restored with the
    workspace): its variables are lost; restart the context for a fresh one."""


class RunnerRequestError(SandboxError):
    """The runner rejected a request; ``code`` is the protocol's ``ErrorCode`` value."""

    def __init__(
        self,
        message: str,
        *,
        code: str,
        retryable: bool = False,
        public_detail: str | None = None,
    ) -> None:
        super().__init__(message, public_detail=public_detail)
        self.code = code
        self.retryable = retryable


class SessionError(SandcellError):
    """A runtime-session rule was broken."""


class SessionBusyError(SessionError):
    """Another worker holds this session; retry shortly."""

    retryable = True


class SessionRequiredError(SessionError):
    """Strict mode needs a runtime-session hint."""


class SessionConflictError(SessionError):
    """The runner is bound to a different session."""


class LockLostError(SessionError):
    """Our session lease expired or was taken over; the work in flight was aborted."""

    retryable = True


class ProtocolMismatchError(SandcellError):
    """The runner speaks an incompatible protocol major."""


class CheckpointError(SandcellError):
    """Storing, fetching or restoring a checkpoint failed."""


class ArchiveRejectedError(CheckpointError):
    """The runner refused a checkpoint archive."""


class InputMissingError(SandcellError):
    """An input ref could not be delivered to the runner."""


class RegistryError(SandcellError):
    """The session registry failed (connection, script, corrupt state)."""

    retryable = True
