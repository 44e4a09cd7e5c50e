"""``cmbs``: run scenarios under the gate from the command line.

Exit status: 0 for an earned termination, 3 for any other finished run, 2 for a usage
error or an invalid input file (one line on stderr, never a traceback), 128 + the signal
when stopped by SIGINT (Ctrl-C, 130), SIGTERM (143) or SIGHUP (129).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import sys
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NoReturn

import anyio

from executors import Executor, ExecutorError, LocalExecutor

from .._closing import Closing
from .._errors import CmbsError
from ..agents import Agent
from ..audit import SQLiteAuditStore
from ..config import RunConfig
from ..demo import demo_agent, demo_scenario
from ..handle import RunHandle
from ..mcp_server import serve_stdio
from ..profile import Profile, builtin_profiles, load_profile
from ..protocol import Turn
from ..result import ScenarioResult, TraceEntry
from ..runtime import run_scenario
from ..scenario import ScenarioSpec, load_scenario
from ..session import Session
from ..tools import tools_dir
from .audit import add_audit_commands, run_audit_command, write_checkpoint
from .batch import add_batch_command, run_batch_command
from .itbench import (
    add_itbench_command,
    finish_itbench_run,
    prepare_itbench_run,
    run_evaluate,
)
from .logs import LEVELS, logging_to_stderr
from .render import render_outcome, render_result, render_step
from .signals import Interrupted, cancel_on_signals
from .specs import (
    add_agent_options,
    add_sandbox_option,
    agent_from_spec,
    agent_options,
)
from .view import add_view_command, run_view_command
from .wiring import (
    add_record_options,
    add_ssh_options,
    audit_path,
    audit_store,
    build_executor,
    containment_options,
    run_config,
)

__all__ = ["main"]

EXIT_EARNED = 0
EXIT_USAGE = 2
EXIT_NOT_EARNED = 3
EXIT_INTERRUPTED = 130


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, where it has one worth saying."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default in (None, False, [], argparse.SUPPRESS) or "default" in text:
            return text
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _Help)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


class UsageError(CmbsError):
    """A mistake of the user's: reported on one line, exit status 2."""


def _positive(kind: type[int] | type[float]) -> Any:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
        return value

    return parse


def _logging_options(parser: argparse.ArgumentParser, *, default: Any = None) -> None:
    """``--log-level`` and ``--log-format``: before the subcommand, or after it."""
    level, fmt = ("warning", "console") if default is None else (default, default)
    parser.add_argument(
        "--log-level", choices=LEVELS, default=level, help="events shown (default: warning)"
    )
    parser.add_argument(
        "--log-format",
        choices=("console", "json"),
        default=fmt,
        help="events on stderr as text or JSON lines (default: console)",
    )


def _common(backends: tuple[str, ...] = ("asyncio", "trio")) -> _Parser:
    common = _Parser(add_help=False)
    common.add_argument("--backend", choices=backends, default="asyncio", help="event loop")
    _logging_options(common, default=argparse.SUPPRESS)  # the top level's, unless given here
    return common


def _parser() -> argparse.ArgumentParser:
    common = _common()
    common.add_argument("--json", action="store_true", help="print one JSON object")

    recorded = _Parser(add_help=False)
    add_record_options(recorded)

    parser = _Parser(
        prog="cmbs",
        description="Run language-model agents on compliance scenarios under the CMBS gate.",
    )
    parser.add_argument("--version", action="version", version=f"cmbs {_version()}")
    _logging_options(parser)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    demo = sub.add_parser(
        "demo", parents=[common, recorded], help="run the built-in scenario with a scripted agent"
    )
    add_sandbox_option(demo)
    scenario = _Parser(add_help=False)  # what `run` and `mcp` share: a scenario, where
    scenario.add_argument("scenario", help="scenario file (YAML or JSON)")
    scenario.add_argument(
        "--var", action="append", default=[], help="NAME=VALUE: set a scenario var"
    )
    scenario.add_argument(
        "--executor",
        help="local (default) or ssh://USER@HOST[:PORT] (default: the scenario's host)",
    )
    add_ssh_options(scenario)
    scenario.add_argument("--host-key", help="pin the host's public key ('ssh-ed25519 AAAA...')")
    add_sandbox_option(scenario)
    scenario.add_argument("--deadline", type=_positive(float), help="seconds (overrides the file)")
    scenario.add_argument(
        "--max-steps", type=_positive(int), help="step budget (overrides the file)"
    )
    scenario.add_argument("--workdir", help="run in this directory and keep it")

    run = sub.add_parser("run", parents=[common, recorded, scenario], help="run a scenario file")
    run.add_argument(
        "--agent",
        required=True,
        help="script:STEPS.jsonl | stdio:COMMAND | openai:MODEL@BASE_URL",
    )
    add_agent_options(run)
    run.add_argument("--config", help="TOML file with a [supervision] table: turns review on")
    run.add_argument(
        "--human", choices=("none", "console"), default="none", help="who answers a PAUSE"
    )
    sub.add_parser(
        "mcp",
        parents=[_common(("asyncio", "trio")), recorded, scenario],
        help="serve a scenario's actions as MCP tools over stdio, every call supervised",
    )
    schema = sub.add_parser("schema", help="print the JSON Schema of an agent step")
    schema.add_argument("--profile", default="ciso", help=f"one of {builtin_profiles()} or a file")
    schema.add_argument(
        "--turn", action="store_true", help="the schema of a turn (what an agent is sent) instead"
    )
    add_audit_commands(sub)
    add_view_command(sub)
    add_batch_command(sub, _common(("asyncio", "trio", "ray")))
    add_itbench_command(sub, common=common, recorded=recorded, seconds=_positive(float))
    return parser


def _version() -> str:
    try:
        return importlib.metadata.version("cmbs-async")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "unknown"


def _check_backend(backend: str) -> None:
    """A backend whose package is missing is refused before anything starts."""
    if backend in ("trio", "ray") and importlib.util.find_spec(backend) is None:
        raise UsageError(
            f"--backend {backend} needs {backend}, not installed: pip install {backend}"
        )


def _own_tools_on_path() -> None:
    """Local commands find the programs installed with cmbs (``cmbs-opa``) by name, as in
    an activated environment, however ``cmbs`` was started."""
    scripts = tools_dir()
    path = os.environ.get("PATH", os.defpath)
    if scripts not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([scripts, path])


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _own_tools_on_path()
    try:
        _check_backend(getattr(args, "backend", "asyncio"))
        if args.command == "schema":
            schema = Turn.model_json_schema() if args.turn else None
            print(json.dumps(schema or load_profile(args.profile).step_json_schema(), indent=2))
            return 0
        if args.command in ("audit", "replay"):
            return run_audit_command(args)
        if args.command == "view":
            return run_view_command(args)
        with logging_to_stderr(args.log_level, args.log_format):
            if args.command == "batch":
                return run_batch_command(args)
            if args.command == "mcp":
                return _serve_mcp(args)
            if args.command == "itbench" and args.itbench_command == "evaluate":
                return run_evaluate(args, partial(build_executor, args, recorded=False))
            store = audit_store(args)  # a key or database refused: before anything is made
            try:
                result = _run_one(args, store)
            finally:
                if store is not None:
                    store.close()
    except CmbsError as exc:  # a usage error, an invalid file, a key or database refused
        print(f"cmbs {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (KeyboardInterrupt, Interrupted) as exc:  # Ctrl-C before the run, a signal in it
        print(f"cmbs {args.command}: interrupted", file=sys.stderr)
        return exc.exit_status if isinstance(exc, Interrupted) else EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader went away (`| head`): nothing more to say
        _stdout_gone()
        return 0
    _print_result(args, result, store)
    return EXIT_EARNED if result.earned else EXIT_NOT_EARNED


def _run_one(args: argparse.Namespace, store: SQLiteAuditStore | None) -> ScenarioResult:
    """``run``, ``demo`` and ``itbench run``: the run, then its checkpoint; IT-Bench's DIR
    keeps whatever the run did, even when it was stopped."""
    config = run_config(args, store=store, on_step=_live(args))
    spec, agent, executor = _prepare(args)
    handle = RunHandle()
    try:
        result = anyio.run(_run, spec, agent, executor, config, handle, backend=args.backend)
        if store is not None and args.head_out:
            write_checkpoint(store, args.head_out)
        return result
    except Interrupted:
        if handle.result is not None:  # what the run did until the signal came
            _print_result(args, handle.result, store)
        raise
    finally:
        if args.command == "itbench":  # IT-Bench scores whatever DIR holds
            finish_itbench_run(args, handle.result)


def _live(args: argparse.Namespace) -> Callable[[TraceEntry], None] | None:
    """On a terminal (and without ``--json``), what prints each step as it happens: one
    line a step (its header first), and the outcome alone at the end."""
    if not _on_terminal(args):
        return None
    first = True

    def show(entry: TraceEntry) -> None:
        nonlocal first
        try:
            if first:
                print(f"{'step':>4}  {'action':<15}  {'verdict':<9}  message  observed")
                first = False
            print(render_step(entry), flush=True)
        except OSError:  # the terminal went away: the run goes on, its record with it
            pass

    return show


def _on_terminal(args: argparse.Namespace) -> bool:
    return not args.json and sys.stdout.isatty()


def _print_result(
    args: argparse.Namespace, result: ScenarioResult, store: SQLiteAuditStore | None
) -> None:
    try:
        if args.json:
            print(json.dumps(result.summary() | {"audit_db": audit_path(args)}, indent=2))
        elif _on_terminal(args):  # its steps are on the terminal already
            print("\n" + render_outcome(result))
            if store is not None:
                print(f"audit     session {result.session_id} in {store.path}")
        else:
            print(render_result(result))
            if store is not None:
                print(f"audit     session {result.session_id} in {store.path}")
        sys.stdout.flush()  # a reader gone shows here, not as a traceback at exit
    except BrokenPipeError:
        _stdout_gone()


def _stdout_gone() -> None:
    """Whatever is still buffered for a closed pipe goes nowhere, silently."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _agent(args: argparse.Namespace, executor: Executor, profile: Profile) -> Agent:
    """The ``--agent`` of ``run`` and ``itbench run``; a stdio program in a sandbox that
    hides what the commands' sandbox hides, and every workdir."""
    hidden = containment_options(args)["hidden"]
    root = executor.workdir_root if isinstance(executor, LocalExecutor) else None
    options = agent_options(args, hidden=hidden, workdir_root=root)
    return agent_from_spec(args.agent, profile=profile, options=options)


def _check_workdir(executor: Executor, spec: ScenarioSpec) -> None:
    """A scenario's workdir outside the workdir root is refused before anything runs."""
    if spec.workdir is not None and isinstance(executor, LocalExecutor):
        try:
            executor.check_workdir(spec.workdir)
        except ExecutorError as exc:
            raise UsageError(str(exc)) from None


def _prepare(args: argparse.Namespace) -> tuple[ScenarioSpec, Agent, Executor]:
    """The scenario, agent and executor of ``run``, ``demo`` and ``itbench run``."""
    if args.command == "demo":
        return demo_scenario(), demo_agent(), build_executor(args)
    if args.command == "itbench":
        return prepare_itbench_run(args, partial(build_executor, args), partial(_agent, args))
    spec = _scenario(args)
    executor = _executor(args, spec)
    try:
        _check_workdir(executor, spec)
        agent = _agent(args, executor, load_profile(spec.profile))
    except BaseException:
        anyio.run(executor.aclose)  # what it made (its workdir root) goes
        raise
    return spec, agent, executor


def _scenario(args: argparse.Namespace) -> ScenarioSpec:
    """The scenario file with the command line's vars and workdir."""
    spec = load_scenario(args.scenario)
    load_profile(spec.profile)  # an unknown profile is the user's mistake: say so now
    if args.workdir:
        spec = spec.model_copy(update={"workdir": args.workdir})
    if args.var:
        given = {}
        for item in args.var:
            name, sep, value = item.partition("=")
            if not sep or not name:
                raise UsageError(f"--var {item!r}: expected NAME=VALUE")
            given[name] = value
        spec = spec.with_vars(given)
    return spec


def _executor(args: argparse.Namespace, spec: ScenarioSpec) -> Executor:
    return build_executor(
        args,
        where=args.executor or spec.host or "local",
        host_key=spec.host_key,
        source="--executor" if args.executor else "host:",
    )


def _serve_mcp(args: argparse.Namespace) -> int:
    """``cmbs mcp``: stdout is the MCP channel; the result goes to stderr, one line."""
    if importlib.util.find_spec("mcp") is None:
        raise UsageError("cmbs mcp needs the MCP SDK: pip install 'cmbs-async[mcp]'")
    spec = _scenario(args)
    store = audit_store(args)  # a key or database refused: before anything is made
    try:
        result = _serve_session(args, spec, store)
    finally:
        if store is not None:
            store.close()
    if result is not None:
        print(
            f"cmbs mcp: session {result.session_id}: {result.outcome.value} after "
            f"{result.steps} step(s)",
            file=sys.stderr,
        )
    return EXIT_EARNED if result is not None and result.earned else EXIT_NOT_EARNED


def _serve_session(
    args: argparse.Namespace, spec: ScenarioSpec, store: SQLiteAuditStore | None
) -> ScenarioResult | None:
    """The session ``cmbs mcp`` serves, then its checkpoint."""
    config = run_config(args, store=store)
    executor = _executor(args, spec)
    try:
        _check_workdir(executor, spec)
    except BaseException:
        anyio.run(executor.aclose)
        raise

    async def serve() -> ScenarioResult | None:
        async with executor, Session(spec, executor=executor, config=config) as session:
            await cancel_on_signals(partial(serve_stdio, session))
        return session.result

    result = anyio.run(serve, backend=args.backend)
    if store is not None and args.head_out:
        write_checkpoint(store, args.head_out)
    return result


async def _run(
    spec: ScenarioSpec, agent: Agent, executor: Executor, config: RunConfig, handle: RunHandle
) -> ScenarioResult:
    try:
        return await cancel_on_signals(
            partial(
                run_scenario, spec, agent=agent, executor=executor, config=config, handle=handle
            )
        )
    finally:
        with anyio.CancelScope(shield=True):  # what the command line made, it closes
            if config.review is not None and isinstance(config.review.reviewer, Closing):
                await config.review.reviewer.aclose()
            await executor.aclose()
