"""The network guard: the process that serves a sandbox's network when it is an allow-list.

Its other half, the one that decides, is the executor's (:mod:`executors.netpolicy`). The
launcher starts it at the sandbox's start, before any command, as ``python -I -S
netguard.py FD PLAN`` (the standard library only), as root with the network capabilities;
``FD`` is its ``SOCK_SEQPACKET`` socket to the executor, ``PLAN`` is JSON: ``{"ports":
[...], "proxy": PORT}``. It sets the sandbox's network up, drops every capability, writes
``ready`` on its stdout (else why not on its stderr, and exits), and serves:

- every address, IPv4 and IPv6, is made local to the sandbox's loopback (a route of type
  ``local`` for ``0.0.0.0/0`` and ``::/0``): a connection to anywhere lands in the
  sandbox, and nothing leaves it but through here;
- on every port of the allow-list it listens on every address: a connection accepted
  there goes to the executor with the address and port it was sent to, and the executor
  decides: it connects from its own network and passes the socket back, which is relayed
  to the command's; or it refuses, and the command's connection is reset;
- on 127.0.0.1 at the plan's ``proxy`` port it is a proxy (HTTP ``CONNECT``, HTTP with an
  absolute URL, SOCKS5) for destinations named by name: the same, for the name asked;
- on the loopback it watches for attempts nobody took: a TCP reset answering a
  connection attempt, an ICMP "port unreachable" answering a UDP datagram. Each is told
  to the executor, which records it as refused.

Messages to the executor: ``{"op": "connect", "id": N, "host": H, "port": P, "via":
"direct" | "proxy"}``, answered ``{"id": N, "ok": true}`` with the connected socket or
``{"id": N, "ok": false, "why": REASON, "policy": BOOL}``; ``{"op": "refused", "host": H,
"port": P, "proto": "tcp" | "udp"}``; ``{"op": "synced", "id": N}`` once everything seen
before the executor's ``{"op": "sync", "id": N}`` is told.
"""

import ctypes
import errno
import json
import os
import resource
import selectors
import socket
import struct
import sys
import time
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any
from urllib.parse import urlsplit

_CHUNK = 1 << 16  # read at a time; and the most held for a side that does not read
_HEAD_MAX = 16 << 10  # the most of a proxy request's head
_HANDSHAKES_MAX = 256  # proxy requests being read at once: the oldest goes beyond
_SNAP = 256  # bytes kept of a watched packet: its headers, and those it quotes
_BURST = 128  # connections taken at once from one listener (its backlog): others wait
_OUTBOX_MAX = 10_000  # messages waiting for the executor beyond which refusals go untold

_READ, _WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE
Handler = Callable[[int], None]

#: HTTP headers for one hop only: the proxy's, not the server's.
_HOP = {"connection", "keep-alive", "proxy-connection", "proxy-authorization", "te", "upgrade"}
_SOCKS_OK = b"\x05\x00\x00\x01" + bytes(6)


def _socks_error(code: int) -> bytes:
    return b"\x05" + bytes([code]) + b"\x00\x01" + bytes(6)


def _http_error(status: str, text: str) -> bytes:
    body = f"cmbs sandbox: {text}\n".encode()
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + body


class Guard:
    """The sandbox's network: set up on construction, then :meth:`serve` until the
    executor is gone."""

    def __init__(self, host: socket.socket, plan: dict[str, Any]) -> None:
        self.host = host
        self.selector = selectors.DefaultSelector()
        self.waiting: dict[int, _Waiting] = {}  # connections the executor is asked about
        self.handshakes: dict[socket.socket, _Handshake] = {}  # oldest first
        self.told: set[tuple[str, int, str]] = set()  # refusals told since the last sync
        self.outbox: deque[bytes] = deque()  # for the executor: never a blocking send
        self.number = 0
        _raise_fd_limit()
        _step("make every address local", _local_routes)
        self.listeners: list[socket.socket] = []
        for port in plan["ports"]:
            self.listeners += _step(f"listen on port {port}", partial(_listen_everywhere, port))
        self.proxy = _step(f"listen on 127.0.0.1:{plan['proxy']}", partial(_proxy, plan["proxy"]))
        self.sniffer = _step("watch the loopback", _sniffer)
        _step("drop privileges", _drop_privileges)
        self.watch(host, _READ, self._host_event)
        for listener in self.listeners:
            self.watch(listener, _READ, partial(self._accept_direct, listener))
        self.watch(self.proxy, _READ, lambda _mask: self._accept_proxy())
        self.watch(self.sniffer, _READ, lambda _mask: self._sniffed())

    def serve(self) -> None:
        """Until the executor's end of the socket closes (then the sandbox ends too)."""
        while True:
            for key, mask in self.selector.select():
                if self.selector.get_map().get(key.fd) is key:  # not gone meanwhile
                    key.data(mask)

    def watch(self, sock: socket.socket, events: int, handler: Handler) -> None:
        """Call ``handler`` on these events of ``sock`` (none: stop watching it)."""
        try:
            key = self.selector.get_key(sock)
        except (KeyError, ValueError):
            if events:
                self.selector.register(sock, events, handler)
            return
        if not events:
            self.selector.unregister(sock)
        elif key.events != events:
            self.selector.modify(sock, events, handler)

    def drop(self, sock: socket.socket, *, reset: bool = False) -> None:
        """Stop watching ``sock`` and close it (``reset``: with a TCP reset)."""
        self.watch(sock, 0, _nothing)
        if reset:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
        sock.close()

    def tell(self, message: dict[str, Any]) -> None:
        """Send ``message`` to the executor, in order, as soon as its socket takes it: the
        guard never waits, so it always reads the executor's answers, and neither side
        can hold up the other."""
        if len(self.outbox) >= _OUTBOX_MAX and message.get("op") == "refused":
            return  # a flood of refusals: the first ones tell the story
        self.outbox.append(json.dumps(message).encode())
        self._flush()

    def _flush(self) -> None:
        while self.outbox:
            try:
                self.host.send(self.outbox[0], socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            self.outbox.popleft()
        self.watch(self.host, _READ | (_WRITE if self.outbox else 0), self._host_event)

    def _host_event(self, mask: int) -> None:
        if mask & _WRITE:
            self._flush()
        if mask & _READ:
            self._from_host()

    def ask(self, client: socket.socket, host: str, port: int, waiting: "_Waiting") -> None:
        """Ask the executor to connect ``client`` to ``host:port``."""
        self.number += 1
        self.waiting[self.number] = waiting
        via = "direct" if waiting.kind == "direct" else "proxy"
        self.tell({"op": "connect", "id": self.number, "host": host, "port": port, "via": via})

    # -- what happens ----------------------------------------------------------------
    def _from_host(self) -> None:
        try:
            data, fds, _flags, _addr = socket.recv_fds(self.host, 4096, 1)
        except OSError:
            data, fds = b"", []
        if not data:  # the executor is gone: so is the sandbox
            raise SystemExit(0)
        message: dict[str, Any] = json.loads(data)
        upstream = socket.socket(fileno=fds[0]) if fds else None
        if message.get("op") == "sync":
            self._drain()
            self.told.clear()
            self.tell({"op": "synced", "id": message.get("id")})
            return
        waiting = self.waiting.pop(message.get("id", -1), None)
        if waiting is None:
            if upstream is not None:
                upstream.close()
        elif message.get("ok") and upstream is not None:
            waiting.connected(self, upstream)
        else:
            if upstream is not None:
                upstream.close()
            waiting.refused(self, str(message.get("why", "refused")), bool(message.get("policy")))

    def _drain(self) -> None:
        """Take every connection already made and every packet already seen."""
        for listener in self.listeners:
            self._accept_direct(listener, _READ)
        self._sniffed()

    def _accept_direct(self, listener: socket.socket, _mask: int) -> None:
        for conn in _accepted(listener):
            host, port = conn.getsockname()[:2]
            self.ask(conn, host, port, _Waiting(conn, "direct"))

    def _accept_proxy(self) -> None:
        for conn in _accepted(self.proxy):
            conn.setblocking(False)
            if len(self.handshakes) >= _HANDSHAKES_MAX:
                oldest = next(iter(self.handshakes.values()))
                oldest.close()
            handshake = _Handshake(self, conn)
            self.handshakes[conn] = handshake
            self.watch(conn, _READ, handshake.event)

    def _sniffed(self) -> None:
        while True:
            try:
                packet, address = self.sniffer.recvfrom(_SNAP)
            except OSError:  # none left (or the socket failed: nothing more is seen)
                return
            if address[2] != socket.PACKET_HOST:  # the copy of a packet on its way out
                continue
            attempt = _attempt(packet)
            if attempt is not None and attempt not in self.told:
                self.told.add(attempt)
                host, port, proto = attempt
                self.tell({"op": "refused", "host": host, "port": port, "proto": proto})


class _Waiting:
    """A connection the executor is asked about; how it is answered depends on how it came:
    ``direct``, ``connect`` (HTTP CONNECT), ``http`` (HTTP with an absolute URL),
    ``socks``."""

    def __init__(self, client: socket.socket, kind: str, forward: bytes = b"") -> None:
        self.client = client
        self.kind = kind
        self.forward = forward  # what the client sent that the server is to get

    def connected(self, guard: Guard, upstream: socket.socket) -> None:
        reply = {"connect": b"HTTP/1.1 200 Connection established\r\n\r\n", "socks": _SOCKS_OK}
        _Relay(
            guard,
            self.client,
            upstream,
            to_client=reply.get(self.kind, b""),
            to_server=self.forward,
        )

    def refused(self, guard: Guard, why: str, policy: bool) -> None:
        if self.kind == "direct":
            guard.drop(self.client, reset=True)
            return
        if self.kind == "socks":
            answer = _socks_error(2 if policy else 5)
        else:
            answer = _http_error("403 Forbidden" if policy else "502 Bad Gateway", why)
        _last_word(guard, self.client, answer)


class _Handshake:
    """A request to the proxy, read until it says where to (HTTP or SOCKS5)."""

    def __init__(self, guard: Guard, conn: socket.socket) -> None:
        self.guard = guard
        self.conn = conn
        self.buf = bytearray()
        self.greeted = False  # SOCKS5: the methods are agreed

    def close(self) -> None:
        self.guard.handshakes.pop(self.conn, None)
        self.guard.drop(self.conn)

    def event(self, _mask: int) -> None:
        try:
            data = self.conn.recv(_CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.close()
            return
        self.buf += data
        try:
            found = self._socks() if self.buf[0] == 5 else self._http()
        except _Bad as bad:
            self.guard.handshakes.pop(self.conn, None)
            _last_word(self.guard, self.conn, bad.answer)
            return
        if found is None:
            if len(self.buf) > _HEAD_MAX:
                self.guard.handshakes.pop(self.conn, None)
                _last_word(self.guard, self.conn, _http_error("431 Too Large", "request too large"))
            return
        host, port, waiting = found
        self.guard.handshakes.pop(self.conn, None)
        self.guard.watch(self.conn, 0, _nothing)
        self.guard.ask(self.conn, host, port, waiting)

    def _socks(self) -> tuple[str, int, _Waiting] | None:
        buf = self.buf
        if not self.greeted:
            if len(buf) < 2 or len(buf) < 2 + buf[1]:
                return None
            if 0 not in buf[2 : 2 + buf[1]]:
                raise _Bad(b"\x05\xff")  # only "no authentication" is offered
            try:
                self.conn.send(b"\x05\x00")
            except OSError:
                raise _Bad(b"") from None
            del buf[: 2 + buf[1]]
            self.greeted = True
        if len(buf) < 5:
            return None
        if buf[0] != 5 or buf[1] != 1:
            raise _Bad(_socks_error(7))  # CONNECT only
        if buf[3] == 1:
            end, host = 8, socket.inet_ntop(socket.AF_INET, bytes(buf[4:8]))
        elif buf[3] == 4:
            end = 20
            if len(buf) < end:
                return None
            host = socket.inet_ntop(socket.AF_INET6, bytes(buf[4:20]))
        elif buf[3] == 3:
            end, host = 5 + buf[4], bytes(buf[5 : 5 + buf[4]]).decode("ascii", "replace")
        else:
            raise _Bad(_socks_error(8))
        if len(buf) < end + 2:
            return None
        port = int.from_bytes(buf[end : end + 2], "big")
        if not _fair(host, port):
            raise _Bad(_socks_error(1))
        return host, port, _Waiting(self.conn, "socks", bytes(buf[end + 2 :]))

    def _http(self) -> tuple[str, int, _Waiting] | None:
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return None
        head = bytes(self.buf[:end]).decode("latin-1")
        rest = bytes(self.buf[end + 4 :])
        line, *headers = head.split("\r\n")
        parts = line.split(" ")
        if len(parts) != 3:
            raise _Bad(_http_error("400 Bad Request", "not an HTTP request"))
        method, target, version = parts
        try:
            if method.upper() == "CONNECT":
                host, _, port = target.rpartition(":")
                if not _fair(host.strip("[]"), int(port)):
                    raise ValueError
                return host.strip("[]"), int(port), _Waiting(self.conn, "connect", rest)
            url = urlsplit(target)
            name, port_number = url.hostname or "", url.port or 80
            if url.scheme.lower() != "http" or not _fair(name, port_number):
                raise ValueError
        except ValueError:
            raise _Bad(_http_error("400 Bad Request", "name http://HOST[:PORT]/...")) from None
        path = (url.path or "/") + (f"?{url.query}" if url.query else "")
        kept = [h for h in headers if h.partition(":")[0].strip().lower() not in _HOP]
        lines = [f"{method} {path} {version}", *kept, "Connection: close", "", ""]
        forward = "\r\n".join(lines).encode("latin-1") + rest
        return name, port_number, _Waiting(self.conn, "http", forward)


class _Bad(Exception):
    """A request the proxy cannot serve; ``answer`` says so to the client."""

    def __init__(self, answer: bytes) -> None:
        super().__init__()
        self.answer = answer


class _Relay:
    """Bytes both ways between a command's connection and the executor's; each way ends
    on its own (a half-close is passed on), and both close once both have ended."""

    def __init__(
        self,
        guard: Guard,
        client: socket.socket,
        server: socket.socket,
        *,
        to_client: bytes = b"",
        to_server: bytes = b"",
    ) -> None:
        self.guard = guard
        self.peer = {client: server, server: client}
        #: what is yet to be written to each
        self.pending = {client: bytearray(to_client), server: bytearray(to_server)}
        self.ended: set[socket.socket] = set()  # read to their end
        self.shut: set[socket.socket] = set()  # told that the other ended
        for sock in self.peer:
            sock.setblocking(False)
        self._update()

    def event(self, sock: socket.socket, mask: int) -> None:
        try:
            if mask & _READ:
                try:
                    data = sock.recv(_CHUNK)
                except BlockingIOError:
                    data = None
                if data == b"":
                    self.ended.add(sock)
                elif data:
                    self.pending[self.peer[sock]] += data
            if mask & _WRITE and self.pending[sock]:
                try:
                    del self.pending[sock][: sock.send(self.pending[sock])]
                except BlockingIOError:
                    pass
        except OSError:  # reset, or broken: both go
            self.close()
            return
        self._update()

    def _update(self) -> None:
        for sock, peer in self.peer.items():
            if peer in self.ended and not self.pending[sock] and sock not in self.shut:
                self.shut.add(sock)
                try:
                    sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
        if len(self.shut) == 2:
            self.close()
            return
        for sock, peer in self.peer.items():
            events = _WRITE if self.pending[sock] else 0
            if sock not in self.ended and len(self.pending[peer]) < _CHUNK:
                events |= _READ
            self.guard.watch(sock, events, partial(self.event, sock))

    def close(self) -> None:
        for sock in self.peer:
            self.guard.drop(sock)


def _nothing(_mask: int) -> None:
    pass


def _fair(host: str, port: int) -> bool:
    """Whether a destination asked of the proxy is one to ask the executor about."""
    return 0 < len(host) <= 255 and 0 < port < 65536


def _last_word(guard: Guard, sock: socket.socket, answer: bytes) -> None:
    """Say ``answer`` (best effort: it is short, and the socket's buffer empty), then close."""
    try:
        sock.send(answer)
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    guard.drop(sock)


def _accepted(listener: socket.socket) -> list[socket.socket]:
    """The connections waiting on ``listener`` (none left: an empty list)."""
    taken: list[socket.socket] = []
    while len(taken) < _BURST:
        try:
            conn, _ = listener.accept()
        except BlockingIOError:
            return taken
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                time.sleep(0.01)  # out of descriptors: some go before more come
            return taken
        taken.append(conn)
    return taken


def _attempt(packet: bytes) -> tuple[str, int, str] | None:
    """The destination of the attempt a watched packet refuses: the source of a TCP reset
    (it answers a connection attempt), or the destination an ICMP "port unreachable"
    quotes (it answers a UDP datagram)."""
    try:
        if packet[0] >> 4 == 4:
            family, header, proto, source = (
                socket.AF_INET,
                (packet[0] & 15) * 4,
                packet[9],
                packet[12:16],
            )
        else:
            family, header, proto, source = socket.AF_INET6, 40, packet[6], packet[8:24]
        body = packet[header:]
        if proto == 6 and len(body) >= 2:
            return socket.inet_ntop(family, source), int.from_bytes(body[0:2], "big"), "tcp"
        quoted = body[8:]  # after the ICMP header: the datagram's own headers
        if family == socket.AF_INET:
            proto, header, dest = quoted[9], (quoted[0] & 15) * 4, quoted[16:20]
        else:
            proto, header, dest = quoted[6], 40, quoted[24:40]
        if proto != 17 or len(quoted) < header + 4:
            return None
        port = int.from_bytes(quoted[header + 2 : header + 4], "big")
        return socket.inet_ntop(family, dest), port, "udp"
    except (IndexError, ValueError):
        return None


# -- setting up ------------------------------------------------------------------------
def _step(what: str, action: Callable[[], Any]) -> Any:
    """``action()``; its failure says what could not be done."""
    try:
        return action()
    except OSError as exc:
        raise OSError(exc.errno, f"cannot {what}: {exc.strerror or exc}") from None


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# netlink: a route of type local, in the local table, through the loopback
_RTM_NEWROUTE, _NLMSG_ERROR = 24, 2
_NLM_F_REQUEST, _NLM_F_ACK, _NLM_F_REPLACE, _NLM_F_CREATE = 1, 4, 0x100, 0x400
_RT_TABLE_LOCAL, _RTPROT_STATIC, _RT_SCOPE_HOST, _RTN_LOCAL, _RTA_OIF = 255, 4, 254, 2, 4


def _local_routes() -> None:
    """``ip route add local 0.0.0.0/0 dev lo table local``, and the same for ``::/0``
    where the sandbox has IPv6 (where it has not, no IPv6 address is reached at all)."""
    loopback = socket.if_nametoindex("lo")
    flags = _NLM_F_REQUEST | _NLM_F_ACK | _NLM_F_REPLACE | _NLM_F_CREATE
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as netlink:
        for sequence, family in enumerate((socket.AF_INET, socket.AF_INET6), 1):
            rtmsg = (family, 0, 0, 0, _RT_TABLE_LOCAL, _RTPROT_STATIC, _RT_SCOPE_HOST, _RTN_LOCAL)
            body = struct.pack("=8BIHHI", *rtmsg, 0, 8, _RTA_OIF, loopback)
            header = struct.pack("=IHHII", 16 + len(body), _RTM_NEWROUTE, flags, sequence, 0)
            netlink.send(header + body)
            answer = netlink.recv(4096)
            kind = struct.unpack_from("=H", answer, 4)[0]
            code = -struct.unpack_from("=i", answer, 16)[0] if kind == _NLMSG_ERROR else 0
            if code and family == socket.AF_INET:
                raise OSError(code, os.strerror(code))


def _bind(family: socket.AddressFamily, address: str, port: int) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((address, port))
        sock.listen(128)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def _listen_everywhere(port: int) -> list[socket.socket]:
    """Listeners on ``port`` of every address (IPv6 too, where the sandbox has it)."""
    listeners = [_bind(socket.AF_INET, "0.0.0.0", port)]
    try:
        listeners.append(_bind(socket.AF_INET6, "::", port))
    except OSError as exc:
        if exc.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
            raise
    return listeners


def _proxy(port: int) -> socket.socket:
    return _bind(socket.AF_INET, "127.0.0.1", port)


# classic BPF: loads (A = packet[k], A = packet[X + k], X = 4 * (packet[k] & 15)), and, jumps
_LD_W, _LD_H, _LD_B = 0x20, 0x28, 0x30
_LD_W_X, _LD_H_X, _LD_B_X, _LDX_IHL = 0x40, 0x48, 0x50, 0xB1
_AND, _JEQ, _JSET, _RET = 0x54, 0x15, 0x45, 0x06
_PKTTYPE = 0xFFFFF000 + 4  # SKF_AD_OFF + SKF_AD_PKTTYPE: how the packet came
_RST_ACK = 0x14
_SO_ATTACH_FILTER, _SO_RCVBUFFORCE, _ETH_P_ALL = 26, 33, 3
_WATCH_BUFFER = 4 << 20

#: The watch: packets arriving on the loopback (not their copies on the way out) that are a
#: TCP reset answering a connection attempt (RST and ACK, sequence 0), or an ICMP or
#: ICMPv6 "port unreachable". A label names the next instruction; "" jumps to the next.
_WATCH: list[str | tuple[int, int, str, str]] = [
    (_LD_W, _PKTTYPE, "", ""),
    (_JEQ, socket.PACKET_HOST, "", "drop"),
    (_LD_B, 0, "", ""),
    (_AND, 0xF0, "", ""),
    (_JEQ, 0x40, "v4", ""),
    (_JEQ, 0x60, "v6", "drop"),
    "v4",
    (_LD_H, 6, "", ""),
    (_JSET, 0x1FFF, "drop", ""),  # a fragment but the first
    (_LDX_IHL, 0, "", ""),
    (_LD_B, 9, "", ""),
    (_JEQ, 6, "", "v4icmp"),
    (_LD_B_X, 13, "", ""),
    (_AND, _RST_ACK, "", ""),
    (_JEQ, _RST_ACK, "", "drop"),
    (_LD_W_X, 4, "", ""),
    (_JEQ, 0, "keep", "drop"),
    "v4icmp",
    (_JEQ, 1, "", "drop"),
    (_LD_H_X, 0, "", ""),
    (_JEQ, 0x0303, "keep", "drop"),
    "v6",
    (_LD_B, 6, "", ""),
    (_JEQ, 6, "", "v6icmp"),
    (_LD_B, 40 + 13, "", ""),
    (_AND, _RST_ACK, "", ""),
    (_JEQ, _RST_ACK, "", "drop"),
    (_LD_W, 40 + 4, "", ""),
    (_JEQ, 0, "keep", "drop"),
    "v6icmp",
    (_JEQ, 58, "", "drop"),
    (_LD_H, 40, "", ""),
    (_JEQ, 0x0104, "keep", "drop"),
    "keep",
    (_RET, _SNAP, "", ""),
    "drop",
    (_RET, 0, "", ""),
]


def _assemble(program: list[str | tuple[int, int, str, str]]) -> bytes:
    labels: dict[str, int] = {}
    steps: list[tuple[int, int, str, str]] = []
    for item in program:
        if isinstance(item, str):
            labels[item] = len(steps)
        else:
            steps.append(item)
    code = b""
    for index, (op, k, true, false) in enumerate(steps):
        jt = labels[true] - index - 1 if true else 0
        jf = labels[false] - index - 1 if false else 0
        code += struct.pack("=HBBI", op, jt, jf, k)
    return code


def _sniffer() -> socket.socket:
    """A packet socket on the loopback, with :data:`_WATCH` as its filter."""
    code = ctypes.create_string_buffer(_assemble(_WATCH))
    program = struct.pack("@HP", len(code.raw) // 8, ctypes.addressof(code))
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, 0)  # sees nothing until bound
    try:
        try:  # room for a burst of attempts: what does not fit is not seen
            sock.setsockopt(socket.SOL_SOCKET, _SO_RCVBUFFORCE, _WATCH_BUFFER)
        except OSError:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _WATCH_BUFFER)
        sock.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, program)
        sock.bind(("lo", _ETH_P_ALL))
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


_CAPABILITY_VERSION_3, _PR_SET_NO_NEW_PRIVS = 0x20080522, 38


def _drop_privileges() -> None:
    """Every capability gone, none to be had again: root in name only."""
    libc = ctypes.CDLL(None, use_errno=True)
    header = ctypes.create_string_buffer(struct.pack("=Ii", _CAPABILITY_VERSION_3, 0))
    empty = ctypes.create_string_buffer(24)  # effective, permitted, inheritable: twice
    if libc.capset(header, empty) != 0 or libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def main(fd: int, plan: str) -> None:
    host = socket.socket(fileno=fd)
    try:
        guard = Guard(host, json.loads(plan))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        os.write(2, f"cmbs netguard: {reason}\n".encode())
        sys.exit(1)
    os.write(1, b"ready\n")
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)
    guard.serve()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
