"""Where an IT-Bench scenario's commands must reach, read from its data: the hosts of its
Ansible inventory and the servers of its kubeconfig. ``cmbs itbench run`` makes these the
scenario's network allow-list, so an agent reaches its targets and nothing else."""

from __future__ import annotations

import re
import shlex
from urllib.parse import urlsplit

from ._reading import ReadError, loads_yaml

__all__ = ["destinations_from_inventory", "destinations_from_kubeconfig"]


def destinations_from_inventory(text: str) -> tuple[str, ...]:
    """``HOST:PORT`` for each host of an Ansible INI inventory that is reached over the
    network: its ``ansible_host`` (else its name) and ``ansible_port`` (else its groups',
    else ``all``'s, else 22). ``ValueError`` (one line) for a host or port that cannot be
    read, or no host at all."""
    hosts: dict[str, dict[str, str]] = {}  # name: its own variables
    groups: dict[str, list[str]] = {}  # group: its hosts
    children: dict[str, list[str]] = {}  # group: its child groups
    group_vars: dict[str, dict[str, str]] = {}
    section, kind = "ungrouped", "hosts"
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section, _, kind = line[1:-1].strip().partition(":")
            kind = kind or "hosts"
            continue
        if kind == "vars":
            key, _, value = line.partition("=")
            group_vars.setdefault(section, {})[key.strip()] = _unquoted(value.strip())
        elif kind == "children":
            children.setdefault(section, []).append(line.split()[0])
        elif kind == "hosts":
            try:
                words = shlex.split(line, comments=True)
            except ValueError as exc:
                raise ValueError(f"inventory line {number}: {exc}") from None
            if not words:
                continue
            pattern, variables = words[0], dict(word.partition("=")[::2] for word in words[1:])
            head, colon, port = pattern.rpartition(":")
            if colon and port.isdigit() and ":" not in _RANGE.sub("", head):  # HOST:PORT
                pattern = head
                variables.setdefault("ansible_port", port)
            for name in _expand(pattern):
                hosts.setdefault(name, {}).update(variables)
                groups.setdefault(section, []).append(name)
    found = []
    for name, own in hosts.items():
        merged = dict(group_vars.get("all", {}))
        for group in _groups_of(name, groups, children):
            merged.update(group_vars.get(group, {}))
        merged.update(own)
        if merged.get("ansible_connection") == "local":
            continue
        address = merged.get("ansible_host") or merged.get("ansible_ssh_host") or name
        port = merged.get("ansible_port") or merged.get("ansible_ssh_port") or "22"
        if "{{" in address + port or not port.isdigit():
            raise ValueError(f"inventory host {name}: cannot tell where it is ({address}:{port})")
        found.append(f"{_bracketed(address)}:{int(port)}")
    if not found:
        raise ValueError("the inventory names no host to reach")
    return tuple(dict.fromkeys(found))


def destinations_from_kubeconfig(text: str) -> tuple[str, ...]:
    """``HOST:PORT`` of each cluster's ``server`` in a kubeconfig (443 for https, 80 for
    http, where none is given), and of its ``proxy-url`` if any. ``ValueError`` (one line)
    for a server that cannot be read, or none."""
    try:  # nesting and aliases capped: the scenario data is the operator's, or an agent's
        config = loads_yaml(text, origin="kubeconfig")
    except ReadError as exc:
        raise ValueError(str(exc).replace("not valid YAML", "not YAML")) from None
    clusters = config.get("clusters") if isinstance(config, dict) else None
    found = []
    for item in clusters if isinstance(clusters, list) else []:
        cluster = item.get("cluster") if isinstance(item, dict) else None
        if not isinstance(cluster, dict):
            continue
        for key in ("server", "proxy-url"):
            if cluster.get(key) is not None:
                found.append(_url_destination(str(cluster[key]), key))
    if not found:
        raise ValueError("kubeconfig: no cluster names a server")
    return tuple(dict.fromkeys(found))


def _url_destination(url: str, key: str) -> str:
    try:
        parts = urlsplit(url)
        port = parts.port or {"https": 443, "http": 80, "socks5": 1080}.get(parts.scheme.lower())
    except ValueError:
        port = None
        parts = urlsplit("")
    if not parts.hostname or port is None:
        raise ValueError(f"kubeconfig: {key} {url!r} is not a URL with a host")
    return f"{_bracketed(parts.hostname)}:{port}"


def _groups_of(
    name: str, groups: dict[str, list[str]], children: dict[str, list[str]]
) -> list[str]:
    """The groups ``name`` is in, parents before children (their variables win)."""
    direct = [group for group, members in groups.items() if name in members]
    parents = {child: parent for parent, kids in children.items() for child in kids}
    ordered: list[str] = []
    for group in direct:
        chain = [group]
        while chain[-1] in parents and parents[chain[-1]] not in chain:
            chain.append(parents[chain[-1]])
        ordered += [g for g in reversed(chain) if g not in ordered]
    return ordered


_RANGE = re.compile(r"\[([0-9a-zA-Z]+):([0-9a-zA-Z]+)(?::([0-9]+))?\]")


def _expand(pattern: str) -> list[str]:
    """An inventory host pattern's names: ``web[01:03]`` is web01, web02, web03."""
    found = _RANGE.search(pattern)
    if found is None:
        return [pattern]
    start, end, step = found.group(1), found.group(2), int(found.group(3) or 1)
    if start.isdigit() and end.isdigit():
        width = len(start) if start.startswith("0") else 0
        values = [str(n).zfill(width) for n in range(int(start), int(end) + 1, step)]
    elif len(start) == len(end) == 1:
        values = [chr(c) for c in range(ord(start), ord(end) + 1, step)]
    else:
        raise ValueError(f"inventory host pattern {pattern}: not a range Ansible knows")
    head, tail = pattern[: found.start()], pattern[found.end() :]
    return [name for value in values for name in _expand(head + value + tail)]


# -- small things -----------------------------------------------------------------------------


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _unquoted(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        return value[1:-1]
    return value
