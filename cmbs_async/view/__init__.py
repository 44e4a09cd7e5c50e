"""``cmbs view``: audit databases and batch results in the browser, read-only (see
:mod:`cmbs_async.view.app`). Needs the ``view`` extra (Starlette, uvicorn, Jinja2)."""

from .app import build_app, export_site
from .data import Library

__all__ = ["Library", "build_app", "export_site"]
