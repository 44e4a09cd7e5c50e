from __future__ import annotations

import os
import secrets
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from .helpers import processes_with, unique_seconds
from .k8s_plane import K8sPlane, k8s_tools
from .llm_server import LlamaServer, model_path

DATA = Path(__file__).parent / "data"

# Commands find this environment's programs (cmbs-opa, ansible-playbook) as a user's would
# with it activated, however pytest was started.
_BIN = str(Path(sys.executable).parent)
if _BIN not in os.environ.get("PATH", "").split(os.pathsep):
    os.environ["PATH"] = os.pathsep.join([_BIN, os.environ.get("PATH", os.defpath)])

# One Ray token for the session, set before anything imports Ray (which reads its mode and
# token once): every cluster a test starts, here or in a child process (cmbs batch's own
# throwaway one too), takes calls with this token alone, and no sandbox sees it.
os.environ["RAY_AUTH_MODE"] = "token"
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Every async test runs on both backends."""
    return str(request.param)


@pytest.fixture
def data() -> Path:
    return DATA


@pytest.fixture(autouse=True)
def _private_data_dir(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Audit databases and signing keys of CLI runs go to a temporary data dir, not ~."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path_factory.mktemp("data")))


@pytest.fixture(scope="session")
def llama() -> Iterator[LlamaServer]:
    """One real model server for every ``llm`` test of the session."""
    path = model_path()
    assert path is not None, "the llm extra is not installed"
    with LlamaServer(path) as running:
        yield running


@pytest.fixture(scope="session")
def k8s_plane() -> Iterator[K8sPlane]:
    """One local Kubernetes control plane (etcd, kube-apiserver, kube-controller-manager)
    for every ``k8s`` test of the session; skips without the programs (CI must have them)."""
    with K8sPlane(k8s_tools()) as plane:
        yield plane


@pytest.fixture
def marker() -> Iterator[str]:
    """A ``sleep`` argument no other process uses; whatever still runs with it is killed."""
    chosen = unique_seconds()
    yield chosen
    for pid in processes_with(chosen):
        os.kill(pid, signal.SIGKILL)
