"""Network by allow-list: a sandboxed command reaches what is listed (a real sshd, a real
HTTP server by name through the proxy) and nothing else, and every refusal reaches the
command's observation. Real processes, real sockets; plus the list's own rules and the
IT-Bench parsers."""

from __future__ import annotations

import http.server
import os
import shutil
import socket
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import pytest

from cmbs_async.targets import destinations_from_inventory, destinations_from_kubeconfig
from executors import ExecutorError, LocalExecutor
from executors.netpolicy import (
    Allowed,
    Broker,
    NetworkPolicyError,
    Policy,
    Route,
    proxy_env,
)
from executors.observation import CommandEnv, Observation
from executors.sandbox import find_bwrap

from .helpers import until
from .sshd import LocalSshd, sshd_available

needs_bwrap = pytest.mark.skipif(find_bwrap() is None, reason="bubblewrap does not work here")
PY = sys.executable


@pytest.fixture(scope="module")
def sshd() -> Iterator[LocalSshd]:
    if not sshd_available():
        pytest.skip("OpenSSH sshd is not installed")
    with LocalSshd() as server:
        yield server


@pytest.fixture
async def executor() -> AsyncIterator[LocalExecutor]:
    async with LocalExecutor(sandbox="bwrap", kill_grace=0.3) as running:
        yield running
    # nothing of it is left: no guard, no broker thread
    assert await until(lambda: _guards() == [] and _broker_threads() == [])


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """A host service on 127.0.0.1 that is not on the list."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        server.setblocking(False)
        yield server


@pytest.fixture(scope="module")
def web() -> Iterator[int]:
    """A host HTTP server on 127.0.0.1 that answers every GET with its path."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = f"served {self.path}".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield int(server.server_address[1])
    server.shutdown()
    server.server_close()
    thread.join()


async def run(executor: LocalExecutor, workdir: str, command: str, env: CommandEnv) -> Observation:
    with anyio.fail_after(120):
        return await executor.run_command(workdir, command, timeout=60, env=env)


def connect(host: str, port: int) -> str:
    """A command that connects and says ``connected`` or why not."""
    code = (
        "import socket\n"
        "try:\n"
        f"    socket.create_connection(({host!r}, {port}), timeout=10).close()\n"
        "    print('connected')\n"
        "except OSError as exc:\n"
        "    print('failed:', exc)\n"
    )
    return f"{PY} -c {_quoted(code)}"


def _quoted(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"


def _guards() -> list[int]:
    """Network guards still running (only this module starts any)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if any(arg.endswith(b"netguard.py") for arg in argv) and state != "Z":
            found.append(int(entry))
    return found


def _broker_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("cmbs-netpolicy")]


# -- through the sandbox ---------------------------------------------------------------
@needs_bwrap
@pytest.mark.anyio
async def test_ssh_reaches_the_listed_sshd_and_nothing_else(
    executor: LocalExecutor, sshd: LocalSshd, listener: socket.socket
) -> None:
    env = CommandEnv(network=(f"127.0.0.1:{sshd.port}",), readable=(sshd.client_key,))
    workdir = await executor.prepare(None, {}, env=env)
    ssh = (
        f"ssh -i {sshd.client_key} -p {sshd.port} -o BatchMode=yes -o LogLevel=ERROR "
        f"-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null {sshd.user}@127.0.0.1"
    )
    # a few MB each way: the relay keeps pace and passes the end of input on
    reached = await run(executor, workdir, f"head -c 3000000 /dev/zero | {ssh} 'wc -c'", env)
    assert reached.success, reached.stderr.text
    assert reached.stdout.text.strip() == "3000000"
    assert reached.network_refused == ()
    fetched = await run(executor, workdir, f"{ssh} 'head -c 3000000 /dev/zero' | wc -c", env)
    assert fetched.success and fetched.stdout.text.strip() == "3000000"

    other = listener.getsockname()[1]
    refused = await run(executor, workdir, connect("127.0.0.1", other), env)
    assert refused.stdout.text.startswith("failed:")
    assert refused.network_refused == (f"127.0.0.1:{other} (not on the allow-list)",)
    assert "refused connections: 127.0.0.1:" in (refused.error or "")
    with pytest.raises(BlockingIOError):  # the host service never saw it
        listener.accept()

    # the listed port at another address: taken in, asked about, refused, reset
    elsewhere = await run(executor, workdir, f"{ssh.replace('127.0.0.1', '192.0.2.7')} true", env)
    assert not elsewhere.success
    assert elsewhere.network_refused == (f"192.0.2.7:{sshd.port} (not on the allow-list)",)

    # what was said once is not said again
    again = await run(executor, workdir, f"{ssh} true", env)
    assert again.success and again.network_refused == () and again.error is None


@needs_bwrap
@pytest.mark.anyio
async def test_a_flood_of_refusals_is_capped_and_stops_nothing(
    executor: LocalExecutor, sshd: LocalSshd
) -> None:
    env = CommandEnv(network=(f"127.0.0.1:{sshd.port}",))
    workdir = await executor.prepare(None, {}, env=env)
    flood = (
        "import socket\n"
        "for port in range(20000, 23000):\n"
        "    try:\n"
        "        socket.create_connection(('192.0.2.9', port), timeout=10)\n"
        "    except OSError:\n"
        "        pass\n"
        f"socket.create_connection(('127.0.0.1', {sshd.port}), timeout=30).recv(3)\n"
        "print('still through')\n"
    )
    observed = await run(executor, workdir, f"{PY} -c {_quoted(flood)}", env)
    assert observed.success and "still through" in observed.stdout.text
    named, more = observed.network_refused[:-1], observed.network_refused[-1]
    assert len(named) == 50 and named[0] == "192.0.2.9:20000 (not on the allow-list)"
    assert more.endswith(" more not named)")


@needs_bwrap
@pytest.mark.anyio
async def test_udp_and_dns_are_refused_and_recorded(executor: LocalExecutor) -> None:
    env = CommandEnv(network=("127.0.0.1:1",))
    workdir = await executor.prepare(None, {}, env=env)
    code = (
        "import socket\n"
        "query = bytes.fromhex('123401000001000000000000076578616d706c6503636f6d0000010001')\n"
        "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        "s.connect(('192.0.2.53', 53))\n"
        "s.send(query)\n"
        "try:\n"
        "    s.recv(512)\n"
        "except OSError as exc:\n"
        "    print('dns:', exc.strerror)\n"
        "try:\n"
        "    socket.getaddrinfo('cmbs-not-listed.example', 443)\n"
        "except OSError:\n"
        "    print('unresolved')\n"
    )
    observed = await run(executor, workdir, f"{PY} -c {_quoted(code)}", env)
    assert "dns: Connection refused" in observed.stdout.text
    assert "unresolved" in observed.stdout.text  # DNS, wherever it points, stays inside
    assert "192.0.2.53:53/udp (UDP does not leave the sandbox)" in observed.network_refused


@needs_bwrap
@pytest.mark.anyio
async def test_a_listed_name_is_reached_through_the_proxy(
    executor: LocalExecutor, web: int
) -> None:
    env = CommandEnv(network=(f"localhost:{web}",))
    workdir = await executor.prepare(None, {}, env=env)
    # urllib with the proxy's variables (not told to bypass it for localhost)
    fetch = (
        "import urllib.request\n"
        f"print(urllib.request.urlopen('http://localhost:{web}/by-urllib', timeout=30).read())\n"
    )
    command = f"env -u NO_PROXY -u no_proxy {PY} -c {_quoted(fetch)}"
    observed = await run(executor, workdir, command, env)
    assert observed.success, observed.stderr.text
    assert "served /by-urllib" in observed.stdout.text
    # and directly: the sandbox's /etc/hosts knows the name
    direct = await run(executor, workdir, f"{PY} -c {_quoted(fetch)}", env)
    assert direct.success and "served /by-urllib" in direct.stdout.text
    assert observed.network_refused == direct.network_refused == ()


@needs_bwrap
@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
@pytest.mark.anyio
async def test_the_proxy_speaks_http_connect_and_socks(executor: LocalExecutor, web: int) -> None:
    env = CommandEnv(network=(f"localhost:{web}",))
    workdir = await executor.prepare(None, {}, env=env)
    curl = "curl -sS --noproxy '' --max-time 30"
    ways = {
        "absolute": f'{curl} -x "$HTTP_PROXY" http://localhost:{web}/absolute',
        "connect": f'{curl} -p -x "$HTTP_PROXY" http://localhost:{web}/connect',
        "socks": f'{curl} -x "$ALL_PROXY" http://localhost:{web}/socks',
    }
    for way, command in ways.items():
        observed = await run(executor, workdir, command, env)
        assert observed.success, (way, observed.stderr.text)
        assert observed.stdout.text == f"served /{way}"

    refused = await run(
        executor, workdir, f'{curl} -x "$HTTP_PROXY" http://cmbs-not-listed.example:{web}/', env
    )
    assert "not on the allow-list" in refused.stdout.text  # the proxy's 403, said
    assert refused.network_refused == (f"cmbs-not-listed.example:{web} (not on the allow-list)",)
    socks = await run(executor, workdir, f'{curl} -x "$ALL_PROXY" http://localhost:1/', env)
    assert not socks.success
    assert socks.network_refused == ("localhost:1 (not on the allow-list)",)


HOSTILE = r"""
import os, socket
port = int(os.environ["HTTP_PROXY"].rsplit(":", 1)[1])
def ask(data):
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        said = b""
        while chunk := s.recv(4096):
            said += chunk
    print(said.split(b"\r\n")[0].decode() if said.startswith(b"HTTP") else said.hex())
ask(b"garbage\r\n\r\n")
ask(b"CONNECT somewhere:0 HTTP/1.1\r\n\r\n")
ask(b"GET http://" + b"a" * 300 + b"/ HTTP/1.1\r\n\r\n")
ask(b"GET https://localhost/ HTTP/1.1\r\n\r\n")
ask(b"\x05\x01\x02")
ask(b"\x05\x01\x00\x05\x02\x00\x01" + bytes(6))
ask(b"\x05\x01\x00\x05\x01\x00\x07" + bytes(6))
"""


@needs_bwrap
@pytest.mark.anyio
async def test_the_guard_survives_hostile_proxy_requests(executor: LocalExecutor, web: int) -> None:
    env = CommandEnv(network=(f"localhost:{web}",))
    workdir = await executor.prepare(None, {}, env=env)
    observed = await run(executor, workdir, f"{PY} -c {_quoted(HOSTILE)}", env)
    failed = "0001" + "00" * 6  # after a SOCKS5 answer's code: no address
    assert observed.stdout.text.splitlines() == [
        *["HTTP/1.1 400 Bad Request"] * 4,
        "05ff",  # no method it accepts
        f"0500 0507{failed}".replace(" ", ""),  # greeted; CONNECT only
        f"0500 0508{failed}".replace(" ", ""),  # greeted; no such address type
    ], observed.stderr.text
    assert observed.network_refused == ()  # nothing was asked of the broker
    fetch = (
        f"import urllib.request; print(urllib.request.urlopen('http://localhost:{web}/').read())"
    )
    after = await run(executor, workdir, f"{PY} -c {_quoted(fetch)}", env)
    assert after.success and "served /" in after.stdout.text


@needs_bwrap
@pytest.mark.anyio
async def test_an_unresolvable_name_is_one_clear_line_before_anything_runs(
    executor: LocalExecutor,
) -> None:
    env = CommandEnv(network=("cmbs-no-such-host.invalid:22", "127.0.0.1:22"))
    with pytest.raises(NetworkPolicyError) as raised:
        await executor.prepare(None, {}, env=env)
    message = str(raised.value)
    assert isinstance(raised.value, ExecutorError)
    assert "\n" not in message
    assert message.startswith("network: cmbs-no-such-host.invalid:22: ")
    assert "does not resolve" in message
    assert os.listdir(executor.workdir_root) == []  # no workdir kept, no sandbox made
    assert _guards() == []


@needs_bwrap
@pytest.mark.anyio
async def test_a_guard_that_cannot_start_stops_the_sandbox_with_its_reason(
    executor: LocalExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    failing = "import sys; sys.stderr.write('cmbs netguard: cannot listen\\n'); sys.exit(1)"
    real = Broker.config

    def config(self: Broker) -> dict[str, object]:
        return {**real(self), "argv": [PY, "-I", "-S", "-c", failing]}

    monkeypatch.setattr(Broker, "config", config)
    with pytest.raises(ExecutorError, match="could not start: cmbs netguard: cannot listen$"):
        await executor.prepare(None, {}, env=CommandEnv(network=("127.0.0.1:1",)))


@needs_bwrap
@pytest.mark.anyio
async def test_the_canary_is_refused_and_recorded_and_not_blamed_on_a_command(
    executor: LocalExecutor,
) -> None:
    env = CommandEnv(network=("127.0.0.1:1",))
    workdir = await executor.prepare(None, {}, env=env)
    checks = {check.name: check for check in executor.containment_of(workdir).canary}
    outside = checks["connect outside the network policy"]
    assert outside.held and outside.target == "192.0.2.1:9"
    recorded = checks["record a refused connection"]
    assert recorded.held and recorded.detail == "192.0.2.1:9 (not on the allow-list)"
    assert executor.containment_of(workdir).network == "only 127.0.0.1:1"
    first = await run(executor, workdir, "true", env)
    assert first.success and first.network_refused == () and first.error is None
    assert first.stdout.text == ""


@needs_bwrap
@pytest.mark.anyio
async def test_commands_get_the_proxy_unless_they_set_their_own(executor: LocalExecutor) -> None:
    listed = CommandEnv(network=("127.0.0.1:3128",))  # the usual proxy port is taken
    workdir = await executor.prepare(None, {}, env=listed)
    seen = await run(executor, workdir, "echo $HTTPS_PROXY $ALL_PROXY $NO_PROXY", listed)
    assert seen.stdout.text.split() == [
        "http://127.0.0.1:8118",
        "socks5h://127.0.0.1:8118",
        "localhost,127.0.0.1,::1",
    ]
    own = CommandEnv(network=listed.network, values={"HTTPS_PROXY": "http://10.1.1.1:8080"})
    mine = await run(executor, workdir, "echo $HTTPS_PROXY", own)
    assert mine.stdout.text.strip() == "http://10.1.1.1:8080"


# -- the list's rules ------------------------------------------------------------------
def test_a_policy_routes_only_what_is_listed() -> None:
    policy = Policy.resolve(
        ["10.0.0.5:22", "[2001:db8::1]:6443", "*.example.com:443", "localhost:80"]
    )
    assert policy.route("10.0.0.5", 22) == Route(("10.0.0.5",))
    assert policy.route("10.0.0.5", 23) is None
    assert policy.route("::ffff:10.0.0.5", 22) == Route(("10.0.0.5",))  # mapped: the same
    assert policy.route("2001:db8:0:0::1", 6443) == Route(("2001:db8::1",))
    # a name under the domain, by the proxy; not the domain itself, nor a look-alike
    assert policy.route("api.example.com", 443) == Route(name="api.example.com")
    assert policy.route("a.b.Example.COM.", 443) == Route(name="a.b.example.com")
    assert policy.route("example.com", 443) is None
    assert policy.route("evilexample.com", 443) is None
    assert policy.route("api.example.com", 80) is None
    # a listed name: its addresses, which a direct connection may use too
    route = policy.route("localhost", 80)
    assert route is not None and "127.0.0.1" in route.addresses
    assert policy.route("127.0.0.1", 80) is not None
    assert policy.route("localhost", 22) is None
    assert policy.route("not-listed.example", 22) is None
    assert policy.plan() == {"ports": [22, 80, 6443], "proxy": 3128}
    hosts = policy.hosts_file().decode()
    assert "127.0.0.1 localhost" in hosts and "example.com" not in hosts


def test_a_listed_names_other_addresses_are_tried_too() -> None:
    """A client that resolved a listed name would try its other addresses: so does the
    broker, when the one it was sent to does not answer."""
    addresses = ("10.0.0.1", "10.0.0.2")
    policy = Policy((Allowed("db.internal", 22, addresses),), {"db.internal": addresses})
    assert policy.route("10.0.0.2", 22) == Route(("10.0.0.2", "10.0.0.1"))
    assert policy.route("db.internal", 22) == Route(addresses)
    assert policy.route("10.0.0.3", 22) is None
    assert b"10.0.0.2 db.internal" in policy.hosts_file()


def test_the_proxy_env_names_the_proxy_for_every_client() -> None:
    env = proxy_env(3128)
    assert env["HTTPS_PROXY"] == env["https_proxy"] == "http://127.0.0.1:3128"
    assert env["ALL_PROXY"] == "socks5h://127.0.0.1:3128"
    assert "127.0.0.1" in env["NO_PROXY"].split(",")


# -- IT-Bench's scenario data -------------------------------------------------------------
def test_inventory_hosts_and_ports() -> None:
    inventory = (
        "# IT-Bench writes this\n"
        "[rhel9_servers]\n"
        'rhel9 ansible_host="10.0.0.7" ansible_port="2222" ansible_user=root '
        "ansible_ssh_private_key_file=/k/id\n"
        "named.example.org\n"
        "web[01:03].example.org ansible_port=2200\n"
        "legacy:5309\n"
        "app[1:2]:8022\n"
        "box ansible_ssh_host=10.0.0.9\n"
        "v6 ansible_host=2001:db8::7\n"
        "[control]\n"
        "localhost ansible_connection=local\n"
        "[db]\n"
        "db1 ansible_host=10.0.0.10\n"
        "[db:vars]\n"
        "ansible_port = 5022\n"
        "[backend:children]\n"
        "db\n"
        "[backend:vars]\n"
        "ansible_port=6022\n"
        "[all:vars]\n"
        "ansible_user=ops\n"
    )
    assert destinations_from_inventory(inventory) == (
        "10.0.0.7:2222",
        "named.example.org:22",
        "web01.example.org:2200",
        "web02.example.org:2200",
        "web03.example.org:2200",
        "legacy:5309",
        "app1:8022",
        "app2:8022",
        "10.0.0.9:22",
        "[2001:db8::7]:22",
        "10.0.0.10:5022",  # its own group's port over its parent's
    )
    # and what it gives is a network a scenario may declare
    assert CommandEnv(network=destinations_from_inventory(inventory)).network[0] == "10.0.0.7:2222"


@pytest.mark.parametrize(
    ("inventory", "says"),
    [
        ("[g]\nh ansible_host='{{ target }}'\n", "cannot tell where it is"),
        ("[g]\nh ansible_port=ssh\n", "cannot tell where it is"),
        ("[g]\nlocalhost ansible_connection=local\n", "names no host"),
        ("", "names no host"),
        ("[g]\nh ansible_host='unclosed\n", "inventory line 2"),
    ],
)
def test_an_unusable_inventory_is_one_line(inventory: str, says: str) -> None:
    with pytest.raises(ValueError, match=says) as raised:
        destinations_from_inventory(inventory)
    assert "\n" not in str(raised.value)


def test_kubeconfig_servers() -> None:
    kubeconfig = (
        "apiVersion: v1\n"
        "clusters:\n"
        "- name: kind\n"
        "  cluster: {server: 'https://127.0.0.1:39123', certificate-authority-data: x}\n"
        "- name: prod\n"
        "  cluster: {server: 'https://API.Example.com', proxy-url: 'http://10.0.0.3:3128'}\n"
        "- name: v6\n"
        "  cluster: {server: 'https://[2001:db8::2]:6443'}\n"
        "users: []\n"
    )
    assert destinations_from_kubeconfig(kubeconfig) == (
        "127.0.0.1:39123",
        "api.example.com:443",
        "10.0.0.3:3128",
        "[2001:db8::2]:6443",
    )


@pytest.mark.parametrize(
    ("kubeconfig", "says"),
    [
        ("clusters: []\n", "no cluster names a server"),
        ("just text\n", "no cluster names a server"),
        ("clusters: [{cluster: {server: 'not a url'}}]\n", "is not a URL with a host"),
        ("clusters: [{cluster: {server: 'https://h:99999'}}]\n", "is not a URL with a host"),
        ("clusters: [\n", "not YAML"),
    ],
)
def test_an_unusable_kubeconfig_is_one_line(kubeconfig: str, says: str) -> None:
    with pytest.raises(ValueError, match=says) as raised:
        destinations_from_kubeconfig(kubeconfig)
    assert "\n" not in str(raised.value)
