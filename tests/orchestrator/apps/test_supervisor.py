"""The supervisor's rounds, deterministic: idle shutdown by an injected clock, webhook dedup."""

from __future__ import annotations

import ipaddress
import json
from typing import Any

from sandcell_orchestrator.apps.lifecycle import InstanceSupervisor
from sandcell_orchestrator.apps.settings import AppSettings
from sandcell_orchestrator.apps.webhooks import SIGNATURE_HEADER, WebhookSender, verify_signature

from .fake_runner import INSTANCE, Preview
from .http_server import serve_asgi
from .receiver import Receiver

RECEIVER_NETS = [ipaddress.ip_network("127.0.0.1/32")]  # the receiver is on loopback

SECRET = "supervisor-SECRET-0123456789"


def _record(fingerprint: str, count: int = 1) -> dict[str, Any]:
    return {
        "fingerprint": fingerprint,
        "type": "ReferenceError",
        "category": "reference",
        "message": "x is not defined",
        "source": "browser",
        "count": count,
        "first_seen_s": 1.0,
        "last_seen_s": 2.0,
    }


async def test_each_new_fingerprint_is_sent_once(preview: Preview) -> None:
    """Known fingerprints are not re-sent when they recur; a new one is."""
    receiver = Receiver()
    async with (
        serve_asgi(receiver.app()) as url,
        WebhookSender(secret=SECRET, allow_nets=RECEIVER_NETS) as webhooks,
    ):
        preview.instances.webhooks = webhooks
        preview.instance.webhook_url = f"{url}/hook"
        supervisor = InstanceSupervisor(preview.instances)
        preview.runner.errors = [_record("aaa")]
        assert await supervisor.report_new_errors(preview.instance) == 1
        preview.runner.errors = [_record("aaa", count=5)]
        assert await supervisor.report_new_errors(preview.instance) == 0
        preview.runner.errors = [_record("aaa", count=6), _record("bbb")]
        assert await supervisor.errors_round() == 1
        await webhooks.drain()
    bodies = [json.loads(call.body) for call in receiver.calls]
    assert [body["error"]["fingerprint"] for body in bodies] == ["aaa", "bbb"]
    assert all(body["instance_id"] == INSTANCE for body in bodies)
    for call in receiver.calls:
        assert verify_signature(SECRET, call.body, call.headers[SIGNATURE_HEADER.lower()])


async def test_instances_without_a_webhook_are_not_polled(preview: Preview) -> None:
    supervisor = InstanceSupervisor(preview.instances)
    preview.runner.errors = [_record("aaa")]
    assert await supervisor.report_new_errors(preview.instance) == 0


async def test_idle_round_shuts_down_only_idle_instances(preview: Preview) -> None:
    """Idle is measured on the injected clock from the last API call or preview request."""
    preview.instances.settings = AppSettings(idle_timeout_s=60)
    supervisor = InstanceSupervisor(preview.instances)
    preview.now[0] = 1000.0
    preview.instances.touch(preview.instance)
    preview.now[0] = 1059.0
    assert await supervisor.idle_round() == []
    preview.now[0] = 1060.0
    assert await supervisor.idle_round() == [INSTANCE]
    assert preview.instances.all() == []
    assert preview.instance.status == "stopped"
    # A stopped instance's preview is gone too.
    assert preview.instances.authorize_preview(INSTANCE, preview.instance.preview_token) is None
