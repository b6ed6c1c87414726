"""The runner's side of egress: which namespace a job gets, its links, gateways and counters.

With the policy at ``deny_all`` (the default) nothing changes: a job's network
namespace holds only ``lo``. Any other policy gives the namespaces jobs run in a
link to the runner (``plumbing.attach``) served by a gateway process
(``gateway.py``; started and stopped by ``gateway_process.py``):

* a bound session's own namespace (every job and process of the session);
* for jobs outside a session, one namespace the runner keeps for them (made when
  a policy first needs it): they share it, as they share the sandbox.

Jobs in a linked namespace get ``HTTP(S)_PROXY`` naming the gateway's proxy and
an ``/etc/resolv.conf`` naming its resolver; what ignores both meets the
transparent redirect. ``replace`` sends a new policy to every gateway and waits
for each to confirm, so the next connection is decided by it.

A streamed turn ``watch``es its job's namespace: the refusals its gateway reports
meanwhile go to the turn's ``TurnRefusals`` too (and ``settle`` waits until the
gateway has reported every decision so far), so the turn's stream carries them.

The mechanism is ``nftables`` when this runner can plumb links (root, ``ip`` and
``nft``, the jail on, host networking off); otherwise ``none``, and only
``deny_all`` can be set.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import IO

import msgspec

from sandcell_protocol import EgressEvent, EgressPolicy, EgressStatus
from sandcell_protocol.egress import EgressMechanism

from ..errors import BadRequestError
from ..jail.netns import SessionNetns, create_netns
from ..jail.spec import JobSpec
from .gateway_process import PORTS, Gateway, spawn_gateway
from .plumbing import Link, PlumbingError, attach, detach, reap_leftovers
from .settings import EgressSettings
from .turn import TurnRefusals

log = logging.getLogger(__name__)

_RECENT = 100
_ACK_TIMEOUT_S = 15.0


class _Line(msgspec.Struct, frozen=True):
    ack: int | None = None
    event: EgressEvent | None = None


class EgressManager:
    """See the module docstring."""

    def __init__(
        self,
        settings: EgressSettings,
        *,
        unavailable: str | None,
        state_dir: Path,
    ) -> None:
        self._settings = settings
        self.unavailable = unavailable if settings.enabled else "SANDCELL_RUNNER_EGRESS=0"
        self.mechanism: EgressMechanism = "none" if self.unavailable else "nftables"
        self.policy = settings.policy if self.mechanism == "nftables" else EgressPolicy()
        self._state_dir = state_dir
        self._gateways: dict[int, Gateway] = {}
        self._shared: SessionNetns | None = None
        self._session: SessionNetns | None = None
        self._lock = threading.RLock()
        self._counts_lock = threading.Lock()
        self._seq = 0
        self.allowed_total = 0
        self.refused_total = 0
        self.by_transport: collections.Counter[tuple[str, str]] = collections.Counter()
        self._recent: collections.deque[EgressEvent] = collections.deque(maxlen=_RECENT)
        # Weak: a stream never started (its client gone) must not keep its watch.
        self._watches: weakref.WeakSet[TurnRefusals] = weakref.WeakSet()

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        """Reap a dead runner's tables; link the shared namespace if the policy needs it."""
        if self.mechanism == "none":
            # /health says only "none"; the operator's log says why.
            log.info("egress: none (only deny_all can be set): %s", self.unavailable)
            return
        reaped = reap_leftovers()
        if reaped:
            log.warning("removed %d egress tables left by a previous runner", reaped)
        if self.policy.mode != "deny_all":
            self._ensure_links(self.policy)

    def close(self) -> None:
        """Stop every gateway, remove every link; the shared namespace goes too."""
        with self._lock:
            for netns_fd in list(self._gateways):
                self._drop(netns_fd)
            if self._shared is not None:
                self._shared.close()
                self._shared = None

    # -- the session's namespace ----------------------------------------------------

    def session_netns(self, netns: SessionNetns | None) -> None:
        """The bound session got ``netns``: link it now if the policy lets anything out."""
        with self._lock:
            self._session = netns
            if (
                netns is not None
                and self.mechanism == "nftables"
                and self.policy.mode != "deny_all"
            ):
                self._link(netns, self.policy)

    def session_released(self, netns: SessionNetns | None) -> None:
        """The session's namespace is about to close: its gateway and link go first."""
        with self._lock:
            if netns is not None and netns.fd in self._gateways:
                self._drop(netns.fd)
            if self._session is netns:
                self._session = None

    # -- policy ---------------------------------------------------------------------

    def replace(self, policy: EgressPolicy) -> EgressStatus:
        """Make ``policy`` the sandbox's, for every connection from now on (blocking)."""
        if self.mechanism == "none" and policy.mode != "deny_all":
            raise BadRequestError(f"egress policy {policy.mode!r} unavailable: {self.unavailable}")
        with self._lock:
            if policy.mode != "deny_all":
                self._ensure_links(policy)
            self.policy = policy
            self._broadcast({"policy": policy})
        return self.status()

    def sync(self) -> None:
        """Wait until every gateway's events so far are counted (blocking)."""
        with self._lock:
            self._broadcast({})

    def _broadcast(self, control: dict[str, object], *, only: int | None = None) -> None:
        """Send ``control`` to every gateway (``only``: the one of that namespace fd) and
        wait for each to answer."""
        self._seq += 1
        waits = [
            (fd, gw, gw.expect(self._seq))
            for fd, gw in self._gateways.items()
            if only is None or fd == only
        ]
        line = msgspec.json.encode({"seq": self._seq, **control}) + b"\n"
        for _, gw, _ in waits:
            stdin = gw.process.stdin
            assert stdin is not None
            with contextlib.suppress(OSError):
                stdin.write(line)
                stdin.flush()
        for fd, gw, acked in waits:
            if not acked.wait(_ACK_TIMEOUT_S):
                # Fail closed: without its gateway the link carries nothing.
                log.error("egress gateway on %s did not answer", gw.link.host_if)
                self._drop(fd)
            gw.forget(self._seq)

    # -- a turn's refusals ----------------------------------------------------------

    def watch(self, *, session: bool, notify: Callable[[], None]) -> TurnRefusals:
        """Keep the refusals of the bound session's namespace (``session``) or of the
        shared one from now until ``unwatch``; ``notify`` (any thread) says one came."""
        refusals = TurnRefusals(session=session, notify=notify)
        with self._counts_lock:
            self._watches.add(refusals)
        return refusals

    def unwatch(self, refusals: TurnRefusals) -> None:
        with self._counts_lock:
            self._watches.discard(refusals)

    def watched_fd(self, refusals: TurnRefusals) -> int | None:
        """The namespace fd whose gateway ``refusals`` hears (None: no gateway, nothing to
        wait for)."""
        netns = self._session if refusals.session else self._shared
        if netns is None or netns.fd not in self._gateways:
            return None
        return netns.fd

    def settle(self, refusals: TurnRefusals) -> None:
        """Wait until the watched gateway has reported every decision so far (blocking)."""
        with self._lock:
            fd = self.watched_fd(refusals)
            if fd is not None:
                self._broadcast({}, only=fd)

    def status(self) -> EgressStatus:
        with self._counts_lock:
            return EgressStatus(
                mechanism=self.mechanism,
                policy=self.policy,
                allowed_total=self.allowed_total,
                refused_total=self.refused_total,
                recent_refused=list(self._recent),
            )

    def link_for(self, netns: SessionNetns) -> Link | None:
        """The link ``netns`` was given, if any (benchmarks and diagnostics)."""
        gateway = self._gateways.get(netns.fd)
        return gateway.link if gateway is not None else None

    def gateway_pid(self, netns: SessionNetns) -> int | None:
        """The pid of the gateway serving ``netns``, if any (benchmarks)."""
        gateway = self._gateways.get(netns.fd)
        return gateway.process.pid if gateway is not None else None

    # -- the jail's hook ------------------------------------------------------------

    def apply(self, spec: JobSpec) -> JobSpec:
        """The job's namespace and network settings (the jail calls this for every job)."""
        fd = spec.netns_fd
        if fd is None:
            shared = self._shared
            if self.policy.mode == "deny_all" or shared is None or shared.closed:
                return spec
            fd = shared.fd
            spec = dataclasses.replace(spec, netns_fd=fd)
        gateway = self._gateways.get(fd)
        if gateway is None:
            return spec
        return dataclasses.replace(
            spec,
            env={**gateway.env, **spec.env},
            readonly_binds=(*spec.readonly_binds, (gateway.resolv_conf, "/etc/resolv.conf")),
        )

    # -- links and gateways ---------------------------------------------------------

    def _ensure_links(self, policy: EgressPolicy) -> None:
        if self._shared is None or self._shared.closed:
            self._shared = create_netns()
        for netns in (self._shared, self._session):
            if netns is not None and not netns.closed and netns.fd not in self._gateways:
                self._link(netns, policy)

    def _link(self, netns: SessionNetns, policy: EgressPolicy) -> None:
        link = attach(netns.fd, subnet=self._settings.subnet, ports=PORTS)
        try:
            gateway = self._spawn(link, policy, netns)
        except BaseException:
            detach(link)
            raise
        if not gateway.ready.wait(_ACK_TIMEOUT_S):
            gateway.process.kill()
            gateway.process.wait()
            detach(link)
            raise PlumbingError(f"egress gateway on {link.host_if} did not start")
        self._gateways[netns.fd] = gateway
        log.info("egress link %s (gateway %s) up", link.host_if, link.gateway)

    def _drop(self, netns_fd: int) -> None:
        gateway = self._gateways.pop(netns_fd, None)
        if gateway is not None:
            gateway.stop()

    def _spawn(self, link: Link, policy: EgressPolicy, netns: SessionNetns) -> Gateway:
        gateway = spawn_gateway(
            link, policy, netns, settings=self._settings, state_dir=self._state_dir
        )
        stdout = gateway.process.stdout
        assert stdout is not None
        threading.Thread(
            target=self._read, args=(gateway, stdout), name="sandcell-egress", daemon=True
        ).start()
        return gateway

    def _read(self, gateway: Gateway, stream: IO[bytes]) -> None:
        decoder = msgspec.json.Decoder(_Line)
        for raw in stream:
            try:
                line = decoder.decode(raw)
            except msgspec.DecodeError:
                log.warning("egress gateway wrote a line that is not a message")
                continue
            if line.ack is not None:
                gateway.acked(line.ack)
            if line.event is not None:
                self._count(gateway, line.event)

    def _count(self, gateway: Gateway, event: EgressEvent) -> None:
        with self._counts_lock:
            self.by_transport[(event.verdict, event.transport)] += 1
            if event.verdict == "allowed":
                self.allowed_total += 1
                return
            self.refused_total += 1
            self._recent.append(event)
            if self._watches:
                # The namespace each watch means now: a session bound since it began counts.
                netns = {True: self._session, False: self._shared}
                for refusals in self._watches:
                    if netns[refusals.session] is gateway.netns:
                        refusals.add(event)
        log.info(
            "egress refused (%s): %s %s port %d",
            event.reason,
            event.name or "-",
            event.address or "-",
            event.port,
        )


def unavailable_reason(*, jailed: bool, allow_network: bool) -> str | None:
    """Why this runner cannot enforce an egress policy (None when it can)."""
    if not jailed:
        return "egress needs the jail (SANDCELL_RUNNER_JAIL=none)"
    if allow_network:
        return "egress is off while SANDCELL_RUNNER_ALLOW_NETWORK=1 (jobs share the host's network)"
    from .plumbing import tools_missing

    return tools_missing()


__all__ = ["EgressManager", "unavailable_reason"]
