"""``cmbs view DB... [--results FILE...]``: the viewer, served or exported."""

from __future__ import annotations

import argparse
import importlib.util
import ipaddress
import secrets
from pathlib import Path
from typing import Any

from .._errors import CmbsError
from ..audit import default_data_dir
from ..profile import Profile, builtin_profiles, load_profile
from ..view import Library, build_app, export_site
from .audit import default_trusted_key, public_key_option

__all__ = ["add_view_command", "run_view_command"]


class ViewError(CmbsError):
    """What keeps the viewer from starting; one line."""


def add_view_command(sub: Any) -> None:
    view = sub.add_parser(
        "view",
        help="audit databases and batch results in the browser (read-only)",
        description="Serve a read-only viewer on 127.0.0.1 (anything else needs a token), "
        "or write it as static pages with --export DIR.",
    )
    view.add_argument(
        "db",
        nargs="*",
        help="audit databases (SQLite; default: the one runs record into, "
        f"{default_data_dir() / 'audit.db'})",
    )
    view.add_argument("--results", action="append", default=[], metavar="FILE",
                      help="a batch results file (JSON lines), repeatable")  # fmt: skip
    view.add_argument("--host", default="127.0.0.1", help="address to listen on")
    view.add_argument("--port", type=int, default=8321, help="port (default 8321; 0: any)")
    view.add_argument("--token", help="what a browser must give (made up when the host is "
                      "not a loopback address and none is given)")  # fmt: skip
    view.add_argument("--public-key", metavar="FILE|KEY",
                      help="the operator's key every record and results line must be signed by "
                      "(default: the public half of the default signing key, if any)")  # fmt: skip
    view.add_argument("--profile", action="append", default=[], metavar="FILE",
                      help="a profile a run can be judged again under, beside the built-in "
                      "ones (repeatable)")  # fmt: skip
    view.add_argument("--export", metavar="DIR", help="write static pages into DIR and exit")


def run_view_command(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("starlette") is None or importlib.util.find_spec("jinja2") is None:
        raise ViewError("the viewer needs its extra: pip install 'cmbs-async[view]'")
    databases = [Path(db) for db in args.db]
    results = [Path(found) for found in args.results]
    if not databases:  # the database runs record into, if there is one
        default = default_data_dir() / "audit.db"
        if default.is_file():
            databases = [default]
        elif not results:
            raise ViewError(f"no runs recorded yet in {default}: give an audit database")
    for path in databases + results:
        if not path.is_file():
            raise ViewError(f"{path}: no such file")
    key = _trusted(args)
    profiles: dict[str, Profile | None] = dict.fromkeys(builtin_profiles())
    profiles |= {name: load_profile(Path(name)) for name in args.profile}
    library = Library(databases, results, trusted_key=key)
    library.runs()  # a file that is not an audit database is said now, in one line
    if args.export:
        pages = export_site(library, Path(args.export))
        print(f"cmbs view: {pages} pages written to {args.export}")
        return 0
    token = args.token
    if token is None and not _loopback(args.host):
        token = secrets.token_urlsafe(16)
    import uvicorn

    config = uvicorn.Config(
        build_app(library, token=token, profiles=profiles),
        host=args.host,
        port=args.port,
        log_level="warning",
    )
    server = uvicorn.Server(config)
    shown = f"http://{args.host}:{args.port}/" + (f"?token={token}" if token else "")
    print(f"cmbs view: {shown} (Ctrl-C to stop)", flush=True)
    server.run()
    return 0


def _trusted(args: argparse.Namespace) -> str | None:
    if args.public_key:
        return public_key_option(args.public_key)[0]
    try:
        return default_trusted_key()[0]
    except CmbsError:
        return None  # shown as "not checked against a key" on every run


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
