"""``cmbs view``: the runs of audit databases and batch results in the browser, read-only.

A Starlette application rendering Jinja templates on the server (no front-end build); the
only JavaScript reloads a page when its database changed, so a batch shows as it runs.
Every text an agent or a command produced goes through the templates' autoescaping: it is
shown, never interpreted. Bound to 127.0.0.1 by default; anywhere else a token is needed.
"""

from __future__ import annotations

import hmac
import re
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

import anyio

from ..profile import ProfileError, builtin_profiles, load_profile
from .data import Library, RunRow, RunView

if TYPE_CHECKING:  # the view extra's packages: imported where they are used
    from jinja2 import Environment
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, Response

__all__ = ["build_app", "export_site", "templates"]

PAGE_SIZE = 200
_COLUMNS = ("started", "scenario", "outcome", "posture", "expected", "steps", "duration_s")


def templates() -> Environment:
    """The viewer's templates, autoescaped."""
    from jinja2 import Environment, PackageLoader, select_autoescape

    env = Environment(
        loader=PackageLoader("cmbs_async.view", "templates"),
        autoescape=select_autoescape(default=True, default_for_string=True),
    )
    env.filters["when"] = _when
    env.filters["pretty"] = _pretty
    env.filters["file_name"] = file_name
    return env


def file_name(session_id: str) -> str:
    """A run's page in an exported bundle."""
    return _UNSAFE.sub("_", session_id) + ".html"


def _when(stamp: float | None) -> str:
    if stamp is None:
        return "-"
    return datetime.fromtimestamp(stamp, UTC).strftime("%Y-%m-%d %H:%M:%S")


def _pretty(value: Any) -> str:
    import json

    return json.dumps(value, indent=2, ensure_ascii=False, default=str)


def filtered(runs: list[RunRow], query: dict[str, str]) -> list[RunRow]:
    """The runs a list page's filters (``q``, ``outcome``, ``posture``, ``expected``,
    ``scenario``) keep, sorted by ``sort`` (``-`` first for descending)."""
    text = query.get("q", "").lower()
    kept = [
        row
        for row in runs
        if (not text or text in f"{row.scenario} {row.session_id} {row.reason or ''}".lower())
        and all(
            not query.get(name) or str(getattr(row, name)) == query[name]
            for name in ("outcome", "posture", "expected", "scenario")
        )
    ]
    sort = query.get("sort", "-started")
    column = sort.lstrip("-")
    if column in _COLUMNS:
        kept.sort(
            key=lambda row: (getattr(row, column) is None, getattr(row, column) or 0),
            reverse=sort.startswith("-"),
        )
    return kept


def build_app(library: Library, *, token: str | None = None) -> Starlette:
    """The viewer over ``library``; with ``token``, every request must carry it (``?token=``
    once, then its cookie)."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.middleware.base import BaseHTTPMiddleware
    from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse
    from starlette.routing import Route

    env = templates()

    def page(name: str, request: Request, **context: Any) -> HTMLResponse:
        stamp = library.state()
        html = env.get_template(name).render(
            static=False, stamp=stamp, query=dict(request.query_params), **context
        )
        return HTMLResponse(html)

    async def runs(request: Request) -> Response:
        query = dict(request.query_params)
        rows = await anyio.to_thread.run_sync(library.runs)
        started = time.perf_counter()
        kept = filtered(rows, query)
        wanted = query.get("page", "1")
        number = max(int(wanted), 1) if wanted.isdigit() else 1
        shown = kept[(number - 1) * PAGE_SIZE : number * PAGE_SIZE]
        outcomes = sorted({row.outcome or "-" for row in rows})
        response = page(
            "runs.html",
            request,
            rows=shown,
            total=len(rows),
            matched=len(kept),
            page=number,
            pages=max((len(kept) + PAGE_SIZE - 1) // PAGE_SIZE, 1),
            outcomes=outcomes,
            link=lambda **changes: "?" + urlencode({**query, **changes}),
        )
        response.headers["Server-Timing"] = (
            f"filter;dur={(time.perf_counter() - started) * 1000:.1f}"
        )
        return response

    async def run(request: Request) -> Response:
        session_id = request.path_params["session_id"]
        profile = None
        wanted = request.query_params.get("profile")
        if wanted:  # a built-in profile only: nothing of the viewer's disk is read for it
            if wanted not in builtin_profiles():
                return PlainTextResponse(f"no built-in profile {wanted!r}", status_code=404)
            try:
                profile = load_profile(wanted)
            except ProfileError as exc:
                return PlainTextResponse(str(exc), status_code=404)
        view = await anyio.to_thread.run_sync(lambda: library.run(session_id, profile=profile))
        if view is None:
            return PlainTextResponse(f"no run {session_id}", status_code=404)
        recorded = None
        if profile is not None:
            recorded = await anyio.to_thread.run_sync(lambda: library.run(session_id))
        return page("run.html", request, run=view, recorded=recorded, profiles=builtin_profiles())

    async def diff(request: Request) -> Response:
        ids = [request.query_params.get("a", ""), request.query_params.get("b", "")]
        views = [await anyio.to_thread.run_sync(library.run, i) for i in ids]
        if any(view is None for view in views):
            return PlainTextResponse("give two runs: ?a=SESSION&b=SESSION", status_code=404)
        left, right = views[0], views[1]
        assert left is not None and right is not None
        return page("diff.html", request, left=left, right=right, aligned=_aligned(left, right))

    async def batches(request: Request) -> Response:
        found = await anyio.to_thread.run_sync(library.batches)
        return page("batches.html", request, batches=found)

    async def stamp(request: Request) -> Response:
        return JSONResponse({"stamp": library.state()})

    guard = [Middleware(BaseHTTPMiddleware, dispatch=_token_check(token))] if token else []
    return Starlette(
        routes=[
            Route("/", runs),
            Route("/run/{session_id}", run),
            Route("/diff", diff),
            Route("/batches", batches),
            Route("/stamp", stamp),
        ],
        middleware=guard,
    )


def _token_check(
    token: str,
) -> Callable[[Request, Callable[[Request], Awaitable[Response]]], Awaitable[Response]]:
    from starlette.responses import PlainTextResponse

    async def check(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        given = request.query_params.get("token") or request.cookies.get("cmbs_view_token", "")
        if not hmac.compare_digest(given.encode(), token.encode()):
            return PlainTextResponse("a token is needed: open the address cmbs view printed", 401)
        response = await call_next(request)
        if request.query_params.get("token"):
            response.set_cookie("cmbs_view_token", token, httponly=True, samesite="strict")
        return response

    return check


def _aligned(left: RunView, right: RunView) -> list[tuple[Any, Any, bool]]:
    """The two runs' steps side by side by number; whether their verdicts differ."""
    a = {step.step: step for step in left.steps}
    b = {step.step: step for step in right.steps}
    return [
        (
            a.get(number),
            b.get(number),
            (a[number].verdict if number in a else None)
            != (b[number].verdict if number in b else None),
        )
        for number in sorted(a.keys() | b.keys())
    ]


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def export_site(library: Library, folder: Path) -> int:
    """Write the same pages as static files into ``folder`` (``index.html``, a page per
    run under ``run/``, ``batches.html``); the number of pages written."""
    env = templates()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "run").mkdir(exist_ok=True)
    rows = library.runs()
    common: dict[str, Any] = {"static": True, "stamp": "", "query": {}}
    index = env.get_template("runs.html").render(
        rows=rows,
        total=len(rows),
        matched=len(rows),
        page=1,
        pages=1,
        outcomes=sorted({row.outcome or "-" for row in rows}),
        link=lambda **changes: "#",
        **common,
    )
    (folder / "index.html").write_text(index)
    written = 1
    for row in rows:
        view = library.run(row.session_id)
        if view is None:
            continue
        html = env.get_template("run.html").render(run=view, recorded=None, profiles=[], **common)
        (folder / "run" / file_name(row.session_id)).write_text(html)
        written += 1
    batches = env.get_template("batches.html").render(batches=library.batches(), **common)
    (folder / "batches.html").write_text(batches)
    return written + 1
