"""E2B's network settings through the real SDK: ``allow_internet_access`` and
``network.allow_out`` / ``deny_out`` become the sandbox's egress policy.

The service's runners get the test's remote namespace as their operator-allowed
network and resolver, so traffic goes only to the namespace this module made.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from e2b import ALL_TRAFFIC, Sandbox
from e2b.exceptions import InvalidArgumentException, NotFoundException, SandboxException

from sandcell_orchestrator.e2b.egress import egress_policy
from sandcell_orchestrator.e2b.errors import E2bError
from sandcell_protocol import EgressPolicy
from tests.e2b_api.conftest import KEY_B, E2bServe, start_serve, stop_serve
from tests.fixtures.egress_remote import RemoteNetwork
from tests.fixtures.paths import traversable_dir
from tests.orchestrator.cli.conftest import stop_leftovers

ALLOWED = "allowed.egress.test"
OTHER = "other.egress.test"
PROBE = (
    f"for h in {ALLOWED} {OTHER}; do curl -s -m 20 --cacert ca.pem -o /dev/null"
    " -w '%{http_code}/%{http_connect}\\n' https://$h/ || true; done"
)


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[E2bServe, RemoteNetwork]]:
    with traversable_dir("e2b-egress-") as base:
        remote = RemoteNetwork(base)
        try:
            service = start_serve(
                base / "serve",
                env={
                    "SANDCELL_RUNNER_EGRESS_DNS": remote.address,
                    "SANDCELL_RUNNER_EGRESS_ALLOW_NETS": remote.network,
                },
            )
            try:
                yield service, remote
            finally:
                stop_serve(service)
                assert not stop_leftovers(service.runtime_dir)
        finally:
            remote.close()


def probe(sandbox: Sandbox, remote: RemoteNetwork) -> list[str]:
    sandbox.files.write("ca.pem", remote.ca.read_bytes())
    return sandbox.commands.run(PROBE, timeout=60).stdout.split()


def test_network_allow_out_opens_only_those_hosts(served: tuple[E2bServe, RemoteNetwork]) -> None:
    service, remote = served
    sandbox = Sandbox.create(
        network={"allow_out": [ALLOWED], "deny_out": [ALL_TRAFFIC]}, **service.opts()
    )
    try:
        assert probe(sandbox, remote) == ["200/200", "000/403"]
    finally:
        sandbox.kill()


def test_internet_on_and_off(served: tuple[E2bServe, RemoteNetwork]) -> None:
    """``allow_internet_access=True`` reaches both; ``False`` neither."""
    service, remote = served
    for access, expected in ((True, ["200/200", "200/200"]), (False, ["000/000", "000/000"])):
        sandbox = Sandbox.create(allow_internet_access=access, **service.opts())
        try:
            assert probe(sandbox, remote) == expected
        finally:
            sandbox.kill()


def test_update_network_replaces_the_policy_and_a_resume_keeps_it(
    served: tuple[E2bServe, RemoteNetwork],
) -> None:
    """``update_network`` replaces the running sandbox's egress at once; a paused and
    resumed sandbox (launched again) keeps the new policy; an update that gives nothing
    clears it to sandcell's default (no egress); another tenant's update is a 404."""
    service, remote = served
    sandbox = Sandbox.create(allow_internet_access=False, **service.opts())
    try:
        assert probe(sandbox, remote) == ["000/000", "000/000"]
        sandbox.update_network({"allow_out": [ALLOWED], "deny_out": [ALL_TRAFFIC]})
        assert probe(sandbox, remote) == ["200/200", "000/403"]
        with pytest.raises(NotFoundException):
            Sandbox.update_network(
                sandbox.sandbox_id, {"allow_internet_access": True}, **service.opts(KEY_B)
            )
        assert sandbox.pause() is True
        sandbox = Sandbox.connect(sandbox.sandbox_id, **service.opts())
        assert probe(sandbox, remote) == ["200/200", "000/403"]
        sandbox.update_network({"allow_internet_access": True})
        assert probe(sandbox, remote) == ["200/200", "200/200"]
        sandbox.update_network({})
        # Refused by the sandbox's egress proxy now (its link stays up: 403 to CONNECT),
        # where a sandbox created without egress has no route at all (000).
        assert probe(sandbox, remote) == ["000/403", "000/403"]
        with pytest.raises((InvalidArgumentException, SandboxException), match="not supported"):
            sandbox.update_network({"dns_servers": ["1.1.1.1"]})
    finally:
        sandbox.kill()


def test_unsupported_network_settings_are_refused(served: tuple[E2bServe, RemoteNetwork]) -> None:
    service, _ = served
    with pytest.raises((InvalidArgumentException, SandboxException), match="not supported"):
        Sandbox.create(network={"mask_request_host": "x.example"}, **service.opts())


@pytest.mark.parametrize(
    ("access", "network", "expected"),
    [
        (None, None, None),
        (False, None, EgressPolicy(mode="deny_all")),
        (True, None, EgressPolicy(mode="allow_all")),
        (None, {"denyOut": [ALL_TRAFFIC]}, EgressPolicy(mode="deny_all")),
        (
            None,
            {"denyOut": [ALL_TRAFFIC, "8.8.8.8"], "allowOut": ["pypi.org", "1.1.1.1"]},
            EgressPolicy(mode="allow", allow=("pypi.org", "1.1.1.1")),
        ),
        (
            None,
            {"denyOut": ["8.8.8.8", "1.1.1.1"], "allowOut": ["1.1.1.1"]},
            EgressPolicy(mode="allow_all", deny=("8.8.8.8",)),
        ),
        (False, {"allowOut": ["pypi.org"]}, EgressPolicy(mode="allow", allow=("pypi.org",))),
        (None, {"allowPublicTraffic": False}, None),
    ],
)
def test_e2b_settings_as_policies(
    access: bool | None, network: dict[str, object] | None, expected: EgressPolicy | None
) -> None:
    """E2B's allowOut wins over denyOut; sandcell's deny wins: translated by meaning."""
    assert egress_policy(access, network) == expected


@pytest.mark.parametrize(
    ("access", "network"),
    [
        (None, {"allowOut": ["*"], "denyOut": [ALL_TRAFFIC]}),
        (None, {"dnsServers": ["1.1.1.1"]}),
        (None, {"what": 1}),
        # Internet on: allowOut only trims denyOut, and is still checked.
        (True, {"allowOut": ["not a host!"]}),
        (True, {"allowOut": [""], "denyOut": ["8.8.8.8"]}),
        (None, {"allowOut": ["x" * 400], "denyOut": ["8.8.8.8"]}),
        (True, {"allowOut": [f"10.0.{i // 256}.{i % 256}" for i in range(300)]}),
        (True, {"allowOut": [7]}),
    ],
)
def test_bad_e2b_settings_are_400(access: bool | None, network: dict[str, object]) -> None:
    with pytest.raises(E2bError) as caught:
        egress_policy(access, network)
    assert (caught.value.status, caught.value.code) == (400, "bad_request")


def test_a_deny_rule_the_allow_list_names_differently_is_still_trimmed() -> None:
    """allowOut wins over denyOut by the rules' meaning, not their spelling."""
    policy = egress_policy(
        True, {"denyOut": ["Example.COM.", "8.8.8.8"], "allowOut": ["example.com"]}
    )
    assert policy == EgressPolicy(mode="allow_all", deny=("8.8.8.8",))


def test_garbage_in_allow_out_is_refused_through_the_sdk(
    served: tuple[E2bServe, RemoteNetwork],
) -> None:
    """With internet on, an allowOut entry that is no rule is the SDK's 400, not a sandbox."""
    service, _ = served
    with pytest.raises((InvalidArgumentException, SandboxException), match=r"400.*not a domain"):
        Sandbox.create(
            allow_internet_access=True, network={"allow_out": ["bad host!"]}, **service.opts()
        )
