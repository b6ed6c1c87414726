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
