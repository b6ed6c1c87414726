"""Egress policy enforced by the runner's gateway, against a "remote" namespace the test made.

One runner (sessions on) and one remote network serve the module. The remote's
addresses are private, so the runner is started with them as an operator-allowed
network (``SANDCELL_RUNNER_EGRESS_ALLOW_NETS``) and their DNS server as its
upstream: traffic goes nowhere but to namespaces this module created.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.fixtures.egress_remote import RemoteNetwork
from tests.fixtures.paths import traversable_dir
from tests.fixtures.runner_process import RunnerProcess, start_runner
from tests.runner.helpers import b64
from tests.runner.session.helpers import new_session_id

ALLOWED = "allowed.egress.test"
OTHER = "other.egress.test"


def _tables() -> set[str]:
    out = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
    return set(re.findall(r"table inet (sandcell_egress_[0-9a-f]{4})", out))


class Sandbox:
    """The module's runner, its remote network, and the links its jobs were seen on."""

    def __init__(self, runner: RunnerProcess, remote: RemoteNetwork) -> None:
        self.runner = runner
        self.remote = remote
        self.http = runner.client()
        self.links: set[str] = set()

    def policy(self, mode: str = "allow", **rules: Any) -> dict[str, Any]:
        response = self.http.put("/v1/egress", json={"mode": mode, **rules})
        assert response.status_code == 200, response.text
        status: dict[str, Any] = response.json()
        return status

    def run(self, code: str, *, language: str = "bash", session: str | None = None) -> str:
        """Run ``code`` (the CA in ``ca.pem``); returns stdout, asserting exit 0."""
        headers = {"X-Runtime-Session-Id": session} if session else {}
        # The job's link name, to check afterwards that every link is gone.
        probe = "ip -o link | grep -o 'sce[0-9a-f]*j' >&2 || true\n" if language == "bash" else ""
        response = self.http.post(
            "/v1/execute",
            headers=headers,
            json={
                "language": language,
                "code": probe + code,
                "timeout_ms": 60_000,
                "inline_files": [
                    {"name": "ca.pem", "content_b64": b64(self.remote.ca.read_bytes())}
                ],
            },
        )
        assert response.status_code == 200, response.text
        result = response.json()
        self.links.update(re.findall(r"sce([0-9a-f]{4})j", result["stderr"]))
        assert result["exit_code"] == 0, (result["exit_code"], result["stderr"][-2000:])
        stdout: str = result["stdout"]
        return stdout

    def status(self) -> dict[str, Any]:
        status: dict[str, Any] = self.http.get("/v1/egress").json()
        return status


@pytest.fixture(scope="module")
def sandbox() -> Iterator[Sandbox]:
    with traversable_dir("egress-") as root:
        remote = RemoteNetwork(root)
        try:
            runner = start_runner(
                root,
                env={
                    "SANDCELL_RUNNER_SESSIONS": "1",
                    "SANDCELL_RUNNER_EGRESS_DNS": remote.address,
                    "SANDCELL_RUNNER_EGRESS_ALLOW_NETS": remote.network,
                },
            )
            box = Sandbox(runner, remote)
            try:
                yield box
            finally:
                box.http.close()
                runner.stop()
        finally:
            remote.close()
        # Every link the jobs used, and its table, went with the runner.
        assert box.links, "no job reported its link"
        left = {i for i in box.links if f"sandcell_egress_{i}" in _tables()}
        left |= {i for i in box.links if _interface_exists(f"sce{i}h")}
        assert not left, f"egress links left behind: {left}"


def _interface_exists(name: str) -> bool:
    return subprocess.run(["ip", "link", "show", name], capture_output=True).returncode == 0


CURL = "curl -sS -m 20 --cacert ca.pem"
CODES = "curl -s -m 20 --cacert ca.pem -o /dev/null -w '%{http_code}/%{http_connect}\\n'"
"""Prints ``answer/CONNECT answer``: ``200/200`` through a tunnel, ``000/403`` a refused
tunnel, ``403/000`` a refused plain request, ``200/000`` a direct (transparent) one."""


def test_health_names_the_mechanism(sandbox: Sandbox) -> None:
    health = httpx.get(sandbox.runner.url + "/health", headers=sandbox.runner.headers())
    assert health.json()["egress"] == "nftables"


def test_deny_all_jobs_see_only_loopback(sandbox: Sandbox) -> None:
    """The default, as before: a job's namespace holds lo and nothing else."""
    sandbox.policy("deny_all")
    out = sandbox.run("ip -o link | awk -F': ' '{print $2}'; env | grep -ci proxy || true")
    assert out.split() == ["lo", "0"]


def test_allowed_name_answers_through_curl_and_urllib(sandbox: Sandbox) -> None:
    """HTTP and HTTPS by the proxy variables (curl, urllib) and by the transparent redirect."""
    sandbox.policy(allow=[ALLOWED])
    out = sandbox.run(
        f"{CURL} http://{ALLOWED}/; echo\n"
        f"{CURL} https://{ALLOWED}/; echo\n"
        f"{CURL} --noproxy '*' https://{ALLOWED}/; echo\n"
        "python3 - <<'EOF'\n"
        "import ssl, urllib.request\n"
        "ctx = ssl.create_default_context(cafile='ca.pem')\n"
        f"for url in ('http://{ALLOWED}/', 'https://{ALLOWED}/'):\n"
        "    with urllib.request.urlopen(url, context=ctx, timeout=20) as r:\n"
        "        print(r.status, r.read().decode())\n"
        "EOF\n"
    )
    assert out.splitlines() == [f"remote:{ALLOWED}"] * 3 + [f"200 remote:{ALLOWED}"] * 2


def test_transparent_tls_is_decided_by_its_server_name(sandbox: Sandbox) -> None:
    """A job that skips the resolver (its own address for the name) is judged by SNI, and
    connected to the address the gateway resolved itself."""
    sandbox.policy(allow=[ALLOWED])
    remote = sandbox.remote
    out = sandbox.run(
        f"{CODES} --noproxy '*' --resolve {ALLOWED}:443:{remote.second_address}"
        f" https://{ALLOWED}/ || true\n"
        f"{CODES} --noproxy '*' --resolve {OTHER}:443:{remote.address} https://{OTHER}/ || true\n"
    )
    assert out.split() == ["200/000", "000/000"]
    refused = [e for e in sandbox.status()["recent_refused"] if e["transport"] == "tls"]
    assert refused[-1]["name"] == OTHER


def test_other_name_is_refused_at_once_and_recorded(sandbox: Sandbox) -> None:
    sandbox.policy(allow=[ALLOWED])
    before = sandbox.status()["refused_total"]
    out = sandbox.run(
        f"{CURL} -o /dev/null -w '%{{http_code}}\\n' http://{OTHER}/\n"
        f"{CURL} https://{OTHER}/ 2>&1; echo rc=$?\n"
        f"{CURL} --noproxy '*' https://{OTHER}/ 2>&1; echo rc=$?\n"
        "python3 - <<'EOF'\n"
        "import urllib.request\n"
        "try:\n"
        f"    urllib.request.urlopen('https://{OTHER}/', timeout=20)\n"
        "except OSError as exc:\n"
        "    print('urllib:', exc)\n"
        "EOF\n"
    )
    lines = out.splitlines()
    assert lines[0] == "403"
    assert "CONNECT tunnel failed, response 403" in out
    assert "rc=56" in out
    assert "Could not resolve host" in out  # the resolver refused the name
    assert "rc=6" in out
    assert "Tunnel connection failed: 403" in out
    status = sandbox.status()
    assert status["refused_total"] >= before + 4
    refused = [e for e in status["recent_refused"] if e["name"] == OTHER]
    assert {e["transport"] for e in refused} >= {"http", "connect", "dns"}
    assert {e["reason"] for e in refused} == {"not_allowed"}
    assert any(e["port"] == 443 for e in refused)


def test_refused_addresses_and_private_answers(sandbox: Sandbox) -> None:
    """An IP literal of a refused range, and names whose answer is private, the metadata
    address or this host's own, are refused whatever the policy allows."""
    sandbox.policy(allow=["*.egress.test", "192.168.0.0/16", "169.254.0.0/16"])
    out = sandbox.run(
        f"for u in http://192.168.77.7/ https://private.egress.test/ http://hostside.egress.test/"
        f" http://metadata.egress.test/ http://169.254.169.254/latest/meta-data/; do\n"
        f"  {CODES} $u || true\n"
        "done\n"
        f"{CURL} -sI http://192.168.77.7/ | grep -i x-sandcell-egress | tr -d '\\r'\n"
        "getent hosts private.egress.test || echo no-answer\n"
        f"{CURL} https://www.wild.egress.test/\n"
    )
    lines = out.splitlines()
    assert lines[:5] == ["403/000", "000/403", "403/000", "403/000", "403/000"]
    assert lines[5].lower() == "x-sandcell-egress: refused_address"
    assert lines[6] == "no-answer"
    assert lines[7] == "remote:www.wild.egress.test"
    reasons = {(e["name"], e["reason"]) for e in sandbox.status()["recent_refused"] if e["name"]}
    assert ("private.egress.test", "refused_address") in reasons
    assert ("hostside.egress.test", "refused_address") in reasons


RAW_TCP = """
import socket, sys
def talk(host, port):
    try:
        with socket.create_connection((host, port), timeout=10) as s:
            s.sendall(b"ping")
            return s.recv(4) .decode() or "closed"
    except OSError as exc:
        return type(exc).__name__
for host, port in [tuple(a.split(":")) for a in sys.argv[1:]]:
    print(talk(host, int(port)))
"""


def test_raw_tcp_follows_cidr_rules(sandbox: Sandbox) -> None:
    remote = sandbox.remote
    sandbox.policy(allow=[ALLOWED, f"{remote.address}/32:7000"])
    out = sandbox.run(
        f"cat > t.py <<'EOF'\n{RAW_TCP}\nEOF\n"
        f"python3 t.py {remote.address}:7000 {remote.second_address}:7000 {remote.address}:7001"
    )
    assert out.split() == ["ping", "ConnectionResetError", "ConnectionResetError"]


UDP = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(1.5)
for target in sys.argv[1:]:
    host, port = target.split(":")
    s.sendto(b"hello", (host, int(port)))
    try:
        print(s.recvfrom(100)[0].decode())
    except OSError as exc:
        print(type(exc).__name__)
"""


def test_udp_other_than_dns_is_dropped(sandbox: Sandbox) -> None:
    remote = sandbox.remote
    sandbox.policy(mode="allow_all")
    out = sandbox.run(
        f"cat > u.py <<'EOF'\n{UDP}\nEOF\n"
        "gw=$(awk '/nameserver/{print $2}' /etc/resolv.conf)\n"
        f"python3 u.py {remote.address}:9999 $gw:9999\n"
        f"getent hosts {ALLOWED} | awk '{{print $1}}'\n"
    )
    assert out.split() == ["TimeoutError", "TimeoutError", remote.address]


def test_a_replaced_policy_decides_the_next_connection(sandbox: Sandbox) -> None:
    """In a session (its own namespace): each PUT changes what the very next job reaches."""
    session = new_session_id("egress")
    probe = f"{CODES} https://{OTHER}/ || true"
    sandbox.policy(allow=[ALLOWED])
    assert sandbox.run(probe, session=session).split() == ["000/403"]
    sandbox.policy(allow=[ALLOWED, OTHER])
    assert sandbox.run(probe, session=session).split() == ["200/200"]
    sandbox.policy(allow=[ALLOWED], deny=[])
    assert sandbox.run(probe, session=session).split() == ["000/403"]
    sandbox.policy(mode="allow_all", deny=["other.egress.test:443"])
    assert sandbox.run(probe, session=session).split() == ["000/403"]
    sandbox.http.delete("/v1/session", headers={"X-Runtime-Session-Id": session})


def test_allow_all_still_keeps_metadata_and_host_services_out(sandbox: Sandbox) -> None:
    """Under allow_all: the metadata address, the runner's port and a host service on every
    address of the host stay unreachable, while the remote answers."""
    with socket.socket() as service:
        service.bind(("0.0.0.0", 0))
        service.listen()
        port = service.getsockname()[1]
        addresses = subprocess.run(
            ["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True
        ).stdout
        host_ips = sorted(set(re.findall(r"inet (\d+\.\d+\.\d+\.\d+)/", addresses)))
        sandbox.policy(mode="allow_all")
        targets = [f"{ip}:{port}" for ip in host_ips] + [
            f"{ip}:{sandbox.runner.port}" for ip in host_ips
        ]
        out = sandbox.run(
            f"cat > t.py <<'EOF'\n{RAW_TCP}\nEOF\n"
            "gw=$(awk '/nameserver/{print $2}' /etc/resolv.conf)\n"
            f"python3 t.py 169.254.169.254:80 $gw:{port} $gw:{sandbox.runner.port} "
            f"{' '.join(targets)}\n"
            f"{CODES} http://metadata.google.internal/ || true\n"
            f"{CURL} https://{ALLOWED}/\n"
        )
    lines = out.split()
    assert lines[-1] == f"remote:{ALLOWED}"
    assert lines[-2] == "403/000"
    assert set(lines[:-2]) <= {"ConnectionResetError", "ConnectionRefusedError"}, lines
    assert len(lines[:-2]) == 3 + len(targets)


def test_the_job_cannot_change_the_rules(sandbox: Sandbox) -> None:
    """No capability over its namespace: links, routes and nftables stay as the runner set them."""
    sandbox.policy(allow=[ALLOWED])
    out = sandbox.run(
        "grep CapEff /proc/self/status | awk '{print $2}'\n"
        "dev=$(ip -o link | grep -o 'sce[0-9a-f]*j' | head -1)\n"
        "ip link set $dev down 2>/dev/null && echo changed || echo link-kept\n"
        "ip route del default 2>/dev/null && echo changed || echo route-kept\n"
        "ip addr add 10.99.0.1/32 dev $dev 2>/dev/null && echo changed || echo addr-kept\n"
        "nft flush ruleset 2>/dev/null && echo changed || echo nft-refused\n"
        "nft add table inet mine 2>/dev/null && echo changed || echo nft-refused\n"
        f"{CODES} https://{OTHER}/ || true\n"
        f"{CURL} https://{ALLOWED}/\n"
    )
    assert out.split() == [
        "0000000000000000",
        "link-kept",
        "route-kept",
        "addr-kept",
        "nft-refused",
        "nft-refused",
        "000/403",
        f"remote:{ALLOWED}",
    ]


HOARD = """
import select, socket, time
gw = open("/etc/resolv.conf").read().split()[1]
socks, reset = [], 0
for _ in range(300):
    try:
        s = socket.create_connection((gw, 3128), timeout=60)
        # A request begun and never finished (the proxy's listener hands a connection
        # to the gateway only once it has sent something: TCP_DEFER_ACCEPT).
        s.send(b"C")
        socks.append(s)
    except ConnectionResetError:  # the reset came before connect() looked at the socket
        reset += 1
# Wait for the resets (a loaded machine is slow to send them), then a little longer for
# any extra one, well inside the 30 s the gateway gives an undecided connection.
pending, deadline = set(socks), time.monotonic() + 20
while pending and reset < 300 - 256 and time.monotonic() < deadline:
    for s in select.select(list(pending), [], [], 1)[0]:
        pending.discard(s)
        try:
            s.recv(1)
        except ConnectionResetError:
            reset += 1
time.sleep(0.5)
for s in select.select(list(pending), [], [], 0)[0]:
    try:
        s.recv(1)
    except ConnectionResetError:
        reset += 1
print(reset)
"""


def test_connections_a_sandbox_holds_open_are_bounded(sandbox: Sandbox) -> None:
    """Past 256 undecided or relayed connections the gateway resets new ones at once."""
    sandbox.policy(allow=[ALLOWED])
    out = sandbox.run(f"cat > h.py <<'EOF'\n{HOARD}\nEOF\npython3 h.py")
    assert int(out) == 300 - 256


def test_bad_policies_are_400_and_change_nothing(sandbox: Sandbox) -> None:
    sandbox.policy(allow=[ALLOWED])
    for body in (
        {"mode": "allow", "allow": ["*"]},
        {"mode": "deny_all", "allow": [ALLOWED]},
        {"mode": "open"},
        {"mode": "allow", "allow": ["a..b"]},
    ):
        response = sandbox.http.put("/v1/egress", content=json.dumps(body))
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == "bad_request"
    assert sandbox.status()["policy"]["allow"] == [ALLOWED]


def _stream(
    sandbox: Sandbox, code: str, *, protocol: str, session: str | None = None
) -> list[dict[str, Any]]:
    """The NDJSON events of a streamed execute sent as a peer speaking ``protocol``."""
    headers = {"Accept": "application/x-ndjson", "X-Sandcell-Protocol": protocol}
    if session:
        headers["X-Runtime-Session-Id"] = session
    response = sandbox.http.post(
        "/v1/execute",
        headers=headers,
        json={
            "language": "bash",
            "code": "ip -o link | grep -o 'sce[0-9a-f]*j' >&2 || true\n" + code,
            "timeout_ms": 60_000,
            "inline_files": [
                {"name": "ca.pem", "content_b64": b64(sandbox.remote.ca.read_bytes())}
            ],
        },
    )
    assert response.status_code == 200, response.text
    events = [json.loads(line) for line in response.text.splitlines() if line.strip()]
    assert events[-1]["type"] == "result", events[-1]
    sandbox.links.update(re.findall(r"sce([0-9a-f]{4})j", events[-1]["result"]["stderr"]))
    assert events[-1]["result"]["exit_code"] == 0, events[-1]["result"]["stderr"][-2000:]
    return events


REFUSED_THREE = (
    f"{CODES} https://{OTHER}/ || true\n"
    "python3 -c \"import socket; socket.create_connection(('169.254.169.254', 80), 10)\" "
    "2>/dev/null; echo tcp\n"
    f"getent hosts {OTHER} || echo no-answer\n"
)
"""A refused tunnel (a name and its port), a refused address (its address and port),
a refused lookup."""


@pytest.mark.parametrize("in_session", [False, True], ids=["shared", "session"])
def test_a_streamed_turn_carries_its_refusals_with_their_destinations(
    sandbox: Sandbox, in_session: bool
) -> None:
    """To a 1.2 peer: each refusal of the job is an ``egress_refused`` event before the
    result, naming its destination; the runner's counter moved by as many."""
    sandbox.policy(allow=[ALLOWED])
    session = new_session_id("egress-events") if in_session else None
    before = sandbox.status()["refused_total"]
    events = _stream(sandbox, REFUSED_THREE, protocol="1.2", session=session)
    refused = [e for e in events if e["type"] == "egress_refused"]
    seen = [(e["transport"], e["name"], e["address"], e["port"], e["reason"]) for e in refused]
    # The tunnel's refusal comes first (curl has its 403 before the next command runs).
    # The address's and the lookup's may come in either order: the kernel completes the
    # job's handshake with the transparent listener before the gateway accepts it, so
    # on a loaded machine the job's lookup can reach the gateway's resolver first.
    assert seen[0] == ("connect", OTHER, None, 443, "not_allowed")
    tcp = ("tcp", None, "169.254.169.254", 80, "refused_address")
    assert seen.count(tcp) == 1, seen
    # The lookup: one refusal per query (A, and AAAA when the resolver library asks).
    assert {s for s in seen[1:] if s != tcp} == {("dns", OTHER, None, 53, "not_allowed")}
    assert all(e["at_ms"] > 0 for e in refused)
    assert not [e for e in events if e["type"] == "egress_omitted"]
    assert sandbox.status()["refused_total"] - before == len(refused)
    if session:
        sandbox.http.delete("/v1/session", headers={"X-Runtime-Session-Id": session})


def test_an_older_peer_gets_no_egress_events(sandbox: Sandbox) -> None:
    """A 1.1 peer (or one that announces nothing) decodes strictly: the same job's stream
    carries only its output and result, while the runner still counts the refusals."""
    sandbox.policy(allow=[ALLOWED])
    before = sandbox.status()["refused_total"]
    for protocol in ("1.1", "1.0"):
        events = _stream(sandbox, REFUSED_THREE, protocol=protocol)
        assert {e["type"] for e in events} <= {"stdout", "stderr", "result"}
    assert sandbox.status()["refused_total"] - before >= 6


def test_a_turn_past_the_limit_gets_twenty_and_one_count(sandbox: Sandbox) -> None:
    """25 refused connects: 20 ``egress_refused`` events, then ``egress_omitted`` 5."""
    sandbox.policy(allow=[ALLOWED])
    code = (
        "python3 - <<'EOF'\n"
        "import socket\n"
        "for port in range(7100, 7125):\n"
        "    try:\n"
        "        socket.create_connection(('169.254.169.254', port), 10)\n"
        "    except OSError:\n"
        "        pass\n"
        "EOF\n"
    )
    events = _stream(sandbox, code, protocol="1.2")
    types = [e["type"] for e in events if e["type"].startswith("egress")]
    assert types == ["egress_refused"] * 20 + ["egress_omitted"]
    refused = [e for e in events if e["type"] == "egress_refused"]
    assert [e["port"] for e in refused] == list(range(7100, 7120))
    assert events[-2] == {"type": "egress_omitted", "count": 5}
