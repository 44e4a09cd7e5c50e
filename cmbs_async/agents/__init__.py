"""Agents: scripted (JSONL replay), callable (any async function), stdio (any program),
and a language model behind any OpenAI-compatible endpoint."""

from .base import Agent, AgentMessage
from .callable import CallableAgent
from .openai import ModelEndpointError, OpenAIAgent
from .scripted import ScriptedAgent
from .specs import SpecError
from .stdio import AgentProcessError, AgentSandbox, StdioAgent

__all__ = [
    "Agent",
    "AgentMessage",
    "AgentProcessError",
    "AgentSandbox",
    "CallableAgent",
    "ModelEndpointError",
    "OpenAIAgent",
    "ScriptedAgent",
    "SpecError",
    "StdioAgent",
]
