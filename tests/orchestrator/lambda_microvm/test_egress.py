"""Egress in a Lambda MicroVM: the VPC egress connector outside, the runner's policy inside.

What the emulator can show: the VM is launched with the operator's egress
connectors (the outer wall, which AWS enforces and the emulator only records),
and the runner in it enforces the sandbox's own policy (veth + nftables + gateway,
as on every provider) in front of it. The emulated VM's runner is a real runner
process on this host, so its traffic goes only to the "remote" namespace the
module makes (its resolver and operator-allowed network).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from sandcell_orchestrator.e2b.sandboxes import E2bSandboxes
from sandcell_orchestrator.emulator import Faults, MicrovmEmulator
from sandcell_orchestrator.providers.base import SandboxSpec
from sandcell_orchestrator.registry import InProcessRegistry
from sandcell_orchestrator.sessions.manager import SandboxManager
from sandcell_orchestrator.snapshots import DirectorySnapshotStore
from sandcell_protocol import EgressPolicy
from tests.fixtures.egress_probe import ALLOWED, OTHER, probe
from tests.fixtures.egress_remote import RemoteNetwork
from tests.fixtures.paths import traversable_dir

from .conftest import ProviderFactory, vm_id_of

CONNECTOR = "arn:aws:lambda:us-east-1:123456789012:network-connector:egress-test"


@pytest.fixture(scope="module")
def remote() -> Iterator[RemoteNetwork]:
    with traversable_dir("egress-microvm-") as root:
        network = RemoteNetwork(root)
        try:
            yield network
        finally:
            network.close()


@pytest.fixture
def emulator(vm_base: Path, faults: Faults, remote: RemoteNetwork) -> MicrovmEmulator:
    """VMs whose runners resolve through the remote and may reach its network."""
    return MicrovmEmulator(
        base_dir=vm_base / "vms",
        faults=faults,
        sweep_interval_s=0.05,
        runner_env={
            "SANDCELL_RUNNER_EGRESS_DNS": remote.address,
            "SANDCELL_RUNNER_EGRESS_ALLOW_NETS": remote.network,
        },
    )


async def test_the_connector_outside_and_the_policy_inside(
    emulator: MicrovmEmulator,
    provider_factory: ProviderFactory,
    remote: RemoteNetwork,
    tmp_path: Path,
) -> None:
    """The VM gets the connector; its runner answers the allowed name, refuses another
    at once (a 403, NXDOMAIN), and counts the refusals in the orchestrator's metrics."""
    provider = provider_factory(egress_connectors=(CONNECTOR,))
    manager = SandboxManager(
        provider, InProcessRegistry(), DirectorySnapshotStore(tmp_path / "snapshots")
    )
    handle = await manager.launch(SandboxSpec(egress=EgressPolicy(mode="allow", allow=[ALLOWED])))
    try:
        assert emulator.fleet.vms[vm_id_of(handle)].egress == (CONNECTOR,)
        assert (await handle.runner.health()).egress == "nftables"
        seen = await probe(handle, remote)
        assert seen["https"] == [200, f"remote:{ALLOWED}"]
        assert seen["transparent"] == [200, f"remote:{ALLOWED}"]
        assert seen["other"][:2] == ["error", "OSError"]
        assert "403" in str(seen["other"][2])
        # Without the proxy the job asks the gateway's resolver itself: NXDOMAIN at once.
        assert seen["other_transparent"][:2] == ["error", "gaierror"]
        await manager.count_egress(handle)
        assert manager.metrics.value("sandcell_egress_refused_total") >= 2
        refused = {(e.name, e.port) for e in (await handle.runner.egress()).recent_refused}
        assert (OTHER, 443) in refused
    finally:
        await manager.discard(handle)


async def test_an_e2b_update_while_suspended_in_place_reaches_the_resumed_vm(
    emulator: MicrovmEmulator, provider_factory: ProviderFactory, tmp_path: Path
) -> None:
    """An E2B sandbox paused on Lambda is suspended in place: its runner keeps the policy
    it had (the emulator SIGSTOPs it). A network update while it is paused only writes
    the row, so the resume must set the row's policy on the resumed VM itself."""
    manager = SandboxManager(
        provider_factory(), InProcessRegistry(), DirectorySnapshotStore(tmp_path / "snapshots")
    )
    sandboxes = E2bSandboxes(manager)
    new = EgressPolicy(mode="allow", allow=(ALLOWED,))
    try:
        made = await sandboxes.create(
            owner="tenant-a",
            template="base",
            timeout_s=600,
            metadata={},
            env={},
            auto_pause=False,
            egress=EgressPolicy(mode="deny_all"),
        )
        assert await sandboxes.pause(made) is True
        record = await manager.record(made.session_id)
        assert record is not None
        assert emulator.fleet.vms[record.sandbox_id.rpartition("~")[0]].state.value == "SUSPENDED"
        await sandboxes.set_network(made, new)
        await sandboxes.connect(made, timeout_s=None)
        resumed = await manager.record(made.session_id)
        assert resumed is not None
        assert resumed.sandbox_id == record.sandbox_id  # the same VM, resumed in place
        assert (await manager.egress_status(made.session_id)).policy == new
    finally:
        await sandboxes.aclose()
        await manager.aclose(destroy_sandboxes=False)
