"""Egress policy in a Docker-provider sandbox: the runner inside the container enforces it.

A "remote" namespace the module makes on this host (``RemoteNetwork``: DNS, HTTP
and HTTPS of its own) is the only destination: the sandbox's spec names it as
the runner's resolver and operator-allowed network, so the container's traffic
leaves the engine's bridge only towards it (the engine masquerades it as the
host's end of the remote's link).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from sandcell_orchestrator.errors import SandcellError
from sandcell_orchestrator.handle import SandboxHandle
from sandcell_orchestrator.providers.base import SandboxSpec
from sandcell_orchestrator.providers.docker import DockerProvider
from sandcell_orchestrator.registry import InProcessRegistry
from sandcell_orchestrator.sessions.manager import SandboxManager
from sandcell_orchestrator.snapshots import DirectorySnapshotStore
from sandcell_protocol import EgressPolicy, ExecuteRequest, RunStatus
from tests.fixtures.egress_probe import ALLOWED, OTHER, probe
from tests.fixtures.egress_remote import RemoteNetwork
from tests.fixtures.paths import traversable_dir

from .conftest import MakeProvider


@pytest.fixture(scope="module")
def remote() -> Iterator[RemoteNetwork]:
    with traversable_dir("egress-docker-") as root:
        network = RemoteNetwork(root)
        try:
            yield network
        finally:
            network.close()


@pytest.fixture
async def sandbox(
    provider: DockerProvider,
    spec: SandboxSpec,
    store: DirectorySnapshotStore,
    remote: RemoteNetwork,
) -> AsyncIterator[tuple[SandboxManager, SandboxHandle]]:
    """A sandbox launched by the manager with an ``allow`` policy for one name."""
    manager = SandboxManager(provider, InProcessRegistry(), store)
    egress_spec = dataclasses.replace(
        spec,
        env={
            "SANDCELL_RUNNER_EGRESS_DNS": remote.address,
            "SANDCELL_RUNNER_EGRESS_ALLOW_NETS": remote.network,
        },
        egress=EgressPolicy(mode="allow", allow=[ALLOWED]),
    )
    handle = await manager.launch(egress_spec)
    try:
        yield manager, handle
    finally:
        await manager.discard(handle)


async def test_the_runner_in_the_container_enforces_the_policy(
    sandbox: tuple[SandboxManager, SandboxHandle], remote: RemoteNetwork
) -> None:
    """The allowed name answers through the proxy variables and the transparent
    redirect; another name is refused at once (a 403, NXDOMAIN: not a timeout); raw TCP
    to an address no rule names is reset; the refusals reach the metrics."""
    manager, handle = sandbox
    assert (await handle.runner.health()).egress == "nftables"
    seen = await probe(handle, remote)
    assert seen["http"] == [200, f"remote:{ALLOWED}"]
    assert seen["https"] == [200, f"remote:{ALLOWED}"]
    assert seen["transparent"] == [200, f"remote:{ALLOWED}"]
    # The proxy's CONNECT answer: urllib says "Tunnel connection failed: 403 ...".
    assert seen["other"][:2] == ["error", "OSError"]
    assert "403" in str(seen["other"][2])
    # Without the proxy the job asks the gateway's resolver itself: NXDOMAIN at once.
    assert seen["other_transparent"][:2] == ["error", "gaierror"]
    assert seen["raw"][0] == "error"
    assert seen["raw"][1] in (
        "ConnectionResetError",
        "ConnectionRefusedError",
    )
    await manager.count_egress(handle)
    assert manager.metrics.value("sandcell_egress_refused_total") >= 3
    assert manager.metrics.value("sandcell_egress_allowed_total") >= 3
    refused = {(e.name, e.port) for e in (await handle.runner.egress()).recent_refused}
    assert (OTHER, 443) in refused


async def test_a_replaced_policy_decides_the_next_connection(
    sandbox: tuple[SandboxManager, SandboxHandle], remote: RemoteNetwork
) -> None:
    """Replacing the running sandbox's policy: the other name and the raw CIDR pass."""
    _, handle = sandbox
    await handle.runner.set_egress(
        EgressPolicy(mode="allow", allow=[ALLOWED, OTHER, f"{remote.second_address}/32:7000"])
    )
    seen = await probe(handle, remote)
    assert seen["other"] == [200, f"remote:{OTHER}"]
    assert seen["other_transparent"] == [200, f"remote:{OTHER}"]
    assert seen["raw"] == ["ok", "ping"]


async def test_jobs_hold_no_capability_and_cannot_touch_the_rules(
    sandbox: tuple[SandboxManager, SandboxHandle],
) -> None:
    """The container has CAP_NET_ADMIN for the runner; its jobs have no capability at
    all, see only their own link, and cannot list or change nftables."""
    _, handle = sandbox
    result = await handle.runner.execute(
        ExecuteRequest(
            language="bash",
            code=(
                "grep CapEff /proc/self/status\n"
                "ip -o link | awk -F': ' '{print $2}' | cut -d@ -f1\n"
                "nft list tables >/dev/null 2>&1 && echo nft-ok || echo nft-refused\n"
                "ip link set lo down 2>/dev/null && echo ip-ok || echo ip-refused\n"
            ),
        )
    )
    assert result.status is RunStatus.OK, result.stderr
    lines = result.stdout.split("\n")
    assert lines[0].split() == ["CapEff:", "0000000000000000"]
    links = [line for line in lines[1:-3] if line]
    assert [link[:3] for link in links] == ["lo", "sce"], links
    assert lines[-3:-1] == ["nft-refused", "ip-refused"]


async def test_without_net_admin_the_runner_says_none_and_refuses_policies(
    make_provider: MakeProvider, spec: SandboxSpec, tmp_path: Path
) -> None:
    """``no-caps``: /health reports ``none`` (the truth), ``deny_all`` still works and
    an ``allow`` policy is refused at launch instead of failing at the first link."""
    provider = make_provider(privileges="no-caps")
    manager = SandboxManager(provider, InProcessRegistry(), DirectorySnapshotStore(tmp_path))
    handle = await provider.create(spec)
    try:
        assert (await handle.runner.health()).egress == "none"
        await handle.runner.set_egress(EgressPolicy(mode="deny_all"))
    finally:
        await handle.close()
        await provider.destroy(handle.sandbox_id)
    with pytest.raises(SandcellError, match="CAP_NET_ADMIN"):
        await manager.launch(
            dataclasses.replace(spec, egress=EgressPolicy(mode="allow", allow=[ALLOWED]))
        )
