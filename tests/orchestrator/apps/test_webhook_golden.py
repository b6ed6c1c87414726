"""The webhook guard refuses exactly the shared always-refused destinations (golden.json)."""

from __future__ import annotations

import pytest

from sandcell_orchestrator.apps.webhook_targets import WebhookTargetError, WebhookTargets
from tests.golden import load_golden

GOLDEN = load_golden()
PUBLIC_ONLY = WebhookTargets()


@pytest.mark.parametrize(
    "host", GOLDEN["egress_addresses"]["refused"] + GOLDEN["egress_refused_names"]["refused"]
)
def test_golden_refused_destinations_are_refused_webhook_hosts(host: str) -> None:
    with pytest.raises(WebhookTargetError):
        PUBLIC_ONLY.check_url(f"http://{host}/hook")


@pytest.mark.parametrize(
    "host", GOLDEN["egress_addresses"]["allowed"] + GOLDEN["egress_refused_names"]["allowed"]
)
def test_golden_allowed_destinations_pass_the_url_check(host: str) -> None:
    PUBLIC_ONLY.check_url(f"http://{host}/hook")
