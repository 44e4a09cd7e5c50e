"""MkDocs hooks (``hooks:`` in mkdocs.yml): the pages made from the code at build time.

- ``reference/cli-help.md``: every ``cmbs`` subcommand's ``--help``, as the installed
  command prints it (run as ``python -m cmbs_async``), so the page cannot drift from the
  parser;
- ``reference/api/*.md``: the API reference, one page per group below, each name an
  mkdocstrings entry rendered from its docstring. Every name in ``cmbs_async.__all__`` and
  ``executors.__all__`` is documented: a name no group lists goes to the end of
  ``running`` (``REST``), so a new public name is never left out; a name a group lists
  that is not public (not yet, or no longer) is skipped.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

#: docs/griffe_roles.py, which also says which names the reference documents
_spec = importlib.util.spec_from_file_location(
    "griffe_roles", Path(__file__).with_name("griffe_roles.py")
)
assert _spec is not None and _spec.loader is not None
roles = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(roles)

#: page -> (title, introduction, public names, other entries by full path)
API: dict[str, tuple[str, str, tuple[str, ...], tuple[str, ...]]] = {
    "running": (
        "Running a scenario",
        "What runs a scenario and what a run gives back: `run_scenario` with its "
        "configuration, a `Session` for agents that drive their own loop, the scenario "
        "file's model, the result, replay. Public names no other page lists are here too.",
        (
            "run_scenario",
            "RunConfig",
            "Session",
            "StepReply",
            "RunHandle",
            "ScenarioSpec",
            "load_scenario",
            "ScenarioResult",
            "TraceEntry",
            "Outcome",
            "replay",
            "ReplayReport",
        ),
        (),
    ),
    "gate": (
        "The gate and profiles",
        "The CMBS gate, its masks and rules, and the profile that tells it a domain's "
        "actions, signals and evaluators. See [the gate](../../concepts/gate.md) and "
        "[the evidence rule](../../concepts/evidence.md) for what they mean.",
        (
            "Gate",
            "Decision",
            "Rules",
            "Messages",
            "Masks",
            "Payload",
            "Verdict",
            "ObservationOwed",
            "Profile",
            "ActionSpec",
            "PostureSignal",
            "load_profile",
            "builtin_profiles",
            "Evaluator",
            "Evaluation",
            "Programs",
            "run_evaluation",
        ),
        (),
    ),
    "agents": (
        "Agents",
        "The agents that ship with cmbs; anything with `async next_step(turn)` is one. See "
        "[Agents in any language](../../guides/agents.md).",
        (
            "Agent",
            "AgentMessage",
            "CallableAgent",
            "ScriptedAgent",
            "StdioAgent",
            "AgentSandbox",
            "OpenAIAgent",
            "ModelEndpointError",
            "AgentProcessError",
        ),
        (),
    ),
    "review": (
        "Review",
        "The optional review layer: its configuration, the stock reviewer, the human "
        "channels. See [the review layer](../../concepts/review.md).",
        (
            "Review",
            "SupervisionConfig",
            "OpenAIReviewer",
            "CallbackHuman",
            "ConsoleHuman",
            "ReviewerError",
            "ConfigError",
        ),
        (),
    ),
    "audit": (
        "Audit",
        "The audit trail's store and signing key. See [the audit log](../../concepts/audit.md).",
        (
            "AuditStore",
            "SQLiteAuditStore",
            "load_or_create_key",
            "AuditError",
            "CheckpointError",
            "SigningKeyError",
        ),
        ("cmbs_async.audit.RecordKind",),
    ),
    "models": (
        "Models on the wire",
        "The pydantic models that cross between the actors: what an agent is sent (`Turn`, "
        "`Response`), what it sends (`AgentStep`), what an executor reports "
        "(`Observation`). See [the wire protocol](../wire-protocol.md).",
        (
            "Turn",
            "Response",
            "MasksView",
            "AgentStep",
            "Belief",
            "Action",
            "ActionKind",
            "ArtifactPayload",
            "CommandPayload",
            "EvaluationPayload",
            "PosturePayload",
            "Commitment",
            "Assessment",
            "Observation",
            "Output",
            "FileChange",
            "InputFile",
            "Program",
            "CommandEnv",
            "Limits",
            "Containment",
        ),
        (),
    ),
    "errors": (
        "Errors",
        "Everything cmbs raises on purpose derives from `CmbsError`, and each error also "
        "from the built-in it stands for (see [the library guide](../../guides/library.md"
        "#errors-and-logging)). Errors of one part are listed with it too: the agents', the "
        "review's, the audit's, the executors'.",
        (
            "CmbsError",
            "ScenarioError",
            "ProfileError",
            "BatchError",
            "SessionEnded",
            "ExecutorError",
            "ItbenchError",
            "CannotScore",
            "ReadError",
        ),
        (),
    ),
    "executors": (
        "Executors",
        "The lowest layer, the only code that touches the world: the executor protocol, the "
        "local executor (the sandbox), the SSH executor, the null one. See [Executors, local "
        "and SSH](../../guides/executors.md).",
        (
            "Executor",
            "LocalExecutor",
            "NullExecutor",
            "OutputBuffer",
            "DEFAULT_OUTPUT_CAP",
            "confine",
            "PathRefused",
            "SandboxLeak",
            "CleanupFailed",
        ),
        (
            "executors.ssh.SSHExecutor",
            "executors.ssh.SSHTarget",
            "executors.ssh.SSHUnreachable",
            "executors.ssh.SSHAuthRefused",
            "executors.ssh.SSHHostKeyRejected",
            "executors.ssh.SSHLauncherUnavailable",
        ),
    ),
    "adapters": (
        "Adapters",
        "The profile's actions as tools, for agent frameworks and MCP. See [Agent "
        "frameworks](../../guides/adapters.md).",
        (),
        (
            "cmbs_async.adapters.action_tools",
            "cmbs_async.adapters.ActionTool",
            "cmbs_async.adapters.pydantic_ai.session_toolset",
            "cmbs_async.adapters.openai_agents.session_tools",
            "cmbs_async.adapters.openai_agents.session_agent",
        ),
    ),
}


def on_files(files: Files, config: MkDocsConfig, **_: Any) -> Files:
    for path, text in [*_api_pages(), ("reference/cli-help.md", _cli_help())]:
        files.append(File.generated(config, path, content=text))
    return files


#: the page that takes the public names no group lists
REST = "running"


def _api_pages() -> list[tuple[str, str]]:
    where = roles.documented()
    listed = {name for _, _, names, _ in API.values() for name in names}
    rest = tuple(name for name in where if name not in listed)
    pages, index = [], ["# API reference", "", _INDEX, ""]
    for page, (title, intro, names, extra) in API.items():
        names += rest if page == REST else ()
        entries = [where[name] for name in names if name in where] + list(extra)
        body = "\n\n".join(f"::: {entry}" for entry in entries)
        pages.append((f"reference/api/{page}.md", f"# {title}\n\n{intro}\n\n{body}\n"))
        shown = ", ".join(f"[`{e.rsplit('.', 1)[-1]}`][{e}]" for e in entries)
        index += [f"- [{title}]({page}.md): {shown}"]
    return [("reference/api/index.md", "\n".join(index) + "\n"), *pages]


_INDEX = """\
Rendered from the docstrings of the public API: every name in `cmbs_async.__all__` and
`executors.__all__` (imported as `from cmbs_async import Gate`, `from executors import
LocalExecutor`), with the SSH executor (`executors.ssh`), the framework adapters
(`cmbs_async.adapters`) and the audit record kinds. Anything else is internal and may
change. The guides show these in use: [the library](../../guides/library.md)."""


def _cli_help() -> str:
    """Each subcommand's ``--help``, walking the subcommands the help lists."""
    out = [
        "# Every `--help`",
        "",
        "What `cmbs --help` and each subcommand's `--help` print, generated from the "
        "command's own parser when the site is built (defaults under the home directory "
        "shown with `~`). [The command line](cli.md) explains the options in prose.",
    ]
    queue: list[tuple[str, ...]] = [()]
    while queue:
        words = queue.pop(0)
        text = _help(words)
        out += ["", f"## `{' '.join(('cmbs', *words))}`", "", "```text", text.rstrip(), "```"]
        found = re.search(r"^  \{([\w,-]+)\}", text, re.M)  # the subcommands' choices
        if found:
            queue += [(*words, verb) for verb in found.group(1).split(",")]
    return "\n".join(out) + "\n"


def _help(words: tuple[str, ...]) -> str:
    env = {k: v for k, v in os.environ.items() if k != "XDG_DATA_HOME"}
    env |= {"COLUMNS": "100", "HOME": "~", "NO_COLOR": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "cmbs_async", *words, "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    if done.returncode != 0:
        raise PluginError(f"cmbs {' '.join(words)} --help failed: {done.stderr.strip()}")
    return done.stdout
