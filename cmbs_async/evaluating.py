"""Running what the gate judged an evaluation: its argument vector, with no shell, by a
program resolved once per run to a file no agent can write (path and content hash kept).
"""

from __future__ import annotations

import os
import shlex

from executors import Executor

from .evaluators import Evaluation
from .protocol import CommandEnv, Observation, Program

__all__ = ["NO_HOME", "Programs", "run_evaluation"]

#: The ``HOME`` an evaluation runs with: a path that does not exist and under which
#: nothing can be made, so that no file the agent left in a home (``~/.kube/config``) is
#: read as the program's own. Not ``/dev/null``: kubectl stats ``$HOME/.kube/config``
#: and stops at "not a directory", where "no such file" lets it go on.
NO_HOME = "/proc/nonexistent"


class Programs:
    """The evaluators' programs of one run on ``executor``'s ``workdir``, each resolved
    once (see :meth:`~executors.base.Executor.resolve_program`)."""

    def __init__(self, executor: Executor, workdir: str, env: CommandEnv | None = None) -> None:
        self._executor = executor
        self._workdir = workdir
        self._env = env
        self._found: dict[str, Program | None] = {}

    async def resolve(self, name: str) -> Program | None:
        """``name``'s program, or ``None`` where there is none out of the agent's reach."""
        if name not in self._found:
            self._found[name] = await self._executor.resolve_program(
                self._workdir, name, env=self._env
            )
        return self._found[name]


async def run_evaluation(
    executor: Executor,
    workdir: str,
    evaluation: Evaluation,
    programs: Programs,
    *,
    timeout: float | None,  # noqa: ASYNC109 - the command's own limit, as executors take it
    env: CommandEnv | None = None,
) -> Observation:
    """Run ``evaluation`` exactly as judged, by the first of its programs found, with no
    home of its own (:data:`NO_HOME`); its observation names the program it ran and the
    files it was handed: its inputs and files, and the files its variables name
    (``KUBECONFIG``, from the scenario's environment).

    Where every program is missing, or found only where commands can write, the words run
    as a plain command instead: what that observes still counts as execution (and a
    missing program as missing), never as posture evidence.
    """
    for name in evaluation.programs:
        program = await programs.resolve(name)
        if program is not None:
            break
    else:
        command = shlex.join(evaluation.argv)
        return await executor.run_command(workdir, command, timeout=timeout, env=env)
    argv = (program.path, *evaluation.argv[1:])
    declared = env or CommandEnv()
    variables = _variable_files(evaluation.variables, declared)
    named = {
        "input": evaluation.inputs,
        "file": evaluation.files,
        "variable": variables,
    }
    roles = [role for role, files in named.items() for _ in files]
    sealed = declared.model_copy(update={"values": {**declared.values, "HOME": NO_HOME}})
    observed = await executor.run_program(
        workdir, argv, timeout=timeout, env=sealed, inputs=[f for fs in named.values() for f in fs]
    )
    found = tuple(
        file.model_copy(update={"role": role})
        for file, role in zip(observed.inputs, roles, strict=False)
    )
    return observed.model_copy(update={"program": program, "inputs": found})


def _variable_files(names: tuple[str, ...], env: CommandEnv) -> tuple[str, ...]:
    """The files the variables ``names`` name in the commands' environment (a list, as
    ``KUBECONFIG`` may be, split at ``:``)."""
    found: list[str] = []
    for name in names:
        value = env.values.get(name)
        if value is None and name in env.pass_env:
            value = os.environ.get(name)
        found += [path for path in (value or "").split(":") if path]
    return tuple(found)
