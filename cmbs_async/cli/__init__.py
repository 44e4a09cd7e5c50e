"""The ``cmbs`` command line: the composition root that wires specs, agents and executors."""

from .main import main

__all__ = ["main"]
