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
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

import anyio

from ..profile import Profile, ProfileError, builtin_profiles, load_profile
from .data import Library, RunRow, RunView

if TYPE_CHECKING:  # the view extra's packages: imported where they are used
    from jinja2 import Environment
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, Response

__all__ = ["build_app", "export_site", "templates"]

PAGE_SIZE = 200
#: the list's columns, in order: what a row holds and the heading over it (each sortable)
COLUMNS = (
    ("started", "Started"),
    ("scenario", "Scenario"),
    ("agent", "Agent"),
    ("outcome", "Outcome"),
    ("posture", "Posture"),
    ("expected", "Expected"),
    ("itbench_pass", "IT-Bench"),
    ("steps", "Steps"),
    ("duration_s", "Duration s"),
    ("batch", "Batch"),
)
#: what a filter's value ``-`` stands for: the run has none
NONE = "-"
#: the filters that keep the rows whose column equals the value given
_EXACT = ("outcome", "posture", "agent", "batch")
#: every filter the list takes
_FILTERS = ("q", "scenario", *_EXACT, "expected", "pass", "line")


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
    """The runs a list page's filters keep, sorted by ``sort`` (a column's name, ``-``
    before it for descending; the runs without a value last either way).

    ``q`` searches scenario, session, agent, batch and reason; ``scenario`` is a part of
    the scenario's id; ``outcome``, ``posture``, ``agent`` and ``batch`` are a value (``-``:
    none); ``expected`` a posture, ``-``, ``right`` or ``wrong``; ``pass`` is ``pass``,
    ``fail`` or ``-`` (not scored); ``line`` (the run's results line) is ``verified``,
    ``unverified`` (or not checked) or ``-`` (none). Every filter given must hold.
    """
    tests: list[Any] = []
    text = query.get("q", "").strip().lower()
    if text:
        tests.append(lambda row: text in row.text)
    scenario = query.get("scenario", "").strip().lower()
    if scenario:
        tests.append(lambda row: scenario in row.scenario.lower())
    for name in _EXACT:
        if query.get(name):
            tests.append(_equals(name, query[name]))
    expected = query.get("expected")
    if expected in ("right", "wrong"):
        tests.append(lambda row: row.correct is (expected == "right"))
    elif expected:
        tests.append(_equals("expected", expected))
    scored = query.get("pass")
    if scored:
        wanted = {"pass": True, "fail": False}.get(scored)
        tests.append(lambda row: row.itbench_pass is wanted)
    line = query.get("line")
    if line in ("verified", "unverified"):
        tests.append(
            lambda row: row.line is not None and (row.line == "verified") is (line == "verified")
        )
    elif line == NONE:
        tests.append(lambda row: row.line is None)
    kept = [row for row in runs if all(test(row) for test in tests)] if tests else list(runs)
    sort = query.get("sort", "-started")
    column = sort.lstrip("-")
    if column in dict(COLUMNS) and sort != "-started":  # the list comes newest first
        having = [row for row in kept if getattr(row, column) is not None]
        having.sort(key=lambda row: getattr(row, column), reverse=sort.startswith("-"))
        kept = having + [row for row in kept if getattr(row, column) is None]
    return kept


def _equals(name: str, value: str) -> Any:
    wanted = None if value == NONE else value
    return lambda row: getattr(row, name) == wanted


def build_app(
    library: Library,
    *,
    token: str | None = None,
    profiles: Mapping[str, Profile | None] | None = None,
) -> Starlette:
    """The viewer over ``library``; with ``token``, every request must carry it (``?token=``
    once, then its cookie). A run can be judged again under one of ``profiles`` (by the
    name offered, ``None`` for a built-in one loaded when asked for; by default the built-in
    profiles), never under a file a request names."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.middleware.base import BaseHTTPMiddleware
    from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse
    from starlette.routing import Route

    env = templates()
    offered: Mapping[str, Profile | None] = (
        dict(profiles) if profiles is not None else dict.fromkeys(builtin_profiles())
    )

    def page(name: str, request: Request, **context: Any) -> HTMLResponse:
        stamp = library.state()
        html = env.get_template(name).render(
            static=False, stamp=stamp, query=dict(request.query_params), **context
        )
        return HTMLResponse(html)

    async def runs(request: Request) -> Response:
        query = dict(request.query_params)
        rows, choices = await anyio.to_thread.run_sync(lambda: (library.runs(), library.choices()))
        started = time.perf_counter()
        kept = filtered(rows, query)
        wanted = query.get("page", "1")
        pages = max((len(kept) + PAGE_SIZE - 1) // PAGE_SIZE, 1)
        number = min(max(int(wanted), 1), pages) if wanted.isdigit() else 1
        shown = kept[(number - 1) * PAGE_SIZE : number * PAGE_SIZE]
        response = page(
            "runs.html",
            request,
            rows=shown,
            total=len(rows),
            matched=len(kept),
            page=number,
            pages=pages,
            choices=choices,
            columns=COLUMNS,
            filtering=any(query.get(name) for name in _FILTERS),
            link=lambda **changes: "?" + urlencode({**query, "page": 1, **changes}),
        )
        response.headers["Server-Timing"] = (
            f"filter;dur={(time.perf_counter() - started) * 1000:.1f}"
        )
        return response

    async def run(request: Request) -> Response:
        session_id = request.path_params["session_id"]
        profile = None
        wanted = request.query_params.get("profile")
        if wanted:  # one offered: nothing a request names is read from the viewer's disk
            if wanted not in offered:
                return PlainTextResponse(f"no profile {wanted!r} offered", status_code=404)
            profile = offered[wanted]
            if profile is None:
                try:
                    profile = load_profile(wanted)
                except ProfileError as exc:
                    return PlainTextResponse(str(exc), status_code=404)
        view = await anyio.to_thread.run_sync(lambda: library.run(session_id, profile=profile))
        if view is None:
            return PlainTextResponse(f"no run {session_id}", status_code=404)
        return page(
            "run.html", request, run=view, rejudged=profile is not None, profiles=list(offered)
        )

    async def diff(request: Request) -> Response:
        ids = [request.query_params.get("a", ""), request.query_params.get("b", "")]
        picked = request.query_params.getlist("pick")
        if not all(ids):
            if len(picked) != 2:
                return PlainTextResponse(
                    f"tick two runs to compare ({len(picked)} ticked)", status_code=400
                )
            ids = picked
        views = [await anyio.to_thread.run_sync(library.run, i) for i in ids]
        if any(view is None for view in views):
            return PlainTextResponse("give two recorded runs: ?a=SESSION&b=SESSION", 404)
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
        choices=library.choices(),
        columns=COLUMNS,
        filtering=False,
        link=lambda **changes: "#",
        **common,
    )
    (folder / "index.html").write_text(index)
    written = 1
    for row in rows:
        view = library.run(row.session_id)
        if view is None:
            continue
        html = env.get_template("run.html").render(run=view, rejudged=False, profiles=[], **common)
        (folder / "run" / file_name(row.session_id)).write_text(html)
        written += 1
    batches = env.get_template("batches.html").render(batches=library.batches(), **common)
    (folder / "batches.html").write_text(batches)
    return written + 1
