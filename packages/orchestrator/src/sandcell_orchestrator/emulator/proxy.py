"""The per-VM proxy of the emulator: ``<emulator>/vm/<id>/...`` → that VM's runner.

Like the MicroVM service proxy it checks ``X-aws-proxy-auth`` (bound to the VM,
its allowed ports and its expiry) before anything else, resumes a suspended VM
on traffic when its idle policy allows, and answers 502 while the application is
not listening. Requests and answers are streamed both ways; hop-by-hop headers
and the proxy's own headers are not forwarded.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from sandcell_protocol.digits import is_ascii_digits

from ..runner.port_forward import HOP_BY_HOP
from .vm import TERMINAL, EmulatedVm, EmulatorClock, Faults, MicrovmFleet, VmState

__all__ = ["PROXY_METHODS", "ProxyTokens", "VmProxy"]

PROXY_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
_DEFAULT_PORT = 8080
# Not forwarded to the VM: hop-by-hop headers and the proxy's own routing and auth.
_HOP_BY_HOP = HOP_BY_HOP | {"host", "x-aws-proxy-auth", "x-aws-proxy-port"}


@dataclass(frozen=True, slots=True)
class _Token:
    vm_id: str
    expires_at: float
    ports: frozenset[int] | None  # None: every port


class ProxyTokens:
    """``X-aws-proxy-auth`` values: each bound to one VM, some ports, an expiry."""

    def __init__(self, *, clock: EmulatorClock, faults: Faults) -> None:
        self._clock = clock
        self._faults = faults
        self._tokens: dict[str, _Token] = {}

    def mint(self, vm: EmulatedVm, *, minutes: int, ports: frozenset[int] | None) -> str:
        """CreateMicrovmAuthToken's value (``Faults.token_lifetime_s`` overrides its life)."""
        # Never pruned: an emulator mints a few per VM, and tests audit them all.
        value = secrets.token_urlsafe(32)
        lifetime_s = self._faults.token_lifetime_s or minutes * 60.0
        self._tokens[value] = _Token(vm.microvm_id, self._clock() + lifetime_s, ports)
        return value

    def refusal(self, vm: EmulatedVm, value: str, *, port: int) -> str | None:
        """Why ``value`` does not open ``port`` of ``vm`` (None if it does)."""
        token = self._tokens.get(value)
        if token is None or token.vm_id != vm.microvm_id:
            return "invalid proxy token"
        if self._clock() >= token.expires_at:
            return "expired proxy token"
        if token.ports is not None and port not in token.ports:
            return f"the proxy token does not allow port {port}"
        return None

    def values(self) -> list[str]:
        """Every token ever minted (tests check that none leaks)."""
        return list(self._tokens)


def _refuse(status: int, message: str) -> Response:
    # Not a runner ErrorBody: callers can tell the proxy's refusals from the runner's.
    return JSONResponse({"message": message}, status_code=status)


def _forwardable(raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in raw if k.decode("latin-1").lower() not in _HOP_BY_HOP]


class VmProxy:
    """Serves every VM endpoint of one fleet; ``client`` must be open while serving."""

    def __init__(self, fleet: MicrovmFleet) -> None:
        self.fleet = fleet
        self.tokens = ProxyTokens(clock=fleet.clock, faults=fleet.faults)
        self.client: httpx.AsyncClient | None = None

    async def handle(self, request: Request) -> Response:
        """Check the proxy token, wake a suspended VM, stream to the runner and back."""
        vm = self.fleet.vms.get(request.path_params["vm_id"])
        if vm is None:
            return _refuse(404, "no such MicroVM endpoint")
        value = request.headers.get("x-aws-proxy-auth")
        if value is None:
            return _refuse(401, "missing X-aws-proxy-auth")
        port = request.headers.get("x-aws-proxy-port", str(_DEFAULT_PORT))
        problem = self.tokens.refusal(
            vm, value, port=int(port) if is_ascii_digits(port, max_length=5) else -1
        )
        if problem is not None:
            return _refuse(403, problem)
        if vm.state in TERMINAL:
            return _refuse(502, f"the MicroVM is {vm.state.value.lower()}")
        if vm.state in (VmState.SUSPENDING, VmState.SUSPENDED):
            if vm.idle is None or not vm.idle.auto_resume:
                return _refuse(502, "the MicroVM is suspended")
            self.fleet.resume(vm)
        if vm.process is None or vm.process.poll() is not None:
            return _refuse(502, "the MicroVM's application is not listening")
        return await self._forward(request, vm)

    async def _forward(self, request: Request, vm: EmulatedVm) -> Response:
        if self.client is None:
            raise RuntimeError("the proxy is not serving")
        path = request.path_params.get("path", "")
        url = httpx.URL(f"http://127.0.0.1:{vm.runner_port}/{path}").copy_with(
            query=request.url.query.encode()
        )
        has_body = "content-length" in request.headers or "transfer-encoding" in request.headers
        upstream_request = self.client.build_request(
            request.method,
            url,
            headers=_forwardable(request.headers.raw),
            content=request.stream() if has_body else None,
        )
        # In flight counts as activity: a long execute must not be suspended as idle.
        vm.in_flight += 1
        self.fleet.touch(vm)
        try:
            upstream = await self.client.send(upstream_request, stream=True)
        except httpx.HTTPError as exc:
            vm.in_flight -= 1
            return _refuse(502, f"the MicroVM's application did not answer ({type(exc).__name__})")

        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()
                vm.in_flight -= 1
                self.fleet.touch(vm)

        response = StreamingResponse(body(), status_code=upstream.status_code)
        response.raw_headers = _forwardable(upstream.headers.raw)
        return response
