"""Network by allow-list, the executor's side: what a sandbox may reach, and the broker
that decides each connection and records each refusal.

A sandbox whose network is a list of destinations (``HOST:PORT``, ``*.DOMAIN:PORT``,
``[IPV6]:PORT``) has a network of its own in which every address is local, served by
:mod:`executors.netguard`, which asks the broker here about every connection. The broker
decides with the list (the guard's word counts for nothing), connects from the executor's
network and passes the socket back; every refusal is kept until the command's observation
takes it (:meth:`Broker.observe`).

The list is resolved once, when the sandbox starts: a name that does not resolve is a
:class:`NetworkPolicyError`, before anything runs. The listed names, with the addresses
they resolved to, are the sandbox's ``/etc/hosts``, so that a tool finds them without DNS
(which never leaves the sandbox); a connection to one of those addresses on the name's
port is allowed. A ``*.DOMAIN`` entry can only be used through the proxy, which gets the
name: any name under DOMAIN is resolved when connecting.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import socket
import sys
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio

from .errors import ExecutorError
from .observation import Check, Observation

__all__ = [
    "NETGUARD",
    "Allowed",
    "Broker",
    "NetworkPolicyError",
    "Policy",
    "Route",
    "proxy_env",
    "start_broker",
]

#: The program that serves the sandbox's side (run by the launcher).
NETGUARD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "netguard.py")

#: How long the broker tries to connect to an allowed destination.
CONNECT_TIMEOUT = 10.0
#: How long an observation waits for the guard to have told everything it saw.
_SETTLE_TIMEOUT = 5.0
#: Connections being made at once (each a thread); more are refused until some are done.
_CONNECTING_MAX = 64
#: Refusals kept between two observations (the rest are counted).
_KEPT_MAX = 1000
#: Refusals one observation names (the rest are counted).
_SAID_MAX = 50
#: Ports the proxy may take, in order: the first not on the list.
_PROXY_PORTS: tuple[int, ...] = (3128, 8118, 1080, *range(3129, 3200))
_NAME = re.compile(r"^[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?)*$")
_NOT_LISTED = "not on the allow-list"
_MESSAGE_MAX = 1 << 16


class NetworkPolicyError(ExecutorError):
    """An allow-list that cannot be honoured (a name that does not resolve); one line."""


@dataclass(frozen=True)
class Allowed:
    """One entry of the list: ``host`` as listed (a name, an address or ``*.DOMAIN``), its
    port, and the addresses it stands for (none for ``*.DOMAIN``)."""

    host: str
    port: int
    addresses: tuple[str, ...]

    def __str__(self) -> str:
        return f"{_bracketed(self.host)}:{self.port}"


@dataclass(frozen=True)
class Route:
    """Where an allowed connection goes: these addresses, tried in order; or, for a name
    under an allowed ``*.DOMAIN``, that name (resolved when connecting)."""

    addresses: tuple[str, ...] = ()
    name: str | None = None


@dataclass(frozen=True)
class Policy:
    """A resolved allow-list: what is allowed, and what the sandbox needs to know of it."""

    entries: tuple[Allowed, ...]
    #: the names the sandbox resolves itself (``/etc/hosts``): ``localhost`` and the listed
    names: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    @classmethod
    def resolve(cls, network: Iterable[str]) -> Policy:
        """The list resolved; :class:`NetworkPolicyError` for a name that does not resolve.

        A listed name stands for the addresses the sandbox resolves it to (``localhost``:
        127.0.0.1 and ::1 there, whatever it is here).
        """
        parsed = []
        names: dict[str, tuple[str, ...]] = {"localhost": ("127.0.0.1", "::1")}
        for entry in network:
            host, _, port_text = entry.strip().rpartition(":")
            host = host[1:-1] if host.startswith("[") else host.lower().rstrip(".")
            port = int(port_text)
            parsed.append((host, port))
            if _address(host) is None and not host.startswith("*."):
                addresses = _resolve(entry, host, port)
                names[host] = tuple(dict.fromkeys([*names.get(host, ()), *addresses]))
        entries = []
        for host, port in parsed:
            literal = _address(host)
            if literal is not None:
                entries.append(Allowed(literal, port, (literal,)))
            else:
                entries.append(Allowed(host, port, names.get(host, ())))
        return cls(tuple(entries), names)

    def allows(self, address: str, port: int) -> bool:
        """Whether a connection to ``address`` (an IP address) and ``port`` is allowed."""
        return any(entry.port == port and address in entry.addresses for entry in self.entries)

    def route(self, host: str, port: int) -> Route | None:
        """Where a connection to ``host:port`` goes (``host`` an address, or a name given to
        the proxy), or ``None``: it is not on the list.

        An address: itself, then the other addresses of a listed name it is one of (a
        client that resolved the name would try them). A name the sandbox resolves
        itself: those of its addresses that are allowed. A name under an allowed
        ``*.DOMAIN``: that name.
        """
        address = _address(host)
        if address is not None:
            if not self.allows(address, port):
                return None
            others = [
                a
                for e in self.entries
                if e.port == port and address in e.addresses
                for a in e.addresses
            ]
            return Route(tuple(dict.fromkeys([address, *others])))
        name = host.lower().rstrip(".")
        if name in self.names:
            allowed = tuple(a for a in self.names[name] if self.allows(a, port))
            return Route(allowed) if allowed else None
        if _NAME.match(name):
            for entry in self.entries:
                suffix = entry.host[1:]  # ".DOMAIN" of "*.DOMAIN"
                if entry.host.startswith("*.") and entry.port == port and name.endswith(suffix):
                    return Route(name=name)
        return None

    @property
    def proxy_port(self) -> int:
        """The proxy's port on the sandbox's 127.0.0.1: one no entry uses."""
        used = {entry.port for entry in self.entries}
        return next(port for port in _PROXY_PORTS if port not in used)

    def plan(self) -> dict[str, Any]:
        """What the guard is told: the ports to listen on, the proxy's."""
        ports = sorted({entry.port for entry in self.entries if entry.addresses})
        return {"ports": ports, "proxy": self.proxy_port}

    def hosts_file(self) -> bytes:
        """The sandbox's ``/etc/hosts``: ``localhost`` and the listed names' addresses."""
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
        for name, addresses in self.names.items():
            if name != "localhost":
                lines += [f"{address} {name}" for address in addresses]
        return ("\n".join(lines) + "\n").encode()


def proxy_env(port: int) -> dict[str, str]:
    """The variables that send HTTP and SOCKS clients (curl, pip, kubectl) to the proxy
    on the sandbox's 127.0.0.1; the loopback itself is reached directly."""
    http, socks, direct = (
        f"http://127.0.0.1:{port}",
        f"socks5h://127.0.0.1:{port}",
        "localhost,127.0.0.1,::1",
    )
    env = {}
    for name, value in (
        ("HTTP_PROXY", http),
        ("HTTPS_PROXY", http),
        ("ALL_PROXY", socks),
        ("NO_PROXY", direct),
    ):
        env[name] = env[name.lower()] = value
    return env


async def start_broker(
    network: Iterable[str], *, connect_timeout: float = CONNECT_TIMEOUT
) -> Broker:
    """A broker for this list, resolved now (in a thread: names may take a while)."""
    policy = await anyio.to_thread.run_sync(Policy.resolve, tuple(network))
    return Broker(policy, connect_timeout=connect_timeout)


class Broker:
    """One sandbox's network, from the executor's side.

    Made before the sandbox: :attr:`fd` is the guard's end of their socket, passed into the
    sandbox (the same number there), and :meth:`config` what the launcher starts the guard
    with; :meth:`start` once the sandbox is started (a thread serves the guard, and each
    connection being made has a thread of its own, for at most the connect time-out);
    :meth:`close` once it has ended.
    """

    def __init__(self, policy: Policy, *, connect_timeout: float = CONNECT_TIMEOUT) -> None:
        self.policy = policy
        self.connect_timeout = connect_timeout
        #: what the sandbox's commands get in their environment: the proxy's address
        self.env = proxy_env(policy.proxy_port)
        self._sock, inside = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._inside: socket.socket | None = inside
        #: the guard's end, to pass into the sandbox
        self.fd = inside.fileno()
        os.set_inheritable(self.fd, True)
        self._sending = threading.Lock()  # the socket's sends, and its closing
        self._lock = threading.Lock()  # all below (never held while sending)
        self._refused: dict[str, None] = {}  # in order, each once
        self._uncounted = 0
        self._syncs: dict[int, threading.Event] = {}
        self._sync = 0
        self._connecting = 0
        self._closed = False
        #: whether the guard has gone (its end closed): nothing more leaves the sandbox
        self.ended = False
        self._thread = threading.Thread(target=self._serve, name="cmbs-netpolicy", daemon=True)

    def config(self) -> dict[str, Any]:
        """The launcher's ``netguard`` setting: the guard's descriptor (it keeps it open for
        the guard) and the guard's command line."""
        plan = json.dumps(self.policy.plan())
        python = os.path.realpath(sys.executable)
        return {"fd": self.fd, "argv": [python, "-I", "-S", NETGUARD, str(self.fd), plan]}

    def start(self) -> None:
        """Serve the guard (its end is in the sandbox now: ours goes)."""
        if self._inside is not None:
            self._inside.close()
            self._inside = None
        self._thread.start()

    def close(self) -> None:
        """Stop serving; a connection being made finds the broker closed and is dropped."""
        with self._sending:
            if self._closed:
                return
            self._closed = True
            try:
                self._sock.shutdown(socket.SHUT_RDWR)  # wakes the thread
            except OSError:
                pass
        if self._inside is not None:
            self._inside.close()
            self._inside = None
        if self._thread.is_alive():
            self._thread.join(5)
        with self._sending:
            self._sock.close()

    # -- what commands see ------------------------------------------------------------
    def refused(self) -> tuple[str, ...]:
        """The refusals recorded since last asked (``"10.0.0.9:443 (not on the
        allow-list)"``), each once, and how many more there were; cleared."""
        with self._lock:
            said, self._refused = list(self._refused), {}
            more, self._uncounted = self._uncounted, 0
        more += max(len(said) - _SAID_MAX, 0)
        said = said[:_SAID_MAX]
        if more:
            said.append(f"({more} more not named)")
        return tuple(said)

    def settle(self, timeout: float = _SETTLE_TIMEOUT) -> None:
        """Wait until the guard has told all it saw before now (or ``timeout`` passes)."""
        with self._lock:
            if self.ended or self._closed:
                return
            self._sync += 1
            number = self._sync
            synced = self._syncs[number] = threading.Event()
        if not self._send({"op": "sync", "id": number}):
            synced.set()
        synced.wait(timeout)
        with self._lock:
            self._syncs.pop(number, None)

    async def observe(self, observation: Observation) -> Observation:
        """``observation`` with the connections refused while its command ran (its error
        says so too), and whether the guard has gone."""
        await anyio.to_thread.run_sync(self.settle)
        refused = self.refused()
        said = []
        if refused:
            said.append("the sandbox refused connections: " + ", ".join(refused[:5]))
            if len(refused) > 5:
                said[-1] += ", ..."
        if self.ended:
            said.append("the sandbox's network guard has ended: nothing leaves the sandbox now")
        if not said:
            return observation
        error = "; ".join([*([observation.error] if observation.error else []), *said])
        return observation.model_copy(update={"network_refused": refused, "error": error})

    async def check_recorded(self, destination: str) -> Check:
        """The canary's check that its attempt to ``destination`` was refused *and*
        recorded (what else it caused is cleared: no command did it)."""
        await anyio.to_thread.run_sync(self.settle)
        refused = self.refused()
        found = [line for line in refused if line.startswith(destination + " ")]
        detail = found[0] if found else "not recorded"
        return Check(
            name="record a refused connection", target=destination, held=bool(found), detail=detail
        )

    # -- the thread -------------------------------------------------------------------
    def _serve(self) -> None:
        try:
            while True:
                try:
                    data, fds, _flags, _addr = socket.recv_fds(self._sock, _MESSAGE_MAX, 1)
                except OSError:
                    return
                for fd in fds:  # the guard has none to give
                    os.close(fd)
                if not data:
                    return
                try:
                    message = json.loads(data)
                except ValueError:
                    continue
                if isinstance(message, dict):
                    self._handle(message)
        finally:
            with self._lock:
                self.ended = True
                for synced in self._syncs.values():
                    synced.set()

    def _handle(self, message: dict[str, Any]) -> None:
        """One message of the guard's: told nothing it may not be, and decided here."""
        op, host, port = message.get("op"), message.get("host"), message.get("port")
        if op == "synced":
            with self._lock:
                synced = self._syncs.get(message.get("id", -1))
            if synced is not None:
                synced.set()
            return
        if not isinstance(host, str) or not isinstance(port, int) or not 0 < port < 65536:
            if op == "connect":
                self._refuse(message.get("id"), "?", "not a destination", policy=True)
            return
        where = f"{_bracketed(host[:255])}:{port}"
        if op == "refused" and _address(host) is not None:
            if message.get("proto") == "udp":
                self._record(f"{where}/udp (UDP does not leave the sandbox)")
            else:
                allowed = self.policy.allows(str(_address(host)), port)
                self._record(f"{where} ({'refused in the sandbox' if allowed else _NOT_LISTED})")
        elif op == "connect":
            number = message.get("id")
            route = self.policy.route(host, port)
            if route is None:
                self._refuse(number, where, _NOT_LISTED, policy=True)
                return
            with self._lock:
                busy = self._connecting >= _CONNECTING_MAX
                self._connecting += not busy
            if busy:
                self._refuse(number, where, "too many connections at once", policy=False)
                return
            worker = threading.Thread(
                target=self._connect,
                args=(number, where, route, port),
                name="cmbs-netpolicy-connect",
                daemon=True,
            )
            worker.start()

    def _connect(self, number: object, where: str, route: Route, port: int) -> None:
        try:
            try:
                conn = _open(route, port, self.connect_timeout, self.policy)
            except OSError as exc:
                self._refuse(number, where, f"could not connect: {_reason(exc)}", policy=False)
                return
            with conn:
                self._send({"id": number, "ok": True}, conn.fileno())
        finally:
            with self._lock:
                self._connecting -= 1

    def _refuse(self, number: object, where: str, why: str, *, policy: bool) -> None:
        self._record(f"{where} ({why})")
        self._send({"id": number, "ok": False, "why": f"{where}: {why}", "policy": policy})

    def _send(self, message: dict[str, Any], fd: int | None = None) -> bool:
        """Send to the guard (which never leaves its socket full for long); false if it is
        gone or the broker closed."""
        data = json.dumps(message).encode()
        with self._sending:
            if self._closed or self.ended:
                return False
            try:
                if fd is None:
                    self._sock.send(data)
                else:
                    socket.send_fds(self._sock, [data], [fd])
            except OSError:
                return False
        return True

    def _record(self, refusal: str) -> None:
        with self._lock:
            if refusal in self._refused:
                return
            if len(self._refused) >= _KEPT_MAX:
                self._uncounted += 1
            else:
                self._refused[refusal] = None


def _open(route: Route, port: int, timeout: float, policy: Policy) -> socket.socket:
    """A connection to ``route`` on ``port``: the first address that answers.

    A name under an allowed ``*.DOMAIN`` may resolve to anything: a loopback, link-local
    or unspecified address (a service of this machine, a cloud's metadata) it resolves to
    is not tried unless the list allows it by address.
    """
    addresses = route.addresses
    if route.name is not None:
        found = socket.getaddrinfo(route.name, port, type=socket.SOCK_STREAM)
        resolved = dict.fromkeys(_address(str(info[4][0])) or str(info[4][0]) for info in found)
        addresses = tuple(a for a in resolved if not _internal(a) or policy.allows(a, port))
        if not addresses:
            raise OSError(f"{route.name} resolves only to addresses of this machine")
    error: OSError = OSError("no address")
    for address in addresses:
        try:
            conn = socket.create_connection((address, port), timeout=timeout)
        except OSError as exc:
            error = exc
            continue
        conn.settimeout(None)
        return conn
    raise error


def _resolve(entry: str, host: str, port: int) -> tuple[str, ...]:
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise NetworkPolicyError(f"network: {entry}: {host} does not resolve ({reason})") from None
    addresses = [a for a in (_address(str(info[4][0])) for info in found) if a is not None]
    if not addresses:
        raise NetworkPolicyError(f"network: {entry}: {host} resolves to no address")
    return tuple(sorted(dict.fromkeys(addresses), key=lambda a: ":" in a))  # IPv4 first


def _address(host: str) -> str | None:
    """``host`` as a normalized IP address (an IPv4-mapped one as IPv4), or ``None``."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return address.compressed


def _internal(address: str) -> bool:
    """Whether ``address`` is this machine (one of its own addresses, a loopback, an
    unspecified one) or link-local (a cloud's metadata service): a name under a listed
    ``*.domain`` may not lead there."""
    ip = ipaddress.ip_address(_address(address) or address)
    own = ip.is_loopback or ip.is_link_local or ip.is_unspecified or ip.is_multicast
    return own or ip.compressed in _own_addresses()


def _own_addresses() -> frozenset[str]:
    """The addresses of this machine's interfaces (read now: they may change)."""
    found = set()
    try:
        with open("/proc/net/if_inet6") as handle:
            for line in handle:
                raw = line.split()[0]
                found.add(ipaddress.ip_address(int(raw, 16)).compressed)
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/proc/net/fib_trie") as handle:
            lines = handle.read().splitlines()
        for before, line in zip(lines, lines[1:], strict=False):
            if "/32 host LOCAL" in line:
                found.add(before.split()[-1])
    except OSError:
        pass
    return frozenset(found)


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc) or type(exc).__name__
