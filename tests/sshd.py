"""A real OpenSSH sshd on 127.0.0.1, for the SSH tests and the SSH benchmark.

Each instance has its own host key, client key, authorized_keys and config in a
temporary folder, listens on a free port, and is stopped (only it) when done.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


def sshd_available() -> bool:
    return os.path.exists(SSHD) and shutil.which("ssh-keygen") is not None


class ThrowawayUser:
    """A system user (``/bin/sh`` its shell unless ``shell`` says), removed again on exit
    (needs root).

    For measurements: a login shell that sources a heavy rc file (root's here runs
    ``pyenv init``) costs every command the same and would hide what is measured.
    ``sudo`` lines go to ``/etc/sudoers.d`` for as long as the user exists. ``root``: a
    second uid 0 with a home of its own, where attacks on start-up files may do harm.
    """

    def __init__(
        self,
        name: str = "cmbsbench",
        *,
        sudo: tuple[str, ...] = (),
        root: bool = False,
        shell: str = "/bin/sh",
    ) -> None:
        self.name = name
        self.sudoers = Path("/etc/sudoers.d") / name
        self.sudo = sudo
        #: a second uid 0 with a home of its own: root's powers, but its start-up files
        #: (``~/.ssh/rc``, ``~/.bashrc``) are not the real root's, so attacks may wreck them
        self.root = root
        self.shell = shell

    @property
    def home(self) -> Path:
        return Path("/home") / self.name

    def __enter__(self) -> str:
        subprocess.run(["userdel", "-r", "-f", self.name], capture_output=True)
        add = ["useradd", "-m", "-d", str(self.home), "-s", self.shell]
        if self.root:
            add += ["-o", "-u", "0", "-g", "0"]
        subprocess.run([*add, self.name], check=True)
        # A user with no password is "locked" to sshd without PAM; '*' is no password
        # and not locked.
        subprocess.run(["usermod", "-p", "*", self.name], check=True)
        if self.sudo:
            self.sudoers.write_text("".join(f"{self.name} {rule}\n" for rule in self.sudo))
            self.sudoers.chmod(0o440)
        return self.name

    def __exit__(self, *exc_info: object) -> None:
        self.sudoers.unlink(missing_ok=True)
        # -f: a uid 0 account is "in use" by every root process
        subprocess.run(["userdel", "-r", "-f", self.name], capture_output=True)


#: The sudo IT-Bench gives its RHEL9 check user (``tasks/user_create.yml``).
ITBENCH_SUDO = ("ALL=(ALL) NOPASSWD: /usr/bin/ansible-playbook", "ALL=(ALL) NOPASSWD: /bin/sh")
ITBENCH_USER = "cmbsitb"


def itbench_target_missing() -> str | None:
    """What this machine lacks to play IT-Bench's RHEL9 target, if anything."""
    bindir = Path(sys.executable).parent
    if os.geteuid() != 0 or not sshd_available():
        return "root and sshd"
    for program in ("sudo", "unshare"):
        if shutil.which(program) is None:
            return program
    if not (bindir / "ansible-playbook").exists():
        return "ansible-core (the ciso extra)"
    return None


@contextmanager
def itbench_target(x11: str) -> Iterator[LocalSshd]:
    """A local sshd as IT-Bench's RHEL9 target: ``X11Forwarding x11`` in the sshd_config it
    runs with, which its sessions read at /etc/ssh/sshd_config; its check user may only
    sudo ansible-playbook and /bin/sh."""
    with ThrowawayUser(ITBENCH_USER, sudo=ITBENCH_SUDO) as user:
        with LocalSshd(
            extra_config=f"X11Forwarding {x11}\n", user=user, as_system_config=True
        ) as server:
            yield server


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LocalSshd:
    """Start with ``start()``, stop with ``stop()`` (or use it as a context manager)."""

    def __init__(
        self, *, extra_config: str = "", user: str | None = None, as_system_config: bool = False
    ) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="cmbs-sshd-"))
        self.port = free_port()
        self.user = user or os.environ.get("USER") or __import__("getpass").getuser()
        self.extra_config = extra_config
        #: run in a mount namespace of its own where its config is /etc/ssh/sshd_config, so
        #: that its sessions read there what it really runs with (IT-Bench's fault)
        self.as_system_config = as_system_config
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def client_key(self) -> str:
        return str(self.dir / "client_key")

    @property
    def known_hosts(self) -> str:
        return str(self.dir / "known_hosts")

    @property
    def host_public_key(self) -> str:
        return (self.dir / "host_key.pub").read_text().strip()

    @property
    def url(self) -> str:
        return f"ssh://{self.user}@127.0.0.1:{self.port}"

    def start(self) -> LocalSshd:
        d = self.dir
        for name in ("host_key", "client_key", "other_key"):
            subprocess.run(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)], check=True
            )
        shutil.copy(d / "client_key.pub", d / "authorized_keys")
        # sshd reads authorized_keys as the user logging in
        os.chmod(d, 0o755)
        os.chmod(d / "authorized_keys", 0o644)
        (d / "known_hosts").write_text(f"[127.0.0.1]:{self.port} {self.host_public_key}\n")
        other = (d / "other_key.pub").read_text().strip()
        (d / "wrong_known_hosts").write_text(f"[127.0.0.1]:{self.port} {other}\n")
        (d / "sshd_config").write_text(
            f"Port {self.port}\nListenAddress 127.0.0.1\nHostKey {d / 'host_key'}\n"
            f"AuthorizedKeysFile {d / 'authorized_keys'}\nPidFile {d / 'sshd.pid'}\n"
            "StrictModes no\nUsePAM no\nPasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\n"
            "Subsystem sftp internal-sftp\n"
            f"{self.extra_config}"
        )
        os.makedirs("/run/sshd", exist_ok=True)  # the privilege separation directory
        command = [SSHD, "-D", "-e", "-f", str(d / "sshd_config")]
        if self.as_system_config:
            os.chmod(d / "sshd_config", 0o644)
            command = [
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                'mount --bind "$0" /etc/ssh/sshd_config && exec "$@"',
                str(d / "sshd_config"),
                *command,
            ]
        with open(d / "sshd.log", "wb") as log:
            self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"sshd exited: {(d / 'sshd.log').read_text()[-500:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("sshd did not start listening within 10 s")

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.process = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> LocalSshd:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
