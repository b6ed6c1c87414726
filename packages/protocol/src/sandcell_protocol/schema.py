"""JSON Schema of every message, for peers written in other languages."""

from __future__ import annotations

from typing import Any

import msgspec

from .app_messages import APP_MESSAGES
from .contexts import CONTEXT_MESSAGES
from .egress import EGRESS_MESSAGES
from .messages import ALL_MESSAGES
from .version import PROTOCOL_VERSION


def json_schema() -> dict[str, Any]:
    """One document: ``components`` holds every message's schema."""
    messages = (*ALL_MESSAGES, *APP_MESSAGES, *EGRESS_MESSAGES, *CONTEXT_MESSAGES)
    _, components = msgspec.json.schema_components(messages)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": f"sandcell protocol {PROTOCOL_VERSION}",
        "x-sandcell-protocol": PROTOCOL_VERSION,
        "components": components,
    }
