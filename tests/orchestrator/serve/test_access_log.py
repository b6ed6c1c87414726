"""The access log keeps no query credential: one redactor, installed by ``create_app``."""

from __future__ import annotations

import logging

import pytest

from sandcell_orchestrator.config import OrchestratorSettings
from sandcell_orchestrator.serve.app import create_app

LINE = (
    "/files?path=a&signature=v1_SECRET%2Bx&signature_expiration=9"
    "&token=SECRET-t&mytoken=kept&my_signature=kept&b=2"
)
REDACTED = (
    "/files?path=a&signature=[redacted]&signature_expiration=9"
    "&token=[redacted]&mytoken=kept&my_signature=kept&b=2"
)


def _access_record(path: str) -> logging.LogRecord:
    return logging.LogRecord(
        "uvicorn.access",
        logging.INFO,
        __file__,
        1,
        '%s - "%s %s HTTP/%s" %d',
        ("127.0.0.1:1", "GET", path, "1.1", 200),
        None,
    )


def test_the_served_app_redacts_every_query_credential_with_one_filter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The preview ``token`` and the E2B ``signature`` in one line are both redacted, by
    one filter however many apps the process builds; a name that merely ends like one
    (``mytoken``, ``my_signature``) is not a credential parameter and is kept."""
    logger = logging.getLogger("uvicorn.access")
    monkeypatch.setattr(logger, "filters", [])
    settings = OrchestratorSettings.from_env(
        {"SANDCELL_HOME": "/nonexistent/sandcell", "SANDCELL_SERVE_INSECURE_NO_AUTH": "1"}
    )
    create_app(settings)
    create_app(settings)
    assert len(logger.filters) == 1, logger.filters
    record = _access_record(LINE)
    assert logger.filter(record)
    assert record.getMessage() == f'127.0.0.1:1 - "GET {REDACTED} HTTP/1.1" 200'


def test_each_install_adds_its_names_to_the_one_filter(monkeypatch: pytest.MonkeyPatch) -> None:
    """``redact_access_log`` twice on a logger: one filter, redacting both names."""
    from sandcell_orchestrator.serve.redaction import RedactQueryParameters, redact_access_log

    logger = logging.getLogger("sandcell.tests.access")
    monkeypatch.setattr(logger, "filters", [])
    first = redact_access_log(["token"], logger_name=logger.name)
    assert redact_access_log(["signature"], logger_name=logger.name) is first
    assert logger.filters == [first]
    assert first.names == {"token", "signature"}
    assert first.redact(LINE) == REDACTED
    assert RedactQueryParameters().redact(LINE) == LINE


@pytest.mark.parametrize(
    ("line", "redacted"),
    [
        # The name as the server reads it, percent-decoded once: still the credential.
        ("/files?path=a&%73ignature=v1_SECRET", "/files?path=a&%73ignature=[redacted]"),
        ("/files?si%67nature=v1_SECRET&b=2", "/files?si%67nature=[redacted]&b=2"),
        ("/p?%74oken=SECRET-t", "/p?%74oken=[redacted]"),
        ("/p?%74%6F%6B%65%6E=SECRET-t", "/p?%74%6F%6B%65%6E=[redacted]"),
        # After every ``?`` and ``&``, inside another value or after an ``=`` in the path.
        ("/f?a=b?signature=v1_SECRET", "/f?a=b?signature=[redacted]"),
        ("/x=y?signature=v1_SECRET", "/x=y?signature=[redacted]"),
        ("/f?signature=v1_SECRET?token=SECRET", "/f?signature=[redacted]"),
        # Names the server reads as others: kept.
        ("/f?%2573ignature=kept&sig+nature=kept", "/f?%2573ignature=kept&sig+nature=kept"),
        ("/f?Signature=kept&%53ignature=kept", "/f?Signature=kept&%53ignature=kept"),
    ],
)
def test_a_credential_name_is_recognised_as_the_server_reads_it(line: str, redacted: str) -> None:
    """``%73ignature=`` is the ``signature`` the server reads (Starlette decodes query
    names), so its value is redacted too; a double-encoded or differently cased name is
    another parameter to the server, and kept."""
    from sandcell_orchestrator.serve.redaction import RedactQueryParameters

    redactor = RedactQueryParameters(["token", "signature"])
    assert redactor.redact(line) == redacted
    assert "SECRET" not in redactor.redact(line)
