"""Agents: scripted (JSONL replay) and callable (any async function)."""

from .base import Agent, AgentMessage
from .callable import CallableAgent
from .scripted import ScriptedAgent

__all__ = ["Agent", "AgentMessage", "CallableAgent", "ScriptedAgent"]
