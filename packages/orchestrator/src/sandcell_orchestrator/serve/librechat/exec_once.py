"""A keyed LibreChat exec's answer, saved with its turn (issue 20: idempotent retries).

The registry keeps a keyed exec's answer for its retries; a wiped Redis forgets it.
A keyed session turn then also saves its result in the snapshot store, next to its
checkpoint and by its key once committed (``sessions/persistence.py``), and a retry
that finds the turn applied there answers that instead of running the job again.

For ``/v1/exec`` the result is the answer. LibreChat's is not: it names the output
files the run stored (fresh ids, under a fresh storage session), which a retry that
does not run the job cannot rebuild from the result. So what is saved here is the
answer's own bytes, beside a slim copy of the result (its status is all a retry
reads of it), and a retry that finds them answers those bytes: the same stdout,
stderr and file ids, whose objects the first run stored and which still download
(they are in the input store, not in Redis).
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from sandcell_protocol import ExecuteResult

from ...sessions.execution import ResultCodec

__all__ = ["ExecOnce"]


class _Saved(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a keyed LibreChat turn saves in the store."""

    result: ExecuteResult
    """The run's result without its output (the answer has it): the retry's status."""
    answer: bytes | None
    """The answer's bytes; None: the run timed out (answered 504, as the first was)."""


class ExecOnce:
    """One exec's answer: built from its run (``build``), or found saved by a retry.

    ``build`` is the surface's answer to a result (None: an error answer); it reads
    the outputs the run stored, so it is called after the job (the turn encodes its
    result after ``collect``). ``codec`` is what the keyed turn saves and reads back.
    """

    def __init__(self, build: Callable[[ExecuteResult], bytes | None]) -> None:
        self._build = build
        self._found: _Saved | None = None

    def answer(self, result: ExecuteResult) -> bytes | None:
        """The answer to ``result``: the saved one if the turn was found applied."""
        if self._found is not None:
            return self._found.answer
        return self._build(result)

    @property
    def codec(self) -> ResultCodec:
        return ResultCodec(encode=self._encode, decode=self._decode)

    def _encode(self, result: ExecuteResult) -> bytes:
        # Also called for a found turn (saved again by key): its found answer then,
        # never one built from this retry, which ran nothing and stored no file.
        slim = msgspec.structs.replace(result, stdout="", stderr="", files=[])
        return msgspec.json.encode(_Saved(result=slim, answer=self.answer(result)))

    def _decode(self, body: bytes) -> ExecuteResult:
        # The found turn's answer from now on: the retry ran nothing, stored nothing.
        self._found = msgspec.json.decode(body, type=_Saved)
        return self._found.result
