"""Where webhooks may be sent, and a transport that connects only there.

A webhook URL is chosen by the API caller, but its POST leaves from the
orchestrator's network position. Unchecked, that reaches loopback services, the
cloud metadata endpoint (169.254.169.254) and the private network: server-side
request forgery. So a destination must be globally routable unless the operator
allow-listed its network (``SANDCELL_APP_WEBHOOK_ALLOW_NETS``), checked twice:

* when the URL is accepted (``WebhookTargets.check_url``, no DNS): a literal
  address in any spelling ``getaddrinfo`` accepts (``127.1``, ``2130706433``,
  ``[::ffff:127.0.0.1]``) and the names reserved for loopback (``localhost``,
  ``*.localhost``) are refused with a ``bad_request`` that says why;
* when connecting (``PinnedTransport``): the host is resolved, the connection is
  refused if *any* address is not allowed, and the socket is opened to a vetted
  address itself, never re-resolved, so a name that answers public at the first
  lookup and private at the next (DNS rebinding) gains nothing.

What counts as refused (every spelling of loopback, link-local, metadata, private
and special-purpose addresses, and the loopback and metadata names) is
``sandcell_protocol.addresses``, shared with the runner's egress gateway.

Not covered: the orchestrator host's own public addresses. A service there that
listens on every interface is reachable through them; bind such services to
loopback or a private address, or filter egress at the network.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from ipaddress import IPv6Address

import anyio
import httpcore
import httpx

from sandcell_protocol.addresses import AddressRules, IPAddress, IPNetwork, literal_address

from .errors import AppRequestError

__all__ = [
    "IPAddress",
    "IPNetwork",
    "PinnedTransport",
    "Resolver",
    "WebhookTargetError",
    "WebhookTargets",
    "resolve_host",
]

Resolver = Callable[[str, int], Awaitable[Sequence[IPAddress]]]
"""``(host, port) -> addresses``: how ``PinnedTransport`` looks a host up."""

_ALLOW_HINT = "(an operator can allow private receivers with SANDCELL_APP_WEBHOOK_ALLOW_NETS)"


class WebhookTargetError(AppRequestError):
    """A webhook URL points where this service does not send (a ``bad_request``)."""


@dataclass(frozen=True, slots=True)
class WebhookTargets:
    """Which addresses webhooks may reach: public ones, plus ``allow_nets``."""

    allow_nets: tuple[IPNetwork, ...] = ()
    """Networks the operator allows although not public (on-prem receivers, tests)."""

    def allows(self, address: IPAddress) -> bool:
        """True if a webhook may be sent to ``address``."""
        return AddressRules(self.allow_nets).allows(address)

    def check_url(self, url: str) -> None:
        """Refuse (``WebhookTargetError``) a URL whose destination is known to be refused.

        Only what the URL itself says is checked: a name is resolved, and checked
        again, when a delivery connects.
        """
        try:
            parsed = httpx.URL(url)
        except httpx.InvalidURL:
            raise WebhookTargetError("webhook_url is not a valid URL") from None
        host = parsed.raw_host.decode("ascii", "replace")
        if parsed.scheme not in ("http", "https") or not host:
            raise WebhookTargetError("webhook_url must be an http(s) URL with a host")
        if parsed.userinfo:
            raise WebhookTargetError("webhook_url must not carry user info")
        address = literal_address(host)
        if address is not None:
            if not self.allows(address):
                raise WebhookTargetError(
                    f"webhook_url: {address} is not a public address {_ALLOW_HINT}"
                )
            return
        name = host.rstrip(".").lower()
        # RFC 6761: these names always mean this machine (or a metadata service),
        # whatever DNS says.
        if not AddressRules(self.allow_nets).allows_name(name):
            raise WebhookTargetError(
                f"webhook_url: {name[:255]} is this machine or a metadata service {_ALLOW_HINT}"
            )

    def vet(self, host: str, addresses: Iterable[IPAddress]) -> list[IPAddress]:
        """``addresses`` of ``host`` to connect to, in order; refused if any is not allowed.

        All must pass, not one: the resolver's order, and which address a retry or
        another worker picks, are not ours to rely on.
        """
        # Mapped addresses are connected to as the IPv4 address they stand for.
        found = list(
            dict.fromkeys(
                item.ipv4_mapped if isinstance(item, IPv6Address) and item.ipv4_mapped else item
                for item in addresses
            )
        )
        for address in found:
            if not self.allows(address):
                raise WebhookTargetError(
                    f"webhook host {host[:255]} resolves to {address},"
                    f" which is not a public address {_ALLOW_HINT}"
                )
        return found


async def resolve_host(host: str, port: int) -> list[IPAddress]:
    """Every address ``host`` resolves to (the event loop's getaddrinfo runs in a thread)."""
    infos = await asyncio.get_running_loop().getaddrinfo(
        host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
    )
    return [ipaddress.ip_address(str(info[4][0])) for info in infos]


class _VettingBackend(httpcore.AsyncNetworkBackend):
    """httpcore's socket opener, resolving and vetting the host itself; see the module docstring.

    The ``timeout`` parameters are httpcore's interface, hence the ``noqa``s.
    """

    def __init__(self, targets: WebhookTargets, resolver: Resolver) -> None:
        self._targets = targets
        self._resolver = resolver
        self._inner = httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        try:
            # One deadline for the lookup and every address tried, as for a plain connect.
            with anyio.fail_after(timeout):
                addresses = self._targets.vet(host, await self._resolver(host, port))
                failure = httpcore.ConnectError(f"{host[:255]} has no address")
                for address in addresses:
                    try:
                        return await self._inner.connect_tcp(
                            str(address),
                            port,
                            local_address=local_address,
                            socket_options=socket_options,
                        )
                    except httpcore.ConnectError as exc:
                        failure = exc
                raise failure
        except TimeoutError:
            raise httpcore.ConnectTimeout(f"connecting to {host[:255]} timed out") from None
        except OSError as exc:  # the lookup failed
            raise httpcore.ConnectError(f"{host[:255]}: {exc.strerror or exc}") from exc

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        raise httpcore.UnsupportedProtocol("webhooks are not sent over unix sockets")

    async def sleep(self, seconds: float) -> None:
        await anyio.sleep(seconds)


# httpcore's errors as httpx's, so the transport keeps httpx's contract; a test keeps it total.
_HTTPCORE_ERRORS: dict[type[Exception], type[httpx.TransportError]] = {
    httpcore.TimeoutException: httpx.TimeoutException,
    httpcore.ConnectTimeout: httpx.ConnectTimeout,
    httpcore.ReadTimeout: httpx.ReadTimeout,
    httpcore.WriteTimeout: httpx.WriteTimeout,
    httpcore.PoolTimeout: httpx.PoolTimeout,
    httpcore.NetworkError: httpx.NetworkError,
    httpcore.ConnectError: httpx.ConnectError,
    httpcore.ReadError: httpx.ReadError,
    httpcore.WriteError: httpx.WriteError,
    httpcore.ProxyError: httpx.ProxyError,
    httpcore.UnsupportedProtocol: httpx.UnsupportedProtocol,
    httpcore.ProtocolError: httpx.ProtocolError,
    httpcore.LocalProtocolError: httpx.LocalProtocolError,
    httpcore.RemoteProtocolError: httpx.RemoteProtocolError,
}


@contextlib.contextmanager
def _map_httpcore_errors() -> Iterator[None]:
    try:
        yield
    except Exception as exc:
        # The most specific class wins: ConnectTimeout, not TimeoutException.
        mapped = next(
            (_HTTPCORE_ERRORS[k] for k in type(exc).__mro__ if k in _HTTPCORE_ERRORS), None
        )
        if mapped is None:
            raise
        raise mapped(str(exc)) from exc


class _ResponseStream(httpx.AsyncByteStream):
    def __init__(self, stream: httpcore.Response) -> None:
        self._response = stream

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _map_httpcore_errors():
            async for chunk in self._response.aiter_stream():
                yield chunk

    async def aclose(self) -> None:
        with _map_httpcore_errors():
            await self._response.aclose()


class PinnedTransport(httpx.AsyncBaseTransport):
    """An httpx transport whose connections go only to vetted addresses of the URL's host.

    The check sits where sockets are opened (httpcore's network backend), so no
    path around it exists: a redirect, a retry or a new pooled connection all
    come through it. The URL is left alone, so the Host header, the TLS SNI and
    the certificate check all use the original name while the socket goes to the
    address that was vetted. (Rewriting the URL to the IP and pinning SNI with the
    ``sni_hostname`` extension would do for one request, but pools connections by
    IP, so one name's verified TLS connection could carry another name's request.)
    A refused host raises ``WebhookTargetError``; the rest are httpx's errors.
    """

    def __init__(
        self,
        targets: WebhookTargets,
        *,
        resolver: Resolver = resolve_host,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        limits = httpx.Limits()
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=ssl_context or httpx.create_ssl_context(trust_env=False),
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            network_backend=_VettingBackend(targets, resolver),
        )

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Send ``request`` over a connection to a vetted address."""
        if not isinstance(request.stream, httpx.AsyncByteStream):
            raise TypeError("PinnedTransport sends only async request bodies")
        core_request = httpcore.Request(
            method=request.method,
            url=httpcore.URL(
                scheme=request.url.raw_scheme,
                host=request.url.raw_host,
                port=request.url.port,
                target=request.url.raw_path,
            ),
            headers=request.headers.raw,
            content=request.stream,
            extensions=request.extensions,
        )
        with _map_httpcore_errors():
            response = await self._pool.handle_async_request(core_request)
        return httpx.Response(
            status_code=response.status,
            headers=response.headers,
            stream=_ResponseStream(response),
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        """Close every pooled connection."""
        await self._pool.aclose()
