"""The stock reviewer against a real model server on 127.0.0.1 (marker ``llm``): the
prompt is sent, the answer parsed or failed closed, the time-out honoured."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cmbs_async import Outcome, replay, run_scenario
from cmbs_async.audit import SQLiteAuditStore, load_or_create_key
from cmbs_async.demo import demo_scenario
from cmbs_async.review import (
    OpenAIReviewer,
    Review,
    ReviewerError,
    ReviewRequest,
    SupervisionConfig,
    Verdict3,
)
from executors import NullExecutor

from .helpers import assessed, replaying, step
from .llm_server import LlamaServer, llm_marks

pytestmark = [pytest.mark.anyio, *llm_marks()]


REQUEST = ReviewRequest(
    goal="Check whether sshd_config disables X11 forwarding.",
    commitment='{"interpretation": "grep the config"}',
    trace="step 1: check_status grep X11Forwarding sshd_config\nresult: exit 0",
    assessment='{"commitment_met": false, "confidence": 0.4}',
    flags=(),
)


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_the_real_model_is_asked_and_its_answer_parsed_or_failed_closed(
    llama: LlamaServer,
) -> None:
    config = SupervisionConfig(base_url=llama.base_url, model="smollm2", timeout_seconds=60)
    verdict: Verdict3 | None = None
    failure: str | None = None
    async with OpenAIReviewer(config) as reviewer:
        try:
            verdict = (await reviewer.review(REQUEST)).verdict
        except ReviewerError as exc:
            failure = str(exc)
    assert reviewer.last_prompt is not None and "ORIGINAL GOAL:" in reviewer.last_prompt
    assert reviewer.last_reply is not None  # the model answered: no transport or HTTP failure
    if failure is None:
        assert verdict is not None
        assert re.search(rf"VERDICT\W*{verdict.value}", reviewer.last_reply, re.IGNORECASE)
    else:  # refused by the strict parser, for a reason it names
        assert failure.startswith(("the answer has", "the VERDICT is", "a REORIENT verdict"))


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_run_reviewed_by_the_real_model_is_recorded_and_replays(
    llama: LlamaServer, tmp_path: Path
) -> None:
    config = SupervisionConfig(base_url=llama.base_url, model="smollm2", timeout_seconds=60)
    store = SQLiteAuditStore(
        f"{tmp_path}/a.db",
        key=load_or_create_key(f"{tmp_path}/k"),
    )
    agent, _ = replaying(
        step("check_status", {"command": "true"}),
        assessed("check_status", {"command": "true"}, commitment_met=False),
    )
    try:
        async with OpenAIReviewer(config) as reviewer:
            result = await run_scenario(
                demo_scenario(),
                agent=agent,
                executor=NullExecutor(),
                review=Review(reviewer=reviewer, config=config),
                audit=store,
            )
        records = [r for r in store.records(result.session_id) if r.kind == "supervision"]
        assert len(records) == 1
        supervision = records[0].data
        assert supervision["verdict"] in ("CONTINUE", "REORIENT", "PAUSE")
        if supervision["fail_closed"]:
            assert supervision["verdict"] == "PAUSE"
            assert result.outcome is Outcome.PAUSED_NO_HUMAN
        assert store.verify().intact and replay(store, result.session_id or "").identical
    finally:
        store.close()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_timeout_is_honoured_and_fails_closed(llama: LlamaServer) -> None:
    config = SupervisionConfig(
        base_url=llama.base_url, model="smollm2", timeout_seconds=0.05, max_tokens=2000
    )
    agent, _ = replaying(
        step("check_status", {"command": "true"}),
        assessed("check_status", {"command": "true"}, scope_changed=True),
    )
    async with OpenAIReviewer(config) as reviewer:
        result = await run_scenario(
            demo_scenario(),
            agent=agent,
            executor=NullExecutor(),
            review=Review(reviewer=reviewer, config=config),
        )
    assert result.outcome is Outcome.PAUSED_NO_HUMAN
    assert result.reason == "fail-closed: no verdict within 0.05 s"
