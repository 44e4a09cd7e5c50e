"""The stock CISO profile reads real tool outputs correctly; profiles validate."""

from __future__ import annotations

from pathlib import Path

import pytest

from cmbs_async import Gate, Observation, Output, ProfileError, Verdict, load_profile
from executors import LocalExecutor

from .helpers import step

CISO = load_profile("ciso")


def observed(stdout: str, exit_status: int = 0) -> Observation:
    return Observation(
        kind="command",
        success=exit_status == 0,
        exit_status=exit_status,
        program_found=exit_status != 127,
        stdout=Output(head=stdout, total_bytes=len(stdout)),
    )


@pytest.mark.parametrize(
    ("sample", "signal", "eliminated"),
    [
        ("kubectl_get_polr_wide_fail.txt", "policy_report", "compliant"),
        ("kubectl_get_polr_all_namespaces_mixed.txt", "policy_report", "compliant"),
        ("kubectl_get_polr_legacy_fail.txt", "policy_report", "compliant"),
        ("kubectl_get_polr_all_namespaces_pass.txt", "policy_report", "non_compliant"),
        ("kubectl_get_polr_header_only.txt", "policy_report", None),
        ("opa_eval_raw_false.txt", "opa_raw", "compliant"),
        ("opa_eval_raw_true.txt", "opa_raw", "non_compliant"),
        ("opa_eval_raw_true.txt", "policy_report", None),
        ("kubectl_get_polr_wide_fail.txt", "opa_raw", None),
    ],
)
def test_signals_read_recorded_outputs(
    data: Path, sample: str, signal: str, eliminated: str | None
) -> None:
    output = (data / sample).read_text()
    assert CISO.signals[signal].eliminates(observed(output)) == eliminated


def test_a_policy_report_header_is_not_a_violation(data: Path) -> None:
    gate = Gate(CISO)
    gate.decide(step("check_status", {"command": "kubectl get polr"}))
    gate.observe(observed((data / "kubectl_get_polr_header_only.txt").read_text()))
    assert gate.masks.posture_admissible == {"compliant": True, "non_compliant": True}
    assert gate.masks.evidence == "successful"


def test_kubectl_without_a_cluster_is_available_but_proves_nothing(data: Path) -> None:
    stderr = (data / "kubectl_get_polr_no_cluster.stderr").read_text()
    gate = Gate(CISO)
    gate.decide(step("execute_kubectl", {"command": "kubectl get polr -A"}))
    gate.observe(
        Observation(
            kind="command",
            success=False,
            exit_status=1,
            program_found=True,
            stderr=Output(head=stderr, total_bytes=len(stderr)),
        )
    )
    view = gate.masks.view()
    assert view.affordances["k8s_policy"] == "available"
    assert view.evidence == "none"
    assert view.posture_admissible == {"compliant": True, "non_compliant": True}


@pytest.mark.anyio
async def test_a_missing_program_closes_a_capability_only_when_all_its_programs_are(
    tmp_path: Path,
) -> None:
    """One provider missing (exit 127) leaves the others; all missing closes it."""
    profile = CISO.model_copy(
        update={"providers": {**CISO.providers, "opa_eval": ("cmbs-no-such-opa", "cmbs-opa")}}
    )
    gate = Gate(profile)
    async with LocalExecutor(workdir_root=str(tmp_path)) as executor:
        workdir = await executor.prepare(None, {})

        async def run(command: str) -> Observation:
            assert gate.decide(step("execute_opa", {"command": command})).needs_execution
            observation = await executor.run_command(workdir, command, timeout=30)
            gate.observe(observation)
            return observation

        missing = await run("cmbs-no-such-opa eval -d p.rego 'data.check.result'")
        assert missing.exit_status == 127 and "not found" in missing.stderr.text
        assert gate.masks.affordances["opa_eval"] == "unknown"  # cmbs-opa may still be there
        found = await run("cmbs-opa eval --help")
    assert found.exit_status == 0 and gate.masks.affordances["opa_eval"] == "available"

    alone = Gate(profile.model_copy(update={"providers": {"opa_eval": ("cmbs-no-such-opa",)}}))
    assert alone.decide(step("execute_opa", {"command": "cmbs-no-such-opa x"})).needs_execution
    alone.observe(missing)
    assert alone.masks.affordances["opa_eval"] == "unavailable"
    blocked = alone.decide(step("execute_opa", {"command": "cmbs-opa eval x"}))
    assert blocked.verdict is Verdict.BLOCK


def test_a_rego_policy_needs_no_kubernetes() -> None:
    gate = Gate(CISO)
    assert gate.decide(step("execute_kubectl", {"command": "kubectl get po"})).needs_execution
    gate.observe(
        Observation(
            kind="command",
            command="kubectl get po",
            success=False,
            exit_status=127,
            program_found=False,
            stderr=Output(head="sh: 1: kubectl: not found\n"),
        )
    )
    assert gate.masks.affordances["k8s_policy"] == "unavailable"
    kyverno = gate.decide(step("generate_policy", {"path": "policy.yaml", "content": "x"}))
    assert kyverno.verdict is Verdict.BLOCK
    rego = gate.decide(step("generate_policy", {"path": "policy.rego", "content": "x"}))
    assert rego.verdict is Verdict.ALLOW


def test_profile_from_a_file_and_its_errors(tmp_path: Path) -> None:
    good = tmp_path / "p.yaml"
    good.write_text(
        "name: tiny\naffordances: [net]\nactions:\n"
        "  probe: {kind: run_command, requires: net, evidence_on_success: successful}\n"
        "  claim: {kind: declare_posture}\n  stop: {kind: terminate}\n"
    )
    assert list(load_profile(good).actions) == ["probe", "claim", "stop"]
    bad = tmp_path / "bad.yaml"
    bad.write_text(good.read_text().replace("requires: net", "requires: gpu"))
    with pytest.raises(ProfileError, match="unknown affordance gpu"):
        load_profile(bad)
    with pytest.raises(ProfileError, match="no profile"):
        load_profile("nonesuch")


def test_step_schema_lists_the_vocabulary() -> None:
    schema = CISO.step_json_schema()
    names = [
        variant["properties"]["type"]["const"] for variant in schema["$defs"]["Action"]["oneOf"]
    ]
    assert sorted(names) == sorted(CISO.actions)
    affordances = schema["$defs"]["Belief"]["properties"]["affordances"]["properties"]
    assert set(affordances) == {"k8s_policy", "opa_eval", "ansible_exec"}
