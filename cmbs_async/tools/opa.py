"""``cmbs-opa eval``: the subset of ``opa eval`` the CISO scenarios use, on a real Rego
engine (the PyPI package ``regopy``), for machines where no ``opa`` binary can be had.

    cmbs-opa eval -d policy.rego [-d data.json] -i input.json [--format raw|json]
                  [--v0-compatible] QUERY

Rego is parsed as OPA 1.x parses it: v1 only, unless ``--v0-compatible`` (v0 rule bodies
without ``if`` and partial sets without ``contains`` are parse errors, exit 1).

A reference ``data.PKG.RULE`` is answered by evaluating the package and reading the rule,
so a rule that is ``false`` prints ``false`` (queried directly, regopy calls it
undefined). Exit status 0 with a result, 0 with nothing printed when undefined, 1 for a
policy that does not compile, 2 for a usage error.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from executors.errors import CmbsError

from .rego_syntax import negation_in_every, v0_form

__all__ = ["RegoFailure", "evaluate", "main"]

_REF = re.compile(r"^data(\.[A-Za-z_][A-Za-z0-9_]*)+$")
_UNDEFINED = object()


class RegoFailure(CmbsError):
    """The policy or the query could not be evaluated."""


def evaluate(query: str, *, modules: Sequence[Path], data: Sequence[Path], input_: Any) -> Any:
    """The value of ``query``, or ``_UNDEFINED``."""
    try:
        from regopy import Interpreter, RegoError
    except ImportError:
        raise RegoFailure("regopy is not installed: pip install regopy") from None
    rego = Interpreter()
    noise = io.StringIO()
    try:
        with contextlib.redirect_stdout(noise):
            for module in modules:
                rego.add_module(module.stem, module.read_text("utf-8"))
            for document in data:
                rego.add_data_json(document.read_text("utf-8"))
            if input_ is not None:
                rego.set_input_term(json.dumps(input_))
            if _REF.match(query):
                parts = query.split(".")[1:]
                value = _first(rego.query(f"data.{parts[0]}"))
                for part in parts[1:]:
                    if not isinstance(value, dict) or part not in value:
                        return _UNDEFINED
                    value = value[part]
                return value
            return _first(rego.query(query))
    except RegoError as exc:
        first = next((line for line in str(exc).splitlines() if "errormsg" in line), str(exc))
        raise RegoFailure(f"rego error: {first.strip()}") from None


def _refuse_v0(modules: Sequence[Path]) -> None:
    """What OPA 1.x refuses, refused the same way: its message, file and line."""
    for module in modules:
        found = v0_form(module.read_text("utf-8"))
        if found is not None:
            line, message = found
            raise RegoFailure(f"{module}:{line}: rego_parse_error: {message}")


def _refuse_misjudged(modules: Sequence[Path]) -> None:
    """What the Rego engine here would answer wrongly, refused rather than misjudged."""
    for module in modules:
        line = negation_in_every(module.read_text("utf-8"))
        if line is not None:
            raise RegoFailure(
                f"{module}:{line}: cmbs-opa cannot evaluate `not` inside `every` (its Rego "
                "engine, regopy, answers it wrongly): call a rule of your own there "
                "(`every p in ps { allowed(p) }`), or use OPA's `opa`"
            )


def _first(output: object) -> Any:
    text = str(output)
    if text.strip() == "undefined":
        return _UNDEFINED
    try:
        expressions = json.loads(text).get("expressions", [])
    except ValueError:  # regopy's `<error>`: an evaluation error (conflicting values, say)
        said = text.strip()[:200]
        raise RegoFailure(f"rego error: the query could not be evaluated ({said})") from None
    return expressions[0] if expressions else _UNDEFINED


@contextlib.contextmanager
def _quiet_stdout() -> Iterator[None]:
    """File descriptor 1 silenced: regopy prints a parse error's diagnostics there, below
    Python (the same reason comes back as its exception, which is what is said)."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "wb") as sink:
            os.dup2(sink.fileno(), 1)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def main(argv: Sequence[str] | None = None) -> int:
    # no abbreviations (OPA has none): `--inp FILE` must not pass for `--input FILE` unseen
    parser = argparse.ArgumentParser(
        prog="cmbs-opa", description=__doc__.splitlines()[0], allow_abbrev=False
    )
    sub = parser.add_subparsers(dest="command", required=True)
    ev = sub.add_parser("eval", help="evaluate a Rego query", allow_abbrev=False)
    ev.add_argument("query")
    ev.add_argument("-d", "--data", action="append", default=[], help=".rego module or .json")
    ev.add_argument("-i", "--input", help="input document (JSON)")
    ev.add_argument("-f", "--format", choices=("json", "raw", "pretty"), default="json")
    ev.add_argument(
        "--v0-compatible",
        action="store_true",
        help="accept Rego v0 syntax, as OPA 1.x does with this flag (default: v1 only)",
    )
    args = parser.parse_args(argv)
    if args.input is not None and not (isinstance(args.input, str) and args.input):
        parser.error("--input needs a file")  # argparse reads `--input=--` as no value
    try:
        paths = [Path(p) for p in args.data]
        for path in paths + ([Path(args.input)] if args.input else []):
            if not path.is_file():
                raise RegoFailure(f"no such file: {path}")
        modules = [p for p in paths if p.suffix == ".rego"]
        if not args.v0_compatible:
            _refuse_v0(modules)
        _refuse_misjudged(modules)
        documents = [p for p in paths if p.suffix != ".rego"]
        try:
            input_ = json.loads(Path(args.input).read_text("utf-8")) if args.input else None
        except ValueError as exc:
            raise RegoFailure(f"input is not JSON: {exc}") from None
        with _quiet_stdout():
            value = evaluate(args.query, modules=modules, data=documents, input_=input_)
    except RegoFailure as exc:
        print(f"cmbs-opa: {exc}", file=sys.stderr)
        return 1
    if args.format == "raw":  # as opa prints it: a string bare, anything else compact JSON
        if value is not _UNDEFINED:
            compact = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
            print(value if isinstance(value, str) else compact)
        return 0
    result = (
        [] if value is _UNDEFINED else [{"expressions": [{"value": value, "text": args.query}]}]
    )
    print(
        json.dumps(
            {"result": result} if result else {}, indent=2 if args.format == "pretty" else None
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
