"""Egress policies through the orchestrator: ``/v1/exec`` bodies, the session route, metrics,
``sandcell exec --allow-host``; real runners (local provider) against a remote namespace.

The runners inherit the remote network as their operator-allowed network and resolver
(``SANDCELL_RUNNER_EGRESS_*`` pass through the local provider), so every connection
goes only to the namespace this module made.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandcell_protocol import EgressStatus, ExecuteResult, decode, runtime_session_id
from tests.fixtures.egress_remote import RemoteNetwork
from tests.fixtures.paths import traversable_dir
from tests.orchestrator.cli.conftest import Cli
from tests.orchestrator.serve.test_serve import KEY_B, Service, StartService, start_service

__all__ = ["start_service"]

ALLOWED = "allowed.egress.test"
OTHER = "other.egress.test"
PROBE = (
    "for h in {hosts}; do curl -s -m 20 --cacert ca.pem -o /dev/null"
    " -w '%{{http_code}}/%{{http_connect}}\\n' https://$h/ || true; done"
)


@pytest.fixture(scope="module")
def remote() -> Iterator[RemoteNetwork]:
    with traversable_dir("egress-remote-") as root:
        network = RemoteNetwork(root)
        try:
            yield network
        finally:
            network.close()


def _runner_env(remote: RemoteNetwork) -> dict[str, str]:
    return {
        "SANDCELL_RUNNER_EGRESS_DNS": remote.address,
        "SANDCELL_RUNNER_EGRESS_ALLOW_NETS": remote.network,
    }


def _probe(remote: RemoteNetwork, **body: object) -> dict[str, object]:
    return {
        "language": "bash",
        "code": PROBE.format(hosts=f"{ALLOWED} {OTHER}"),
        "inline_files": [
            {"name": "ca.pem", "content_b64": base64.b64encode(remote.ca.read_bytes()).decode()}
        ],
        **body,
    }


async def _codes(service: Service, remote: RemoteNetwork, **body: object) -> list[str]:
    response = await service.client.post(
        "/v1/exec", json={"user_id": "alice", **_probe(remote, **body)}, headers=service.auth()
    )
    assert response.status_code == 200, response.text
    result = decode(response.content, ExecuteResult)
    assert result.exit_code == 0, result
    return result.stdout.split()


async def test_exec_bodies_and_the_session_route_set_the_policy(
    start_service: StartService, remote: RemoteNetwork
) -> None:
    """A turn's ``egress`` applies before its job; the session route replaces it on the
    running sandbox; the metrics count what the gateways refused."""
    service = await start_service(SANDCELL_RUNTIME_SESSION_MODE="affinity", **_runner_env(remote))
    allow_one = {"mode": "allow", "allow": [ALLOWED]}
    # Stateless, and in a session: the body's policy decides.
    assert await _codes(service, remote, egress=allow_one) == ["200/200", "000/403"]
    assert await _codes(service, remote, runtime_session_hint="e1", egress=allow_one) == [
        "200/200",
        "000/403",
    ]
    # No policy in the body: the live sandbox keeps the one it has.
    assert await _codes(service, remote, runtime_session_hint="e1") == ["200/200", "000/403"]

    session_id = runtime_session_id("tenant-a", "alice", "e1")
    route = f"/v1/sessions/{session_id}/egress"
    # The session's refused connections, each with its destination; tenant-walled.
    seen = await service.client.get(route, headers=service.auth())
    assert seen.status_code == 200, seen.text
    events = decode(seen.content, EgressStatus).recent_refused
    assert [(e.name, e.port, e.transport, e.verdict) for e in events] == [
        (OTHER, 443, "connect", "refused")
    ] * 2
    assert all(e.reason and e.at_ms > 0 for e in events)
    assert (await service.client.get(route, headers=service.auth(KEY_B))).status_code == 404
    both = {"mode": "allow", "allow": [ALLOWED, OTHER]}
    replaced = await service.client.put(route, json=both, headers=service.auth())
    assert replaced.status_code == 200, replaced.text
    status = decode(replaced.content, EgressStatus)
    assert (status.mechanism, status.policy.allow) == ("nftables", (ALLOWED, OTHER))
    assert await _codes(service, remote, runtime_session_hint="e1") == ["200/200", "200/200"]

    # Another tenant's session answers as a missing one; a bad policy is a 400.
    foreign = await service.client.put(route, json=both, headers=service.auth(KEY_B))
    assert foreign.status_code == 404
    bad = await service.client.put(
        route, json={"mode": "allow", "allow": ["*"]}, headers=service.auth()
    )
    assert (bad.status_code, bad.json()["error"]["code"]) == (400, "bad_request")
    bad_exec = await service.client.post(
        "/v1/exec",
        json={"user_id": "alice", **_probe(remote, egress={"mode": "nope"})},
        headers=service.auth(),
    )
    assert bad_exec.status_code == 400

    metrics = (await service.client.get("/metrics")).text
    refused = [line for line in metrics.splitlines() if line.startswith("sandcell_egress_refused")]
    allowed = [line for line in metrics.splitlines() if line.startswith("sandcell_egress_allowed")]
    assert refused == ["sandcell_egress_refused_total 3"]
    assert allowed == ["sandcell_egress_allowed_total 5"]


def test_cli_allow_host(tmp_path: Path, runtime_dir: Path, remote: RemoteNetwork) -> None:
    """``--allow-host`` opens exactly that host; a bad rule is a usage error (exit 2)."""
    from sandcell_orchestrator.testing import clean_environ

    home = tmp_path / "home"
    env = clean_environ(
        SANDCELL_HOME=str(home), SANDCELL_LOCAL_RUNTIME_DIR=str(runtime_dir), **_runner_env(remote)
    )
    cli = Cli(home=home, runtime_dir=runtime_dir, env=env)
    ca = tmp_path / "ca.pem"
    ca.write_bytes(remote.ca.read_bytes())
    code = PROBE.format(hosts=f"{ALLOWED} {OTHER}")
    done = cli.run("exec", "--language", "bash", "--file", str(ca), "--allow-host", ALLOWED, code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["200/200", "000/403"]
    # The refusal, as the turn's stream reported it: on stderr, apart from the job's stdout.
    assert f"sandcell: egress refused (not_allowed): {OTHER} port 443 (connect)\n" in done.stderr
    closed = cli.run("exec", "--language", "bash", "--file", str(ca), code)
    assert closed.stdout.split() == ["000/000", "000/000"], closed.stderr
    bad = cli.run("exec", "--allow-host", "*", "print(1)")
    assert bad.returncode == 2
    assert bad.stderr.startswith("sandcell: --allow-host: egress rule")


def _refused_total(metrics: str) -> int:
    (line,) = [line for line in metrics.splitlines() if line.startswith("sandcell_egress_refused")]
    return int(line.split()[-1])


async def test_a_streamed_turn_shows_each_refusal_with_its_destination(
    start_service: StartService, remote: RemoteNetwork
) -> None:
    """``/v1/exec`` as NDJSON: the runner's ``egress_refused`` events pass through before
    the result (name, address, port, reason), and the refused counter moves by as many."""
    service = await start_service(SANDCELL_RUNTIME_SESSION_MODE="affinity", **_runner_env(remote))
    before = _refused_total((await service.client.get("/metrics")).text)
    code = (
        PROBE.format(hosts=f"{ALLOWED} {OTHER}")
        + "\npython3 -c \"import socket; socket.create_connection(('169.254.169.254', 80), 10)\""
        " 2>/dev/null; echo tcp-refused"
    )
    body = {
        "user_id": "alice",
        **_probe(remote, runtime_session_hint="e2", egress={"mode": "allow", "allow": [ALLOWED]}),
        "code": code,
    }
    response = await service.client.post(
        "/v1/exec", json=body, headers={**service.auth(), "Accept": "application/x-ndjson"}
    )
    assert response.status_code == 200, response.text
    events = [json.loads(line) for line in response.text.splitlines()]
    assert events[-1]["type"] == "result"
    assert events[-1]["result"]["stdout"].split() == ["200/200", "000/403", "tcp-refused"]
    refused = [e for e in events if e["type"] == "egress_refused"]
    assert [(e["name"], e["address"], e["port"], e["reason"], e["transport"]) for e in refused] == [
        (OTHER, None, 443, "not_allowed", "connect"),
        (None, "169.254.169.254", 80, "refused_address", "tcp"),
    ]
    assert all(e["at_ms"] > 0 for e in refused)
    assert _refused_total((await service.client.get("/metrics")).text) == before + 2
