"""The seccomp filter of every sandbox: the system calls no command or agent program needs
and that would open a way around it.

Always refused: ``io_uring`` (its operations bypass every other rule here: it makes
sockets without ``socket(2)``); the kernel keyrings (``add_key``, ``request_key``,
``keyctl``: state shared by a user across sandboxes and runs); new user namespaces
(``unshare`` or ``clone`` with ``CLONE_NEWUSER``, and ``clone3``, whose flags a filter
cannot read, so the C library falls back to ``clone``), which would hand a command every
capability over namespaces of its own and a large kernel surface. Without network, also
``socket(AF_UNIX, ...)``, so that no host service listening on a socket file is reached,
wherever that file lies (``socketpair`` stays allowed: pipes between processes).
"""

from __future__ import annotations

import errno
import platform
import struct
from dataclasses import dataclass, field

__all__ = ["sandbox_filter"]

# classic BPF
_LD_W_ABS, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
_RET_ALLOW, _RET_ERRNO = 0x7FFF0000, 0x00050000
_X32 = 0x40000000  # x32 system calls: same arch, numbers from here
_AF_UNIX, _CLONE_NEWUSER = 1, 0x10000000
# struct seccomp_data: nr at 0, arch at 4, args[0] at 16 (its low half, little endian)
_NR, _ARCH, _ARG0 = 0, 4, 16


@dataclass(frozen=True)
class _Machine:
    arch: int
    socket: int
    unshare: int
    clone: int
    clone3: int = 435
    io_uring: tuple[int, ...] = (425, 426, 427)
    keys: tuple[int, ...] = field(default=())


#: System call numbers by machine (x86_64; aarch64 and the other asm-generic ones).
_MACHINES = {
    "x86_64": _Machine(0xC000003E, socket=41, unshare=272, clone=56, keys=(248, 249, 250)),
    "aarch64": _Machine(0xC00000B7, socket=198, unshare=97, clone=220, keys=(217, 218, 219)),
}


class _Program:
    """A filter assembled with labels, so no jump is counted by hand."""

    def __init__(self) -> None:
        self.code: list[tuple[int, int, int, int | str]] = []  # op, true, false, k or label
        self.labels: dict[str, int] = {}

    def load(self, offset: int) -> None:
        self.code.append((_LD_W_ABS, 0, 0, offset))

    def jump(self, op: int, value: int, to: str) -> None:
        """To ``to`` when the test holds, else on."""
        self.code.append((op, 0, 0, f"{to}|{value}"))

    def ret(self, value: int) -> None:
        self.code.append((_RET_K, 0, 0, value))

    def label(self, name: str) -> None:
        self.labels[name] = len(self.code)

    def assemble(self) -> bytes:
        out = []
        for index, (op, _, _, k) in enumerate(self.code):
            if isinstance(k, str):
                target, value = k.split("|")
                out.append(struct.pack("=HBBI", op, self.labels[target] - index - 1, 0, int(value)))
            else:
                out.append(struct.pack("=HBBI", op, 0, 0, k))
        return b"".join(out)


def sandbox_filter(*, unix_sockets: bool) -> bytes:
    """The filter program (see the module docstring); ``unix_sockets=False`` refuses
    ``socket(AF_UNIX, ...)`` too. ``ValueError`` on a machine it has no numbers for."""
    try:
        m = _MACHINES[platform.machine()]
    except KeyError:
        raise ValueError(f"no seccomp filter for {platform.machine()} machines") from None
    eperm, enosys = _RET_ERRNO | errno.EPERM, _RET_ERRNO | errno.ENOSYS
    p = _Program()
    p.load(_ARCH)
    p.jump(_JEQ_K, m.arch, "native")
    p.ret(eperm)  # a foreign architecture's calls (32-bit code): other numbers, refused
    p.label("native")
    p.load(_NR)
    p.jump(_JGE_K, _X32, "eperm")
    for number in m.io_uring:
        p.jump(_JEQ_K, number, "enosys")
    for number in m.keys:
        p.jump(_JEQ_K, number, "eperm")
    p.jump(_JEQ_K, m.clone3, "enosys")
    p.jump(_JEQ_K, m.unshare, "flags")
    p.jump(_JEQ_K, m.clone, "flags")
    if not unix_sockets:
        p.jump(_JEQ_K, m.socket, "family")
    p.ret(_RET_ALLOW)
    p.label("flags")  # unshare(flags) and clone(flags, ...): the flags come first
    p.load(_ARG0)
    p.jump(_JSET_K, _CLONE_NEWUSER, "eperm")
    p.ret(_RET_ALLOW)
    p.label("family")
    p.load(_ARG0)
    p.jump(_JEQ_K, _AF_UNIX, "eacces")
    p.ret(_RET_ALLOW)
    p.label("eacces")
    p.ret(_RET_ERRNO | errno.EACCES)
    p.label("eperm")
    p.ret(eperm)
    p.label("enosys")
    p.ret(enosys)
    return p.assemble()
