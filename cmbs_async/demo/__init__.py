"""The built-in demo: a scenario with an injected fault and a scripted agent that shows
the gate at work (a premature claim blocked, evidence earned, an earned termination)."""

from __future__ import annotations

from importlib import resources

import yaml

from ..agents import ScriptedAgent
from ..scenario import ScenarioSpec

__all__ = ["demo_agent", "demo_scenario"]


def demo_scenario() -> ScenarioSpec:
    text = (resources.files(__package__) / "scenario.yaml").read_text("utf-8")
    return ScenarioSpec.model_validate(yaml.safe_load(text))


def demo_agent() -> ScriptedAgent:
    lines = (resources.files(__package__) / "steps.jsonl").read_text("utf-8").splitlines()
    return ScriptedAgent(line for line in lines if line.strip())
