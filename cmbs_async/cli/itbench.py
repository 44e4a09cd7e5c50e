"""``cmbs itbench run`` and ``cmbs itbench evaluate``: IT-Bench's scenario data in, its
workdir and ``agent_data.tar`` out, and its pass criterion where it can run here."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import anyio

from executors import Executor, ExecutorError, LocalExecutor
from executors.sandbox import SandboxUser

from ..agents import Agent
from ..itbench import (
    DEADLINE_S,
    CannotScore,
    Evaluation,
    Flip,
    ItbenchError,
    Kind,
    ScenarioData,
    agent_file,
    check_strict,
    cluster_problem,
    collected_kind,
    command_search,
    evaluate,
    guess_kind,
    itbench_scenario,
    load_scenario_data,
    missing_program,
    prepare_workdir,
    program_hint,
    replace_file,
    targets,
    workdir_goal,
    write_tar,
)
from ..kyverno import REPORT_WAIT_S, evaluate_kyverno
from ..profile import Profile, load_profile
from ..result import ScenarioResult
from ..scenario import ScenarioSpec
from .signals import cancel_on_signals
from .specs import add_agent_options, add_sandbox_option, parse_network

__all__ = [
    "add_expect_option",
    "add_itbench_command",
    "finish_itbench_run",
    "prepare_itbench_run",
    "run_evaluate",
]

EXIT_PASSED = 0
EXIT_FAILED = 1
EXIT_CANNOT_SCORE = 2

_KINDS = [kind.value for kind in Kind]
_KYVERNO = (Kind.KYVERNO_GENERATE, Kind.KYVERNO_UPDATE)


def add_itbench_command(
    sub: Any, *, common: argparse.ArgumentParser, recorded: argparse.ArgumentParser, seconds: Any
) -> None:
    itbench = sub.add_parser(
        "itbench", help="IT-Bench CISO: run its scenario data under the gate, score a workdir"
    )
    verbs = itbench.add_subparsers(
        dest="itbench_command", required=True, parser_class=type(itbench)
    )
    run = verbs.add_parser(
        "run",
        parents=[common, recorded],
        help="prepare DIR as IT-Bench's agent harness does and run the agent in it",
    )
    run.add_argument("data", help="the scenario data object (JSON) IT-Bench hands the agent")
    run.add_argument("--workdir", required=True, help="a new or empty directory; kept")
    run.add_argument(
        "--agent", required=True, help="script:STEPS.jsonl | stdio:COMMAND | openai:MODEL@BASE_URL"
    )
    run.add_argument("--kind", choices=_KINDS, help="the scenario kind (default: from the goal)")
    run.add_argument("--tar", help="afterwards, however the run ended, tar DIR here")
    run.add_argument(
        "--deadline", type=seconds, default=DEADLINE_S, help="seconds (IT-Bench's budget)"
    )
    add_sandbox_option(run)
    add_agent_options(run)
    run.add_argument(
        "--network",
        default="targets",
        metavar="targets|all|none|HOST:PORT,...",
        help="what the agent's commands reach: targets is the inventory's hosts and the "
        "kubeconfig's servers, and nothing else (default: %(default)s)",
    )
    score = verbs.add_parser(
        "evaluate", parents=[common], help="IT-Bench's pass criterion on a workdir"
    )
    score.add_argument("workdir", help="the agent's directory (or what agent_data.tar holds)")
    score.add_argument("--inventory", help="the evaluator's Ansible inventory (rhel9-ansible-opa)")
    score.add_argument(
        "--kubeconfig", help="the evaluator's kubeconfig (kubectl-opa, the Kyverno kinds)"
    )
    score.add_argument(
        "--kind", choices=_KINDS, help="the scenario kind (default: from DIR's scenario data)"
    )
    add_expect_option(score, "--expect")
    score.add_argument("--opa", help="the opa program (default: opa, else cmbs-opa)")
    score.add_argument("--out", help="where evaluation.json goes (default: DIR/evaluation.json)")
    score.add_argument(
        "--strict",
        action="store_true",
        help="beyond IT-Bench's criterion: the opposite verdict on the opposite state too "
        "(a fixed target, else the collected input with the checked setting reversed)",
    )
    score.add_argument(
        "--fixed-inventory",
        metavar="FILE",
        help="--strict: an inventory whose hosts are known to be in the opposite state",
    )
    score.add_argument(
        "--fixed-kubeconfig",
        metavar="FILE",
        help="--strict: a kubeconfig whose cluster is known to be in the opposite state",
    )
    score.add_argument(
        "--flip",
        action="append",
        default=[],
        metavar="POINTER=VALUE",
        help="--strict without a fixed target: the checked setting of the collected input "
        "(a JSON Pointer, * for every member) and its opposite value (JSON, else text); "
        "repeatable (default: each setting with a known opposite, yes/no, true/false, ...)",
    )
    kyverno = score.add_argument_group(
        "the Kyverno kinds",
        "scored from the Kyverno policy reports of the --kubeconfig cluster, as it is "
        "(IT-Bench's way: the agent deployed its policies there)",
    )
    kyverno.add_argument(
        "--apply-policies",
        action="store_true",
        help="beyond IT-Bench: apply DIR's Kyverno policies to the cluster first (and put "
        "the cluster back afterwards)",
    )
    kyverno.add_argument(
        "--existing-policies",
        metavar="FILE",
        help="kyverno-update: the policies before the agent (IT-Bench's "
        "manifests/existing-policy.yaml); needed without --apply-policies",
    )
    kyverno.add_argument(
        "--report-wait",
        type=seconds,
        default=REPORT_WAIT_S,
        metavar="SECONDS",
        help="how long to wait for Kyverno to report (default: %(default)g)",
    )
    add_sandbox_option(score)


def add_expect_option(parser: argparse.ArgumentParser, flag: str) -> None:
    """What a passing policy prints: ``false`` where IT-Bench injected its fault."""
    parser.add_argument(
        flag,
        choices=("false", "true"),
        default="false",
        help="what a passing policy prints: false where IT-Bench injected the fault",
    )


def prepare_itbench_run(
    args: argparse.Namespace,
    make_executor: Callable[..., Executor],
    make_agent: Callable[[Executor, Profile], Agent],
) -> tuple[ScenarioSpec, Agent, Executor]:
    """The scenario, agent and executor of ``cmbs itbench run``, DIR laid out (and handed
    to the user sandboxed commands run as)."""
    data = load_scenario_data(args.data)
    kind = Kind(args.kind) if args.kind else guess_kind(data.goal_template)
    if kind is None:
        raise ItbenchError("cannot tell the scenario kind from the goal: give --kind")
    network = (  # before anything is made: bad input leaves nothing
        targets(data)
        if args.network == "targets"
        else parse_network(args.network, option="--network")
    )
    # the goal and the scenario DIR will run as, checked whole before DIR is made
    itbench_scenario(
        workdir_goal(data, args.workdir, kind=kind),
        args.workdir,
        kind=kind,
        deadline_s=args.deadline,
        network=network,
    )
    if args.tar and not os.path.isdir(os.path.dirname(os.path.abspath(args.tar))):
        raise ItbenchError(f"--tar {args.tar}: its directory does not exist")
    user = args.sandbox_user
    if user is None and os.geteuid() == 0:  # DIR is laid out for them
        user = SandboxUser.fresh()
    executor = make_executor(user=user)
    try:
        search = command_search(executor)  # what the agent's commands will need to find
        missing = None if search is None else missing_program(kind, search)
        if missing is not None:
            hint = program_hint(missing, search or "")
            raise ItbenchError(
                f"{missing} not found on the PATH commands run with: a {kind.value} "
                f"scenario runs it{hint or ' (install it, or put it on PATH)'}"
            )
        if isinstance(executor, LocalExecutor):  # a DIR the sandbox refuses: before it is made
            try:
                executor.check_workdir(os.path.abspath(args.workdir))
            except ExecutorError as exc:
                raise ItbenchError(f"--workdir {args.workdir}: {exc}") from None
        if "kubeconfig" in kind.needs:  # a cluster that cannot serve it: before DIR is made
            ask = partial(cluster_problem, executor, kind, data.vars["kubeconfig"])
            problem = anyio.run(ask, backend=args.backend)
            if problem is not None:
                raise ItbenchError(f"the cluster of vars.kubeconfig {problem}")
        agent = make_agent(executor, load_profile("ciso"))
        user = executor.user if isinstance(executor, LocalExecutor) else None
        owner = (user.uid, user.gid) if user is not None else None
        goal = prepare_workdir(data, args.workdir, kind=kind, owner=owner)
    except BaseException:
        anyio.run(executor.aclose)  # what it made (DIR's parent, say) goes
        raise
    spec = itbench_scenario(
        goal, args.workdir, kind=kind, deadline_s=args.deadline, network=network
    )
    return spec, agent, executor


def finish_itbench_run(args: argparse.Namespace, result: ScenarioResult | None) -> None:
    """Whatever the run did stays in DIR, with its result; ``--tar`` packs DIR."""
    workdir = Path(args.workdir)
    if not workdir.is_dir():
        return
    try:
        if result is not None:
            summary = json.dumps(result.summary(), indent=2) + "\n"
            replace_file(workdir, "cmbs-result.json", summary)
        if args.tar:
            write_tar(workdir, args.tar)
    except OSError as exc:
        raise ItbenchError(f"cannot keep the run in {workdir}: {exc.strerror or exc}") from exc


def run_evaluate(args: argparse.Namespace, make_executor: Callable[[], Executor]) -> int:
    """``cmbs itbench evaluate``: writes evaluation.json; exit 0 passed, 1 failed, 2 when
    it cannot score (the evaluator's programs missing where its commands run)."""
    workdir = Path(args.workdir)
    if not workdir.is_dir():
        raise ItbenchError(f"{workdir} is not a directory")
    kind = Kind(args.kind) if args.kind else _kind_of(workdir)
    if kind in _KYVERNO:
        return _run_evaluate_kyverno(args, workdir, kind, make_executor)
    for option, given in (
        ("--apply-policies", args.apply_policies),
        ("--existing-policies", args.existing_policies),
    ):
        if given:
            raise ItbenchError(f"{option} is for the Kyverno kinds, not {kind.value}")
    opposite: dict[str, Any] = {  # --strict's options, checked before anything is made
        "strict": args.strict,
        "fixed_inventory": args.fixed_inventory,
        "fixed_kubeconfig": args.fixed_kubeconfig,
        "flips": tuple(Flip.parse(text) for text in args.flip),
    }
    check_strict(kind, **opposite)
    executor = make_executor()

    async def score() -> Evaluation:
        async with executor:
            return await evaluate(
                workdir,
                executor=executor,
                kind=kind,
                inventory=args.inventory,
                kubeconfig=args.kubeconfig,
                expect=args.expect,
                opa=args.opa,
                **opposite,
            )

    return _scored(args, workdir, score)


def _run_evaluate_kyverno(
    args: argparse.Namespace, workdir: Path, kind: Kind, make_executor: Callable[[], Executor]
) -> int:
    """``evaluate`` of a Kyverno kind: the cluster of ``--kubeconfig`` as the agent left it
    (IT-Bench's way), or with DIR's policies applied (``--apply-policies``)."""
    # options of the OPA kinds, refused in one line before anything is made
    refused = [
        option
        for option, given in (
            ("--fixed-inventory", args.fixed_inventory),
            ("--fixed-kubeconfig", args.fixed_kubeconfig),
            ("--flip", args.flip),
            ("--opa", args.opa),
            ("--expect true", args.expect != "false"),
            ("--inventory", args.inventory),
        )
        if given
    ]
    if refused:
        raise ItbenchError(
            f"{refused[0]} is not for a {kind.value} workdir: it is scored from Kyverno's "
            "policy reports (--strict adds a compliant twin of the fault)"
        )
    if args.kubeconfig is None:
        raise ItbenchError(f"evaluating {kind.value} needs the evaluator's --kubeconfig FILE")
    if args.existing_policies is not None and kind is not Kind.KYVERNO_UPDATE:
        raise ItbenchError(f"--existing-policies is for kyverno-update, not {kind.value}")
    if kind is Kind.KYVERNO_UPDATE and not args.apply_policies and not args.existing_policies:
        raise ItbenchError(
            "scoring a kyverno-update cluster as the agent left it needs the policies "
            "before the agent: give --existing-policies FILE (IT-Bench's "
            "manifests/existing-policy.yaml), or --apply-policies"
        )
    executor = make_executor()

    async def score() -> Evaluation:
        async with executor:
            return await evaluate_kyverno(
                workdir,
                executor=executor,
                kind=kind,
                kubeconfig=args.kubeconfig,
                strict=args.strict,
                apply=args.apply_policies,
                existing=args.existing_policies,
                wait_s=args.report_wait,
            )

    return _scored(args, workdir, score)


def _scored(
    args: argparse.Namespace, workdir: Path, score: Callable[[], Awaitable[Evaluation]]
) -> int:
    """``score`` run (a signal stops it), its verdict written as ``evaluation.json`` and
    printed: exit 0 passed, 1 failed, 2 no verdict (nothing written)."""
    try:
        evaluation = anyio.run(cancel_on_signals, score, backend=args.backend)
    except CannotScore as exc:  # a missing tool is no verdict on the agent: nothing written
        print(f"cmbs itbench: cannot score: {exc}", file=sys.stderr)
        return EXIT_CANNOT_SCORE
    out = Path(args.out) if args.out else workdir / "evaluation.json"
    try:
        out.write_text(evaluation.to_json())
    except OSError as exc:
        raise ItbenchError(f"cannot write {out}: {exc.strerror or exc}") from exc
    verdict = "pass" if evaluation.passed else "fail"
    print(
        evaluation.to_json() if args.json else f"{verdict}: {evaluation.details['reason']} ({out})"
    )
    sys.stdout.flush()
    return EXIT_PASSED if evaluation.passed else EXIT_FAILED


def _kind_of(workdir: Path) -> Kind:
    """The kind a workdir was prepared for (its scenario data), else what it holds."""
    text = agent_file(workdir / "scenario_data.json")  # the agent could have replaced it
    with contextlib.suppress(ValueError):
        kind = guess_kind(ScenarioData.model_validate_json(text or "").goal_template)
        if kind is not None:
            return kind
    collected = collected_kind(workdir)
    if collected is None:
        raise ItbenchError(f"cannot tell the scenario kind of {workdir}: give --kind")
    return collected
