"""E2B's network settings of a new sandbox as a sandcell ``EgressPolicy``.

E2B has ``allow_internet_access`` (default on) and ``network.allowOut`` /
``network.denyOut`` lists, where ``allowOut`` wins over ``denyOut`` and
``0.0.0.0/0`` in ``denyOut`` means "nothing but ``allowOut``". sandcell's deny
rules win instead, so the lists are translated by meaning:

* internet off (``allow_internet_access: false`` or ``denyOut`` holding
  ``0.0.0.0/0``): mode ``allow`` with the ``allowOut`` rules (``deny_all`` if none);
* internet on: mode ``allow_all`` with the ``denyOut`` rules ``allowOut`` does not
  also name.

Neither given (or only the inbound settings, ``allowPublicTraffic`` and
``httpsPorts``): None, the sandbox keeps sandcell's default (``deny_all``) — unlike
E2B, whose default is internet on: a sandbox reaches the network only when its
creator asked for it.
"""

from __future__ import annotations

from typing import Any

from sandcell_protocol import EgressPolicy
from sandcell_protocol.egress import parse_rule

from .errors import E2bError

ALL_TRAFFIC = "0.0.0.0/0"
_EGRESS = {"allowOut", "denyOut"}
_INBOUND = {"allowPublicTraffic", "httpsPorts"}
"""About traffic *into* the sandbox's URLs, not egress: left to the surface."""
_REFUSED = {"dnsServers", "egressProxy", "maskRequestHost", "rules"}


def _rules(network: dict[str, Any], key: str) -> list[str]:
    value = network.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise E2bError(400, "bad_request", f"network.{key}: must be a list of strings")
    return value


def egress_policy(
    allow_internet_access: bool | None, network: dict[str, Any] | None
) -> EgressPolicy | None:
    """The policy E2B's settings mean; ``E2bError`` 400 for what cannot be one."""
    if network is None and allow_internet_access is None:
        return None
    network = network or {}
    unknown = sorted(set(network) - _EGRESS - _INBOUND - _REFUSED)
    refused = sorted(key for key in _REFUSED if network.get(key))
    for key in [*unknown, *refused]:
        raise E2bError(400, "bad_request", f"network.{key[:40]}: not supported by sandcell")
    allow_out, deny_out = _rules(network, "allowOut"), _rules(network, "denyOut")
    if allow_internet_access is None and not allow_out and not deny_out:
        return None  # only inbound settings: egress stays sandcell's default
    try:
        # Every rule is checked whichever mode uses it: with internet on, allowOut only
        # trims denyOut, yet a rule that is no rule is still the caller's mistake.
        EgressPolicy(mode="allow", allow=tuple(allow_out), deny=tuple(deny_out))
    except ValueError as exc:
        raise E2bError(400, "bad_request", f"network: {exc}") from None
    if allow_internet_access is False or ALL_TRAFFIC in deny_out:
        if not allow_out:
            return EgressPolicy(mode="deny_all")
        return EgressPolicy(mode="allow", allow=tuple(allow_out))
    allowed = {parse_rule(rule).text for rule in allow_out}
    deny = tuple(rule for rule in deny_out if parse_rule(rule).text not in allowed)
    return EgressPolicy(mode="allow_all", deny=deny)


def public_traffic(network: dict[str, Any] | None) -> bool:
    """Whether the sandbox's ports answer without its traffic token: only when its
    creator says so (``allowPublicTraffic: true``). E2B's default is public; sandcell's
    is the token, as its egress default is none."""
    value = (network or {}).get("allowPublicTraffic")
    if value is not None and not isinstance(value, bool):
        raise E2bError(400, "bad_request", "network.allowPublicTraffic: must be a boolean")
    return value is True


__all__ = ["ALL_TRAFFIC", "egress_policy", "public_traffic"]
