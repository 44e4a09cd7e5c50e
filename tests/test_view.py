"""``cmbs view`` in a real browser (Debian's chromium, driven headless by Selenium through
its chromedriver): the runs list loads, filters on each column and sorts, a blocked step
shows its reason, the mask that stopped it and the masks, an output the evidence rule
refused says why (as ``cmbs run``'s trace does), a tampered database says "not verified"
and why, two runs side by side, a run judged again under a stricter profile, a batch page
with the CLI summary's numbers and a retried batch's lines and runs counted apart, a run
recorded or a result appended while the page is open appears,
a results line edited by hand or appended unsigned is marked and not counted, and what an
agent's command printed is shown, never run. Also the exported bundle and the token off
loopback. With ``CMBS_VIEW_SHOTS=DIR``, the screenshots of every page go there."""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import httpx
import pytest
import yaml

from cmbs_async.profile import load_profile

from .helpers import CMBS, EVALUATE, evaluated_files, step
from .sshd import free_port

CHROMIUM, DRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"

pytestmark = [
    pytest.mark.skipif(
        not (os.path.exists(CHROMIUM) and os.path.exists(DRIVER)) and not os.environ.get("CI"),
        reason="chromium and chromium-driver are not installed",
    ),
]

HOSTILE = '<script>window.hacked = 1</script><img src=x onerror="window.hacked = 2">'


def cmbs(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CMBS, *args], capture_output=True, text=True, timeout=120, cwd=cwd, env=env
    )


def keyless(folder: Path) -> dict[str, str]:
    """The environment with no default signing key (its data folder empty)."""
    folder.mkdir(parents=True, exist_ok=True)
    return os.environ | {"XDG_DATA_HOME": str(folder)}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """An audit database with two demo runs and a run whose command printed markup."""
    folder = tmp_path_factory.mktemp("view")
    db, key = folder / "audit.db", folder / "key"
    for _ in range(2):
        assert cmbs("demo", "--audit-db", str(db), "--signing-key", str(key)).returncode == 0
    scenario = folder / "hostile.yaml"
    scenario.write_text("id: hostile-output\ngoal: print something\ndeadline_s: 60\n")
    steps = folder / "steps.jsonl"
    steps.write_text(
        step("check_status", {"command": f"printf '%s' '{HOSTILE}'"}) + "\n"
        + step("terminate", {}) + "\n"
    )  # fmt: skip
    done = cmbs(
        "run", str(scenario), "--agent", f"script:{steps}", "--audit-db", str(db),
        "--signing-key", str(key),
    )  # fmt: skip
    assert done.returncode not in (2, 4) and "Traceback" not in done.stderr, done.stderr
    public = cmbs("audit", "key", "--signing-key", str(key)).stdout.strip()
    tampered = folder / "tampered.db"
    shutil.copy(db, tampered)
    with sqlite3.connect(tampered) as edit:
        row = edit.execute("SELECT session_id, seq, body FROM records WHERE kind = 'decision' "
                           "LIMIT 1").fetchone()  # fmt: skip
        body = json.loads(row[2])
        body["data"]["verdict"] = "ALLOW"  # a BLOCK made to look allowed
        edit.execute(
            "UPDATE records SET body = ? WHERE session_id = ? AND seq = ?",
            (json.dumps(body), row[0], row[1]),
        )
    return {"db": db, "key": key, "public": public, "tampered": tampered, "folder": folder}


SOLVE = [  # finds the fault and says so: right where the setting is on
    step("check_status", {"command": EVALUATE}),
    step("declare_posture", {"posture": "non_compliant"}, posture="non_compliant",
         evidence="successful"),
    step("terminate", posture="non_compliant", evidence="successful"),
]  # fmt: skip
LIE = [step("declare_posture", {"posture": "compliant"}, posture="compliant")]


@pytest.fixture(scope="module")
def batched(recorded: dict[str, object]) -> dict[str, object]:
    """A batch of two scenarios (one expects non_compliant, one compliant) and two agents
    (one that evaluates, one that claims without evidence), recorded in its own database,
    with what ``cmbs batch`` printed."""
    folder = Path(str(recorded["folder"])) / "batch"
    pack = folder / "pack"
    pack.mkdir(parents=True)
    for name, x11, expected in (("on", "yes", "non_compliant"), ("off", "no", "compliant")):
        spec = {"id": name, "goal": "Is X11 forwarding off?", "deadline_s": 60,
                "files": evaluated_files(x11), "expected": expected}  # fmt: skip
        (pack / f"{name}.yaml").write_text(json.dumps(spec))
    agents = []
    for name, lines in (("solve", SOLVE), ("lie", LIE)):
        (folder / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
        agents.append(f"script:{folder / f'{name}.jsonl'}")
    db, out = folder / "batch.db", folder / "results.jsonl"
    done = cmbs(
        "batch", str(pack), "--agent", agents[0], "--agent", agents[1], "--out", str(out),
        "--audit-db", str(db), "--signing-key", str(recorded["key"]), "--concurrency", "2",
    )  # fmt: skip
    assert done.returncode == 3, done.stderr  # not all earned
    return {"db": db, "results": out, "agents": agents, "printed": done.stdout}


def unsigned_line(signed: dict[str, object]) -> str:
    """A results line appended by hand (or by an older cmbs): the batch goes on, an
    endpoint went away."""
    line = {k: v for k, v in signed.items() if k not in ("signature", "signed_by")}
    return json.dumps(line | {
        "key": f"{signed['key']}#2", "outcome": "agent_error", "posture": None,
        "reason": "endpoint unreachable", "session_id": None, "correct": False,
    }) + "\n"  # fmt: skip


@pytest.fixture(scope="module")
def forged(batched: dict[str, object]) -> dict[str, object]:
    """The batch's results with one line edited by hand (a run that did not earn its
    termination made to say it did, its signature kept) and one unsigned line appended."""
    lines = Path(str(batched["results"])).read_text().splitlines()
    number = next(i for i, line in enumerate(lines) if '"outcome": "terminated"' not in line)
    edited = json.loads(lines[number])
    assert edited["session_id"] and edited["signature"]
    lines[number] = json.dumps(edited | {"outcome": "terminated"})
    results = Path(str(batched["results"])).with_name("forged.jsonl")
    results.write_text("\n".join(lines) + "\n" + unsigned_line(json.loads(lines[0])))
    return {"results": results, "edited": edited["session_id"], "db": batched["db"]}


class Viewer:
    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            [*CMBS, "view", *args, "--port", str(self.port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.process.communicate()
            try:
                httpx.get(self.url + "/stamp", timeout=1)
                return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise AssertionError("the viewer did not start in 60 s")

    def close(self) -> None:
        self.process.terminate()
        self.process.communicate(timeout=30)


@pytest.fixture
def viewer(recorded: dict[str, object]) -> Iterator[Viewer]:
    running = Viewer(str(recorded["db"]), "--public-key", str(recorded["public"]))
    yield running
    running.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                 "--window-size=1400,1000"):  # fmt: skip
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def replaced(exc: Exception) -> bool:
    """Whether ``exc`` says an element belonged to a page since replaced (a reload, a
    click that navigates): chromedriver says so as a stale element, or, caught while the
    document changes, as an inspector error about a node that is no longer in it."""
    from selenium.common.exceptions import StaleElementReferenceException

    return isinstance(exc, StaleElementReferenceException) or (
        "does not belong to the document" in str(exc)
    )


def wait_for(condition: object, seconds: float = 30) -> None:
    """Until ``condition()`` holds (an element of a page being replaced counts as not)."""
    from selenium.common.exceptions import WebDriverException

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if condition():  # type: ignore[operator]
                return
        except WebDriverException as exc:
            if not replaced(exc):
                raise
        time.sleep(0.2)
    raise AssertionError("not seen in time")


def element(driver: object, css: str) -> object:
    """The first element ``css`` selects, once the page shows it (after a click that
    navigates, the old page may still be there)."""
    from selenium.webdriver.common.by import By

    found: list[object] = []
    wait_for(lambda: found.extend(driver.find_elements(By.CSS_SELECTOR, css)) or found)  # type: ignore[attr-defined]
    return found[0]


def shot(driver: object, tmp_path: Path, name: str) -> None:
    """Screenshots of every page, kept with the test's files (or in ``$CMBS_VIEW_SHOTS``)
    to look at."""
    folder = Path(os.environ.get("CMBS_VIEW_SHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(folder / f"{name}.png"))  # type: ignore[attr-defined]


def rows(driver: object) -> list[str] | None:
    """The list's rows as text; ``None`` while the page is being replaced (a reload)."""
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By

    try:
        return [r.text for r in driver.find_elements(By.CSS_SELECTOR, "#runs tr.run")]  # type: ignore[attr-defined]
    except WebDriverException as exc:
        if not replaced(exc):
            raise
        return None


def test_the_list_loads_and_filters(viewer: Viewer, browser: object, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    driver = browser
    driver.get(viewer.url + "/")  # type: ignore[attr-defined]
    wait_for(lambda: len(rows(driver) or ()) == 3)
    shot(driver, tmp_path, "runs")
    search = driver.find_element(By.ID, "q")  # type: ignore[attr-defined]
    search.send_keys("hostile")
    driver.find_element(By.ID, "filter").click()  # type: ignore[attr-defined]
    wait_for(lambda: len(rows(driver) or ()) == 1)
    assert "hostile-output" in (rows(driver) or [""])[0]
    assert "1 of 3 runs" in driver.find_element(By.ID, "count").text  # type: ignore[attr-defined]


def test_a_blocked_step_shows_its_reason_and_the_masks(
    viewer: Viewer, browser: object, recorded: dict[str, object], tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By

    driver = browser
    driver.get(viewer.url + "/?q=demo")  # type: ignore[attr-defined]
    driver.find_element(By.CSS_SELECTOR, "#runs tr.run a").click()  # type: ignore[attr-defined]
    first = element(driver, "#step-1")
    assert "BLOCK" in first.text
    assert "Posture declaration not permitted without successful execution." in first.text
    assert "stopped by: evidence (none, not successful)" in first.text  # the mask, as `cmbs run`
    assert "masks after: evidence none, admissible compliant and non_compliant" in first.text
    assert "termination not allowed" in first.text
    verified = driver.find_element(By.ID, "verification").text  # type: ignore[attr-defined]
    assert verified.startswith("verified against the operator's key")
    # the demo's `echo true`: a posture signal matched, the evidence rule refused it
    refused = driver.find_element(By.CSS_SELECTOR, "#step-8 .refused").text  # type: ignore[attr-defined]
    assert refused.startswith(
        "evidence refused: opa_raw: not one of the signal's evaluators, run as its argument vector"
    )
    assert not driver.find_elements(By.CSS_SELECTOR, "#step-8 .stopped")  # type: ignore[attr-defined]
    shot(driver, tmp_path, "run")
    driver.execute_script(  # type: ignore[attr-defined]
        "arguments[0].scrollIntoView()",
        driver.find_element(By.ID, "step-8"),  # type: ignore[attr-defined]
    )
    shot(driver, tmp_path, "run-refused")


def test_each_step_says_why_as_the_trace_does(
    recorded: dict[str, object], browser: object, tmp_path: Path
) -> None:
    """An agent that ran ``echo false`` (no evaluation) and declared: its page says why the
    output moved no posture and which mask blocked its termination, in the words of the
    trace ``cmbs run --json`` printed."""
    from selenium.webdriver.common.by import By

    scenario, script = tmp_path / "echo.yaml", tmp_path / "echo.jsonl"
    scenario.write_text("id: echo-false\ngoal: Is X11 forwarding off?\ndeadline_s: 60\n")
    script.write_text("\n".join([
        step("check_status", {"command": "echo false"}),
        step("declare_posture", {"posture": "non_compliant"}, posture="non_compliant",
             evidence="successful"),
        step("terminate", posture="non_compliant", evidence="successful"),
    ]) + "\n")  # fmt: skip
    db = tmp_path / "echo.db"
    done = cmbs(
        "run", str(scenario), "--agent", f"script:{script}", "--audit-db", str(db),
        "--signing-key", str(recorded["key"]), "--json",
    )  # fmt: skip
    assert "Traceback" not in done.stderr, done.stderr
    result = json.loads(done.stdout)
    trace = {entry["step"]: entry for entry in result["trace"]}
    assert trace[1]["refused"] and trace[3]["verdict"] == "BLOCK" and trace[3]["stopped_by"]
    running = Viewer(str(db), "--public-key", str(recorded["public"]))
    try:
        driver = browser
        driver.get(f"{running.url}/run/{result['session_id']}")  # type: ignore[attr-defined]
        wait_for(lambda: len(driver.find_elements(By.CSS_SELECTOR, "#steps div.step")) == 3)  # type: ignore[attr-defined]
        for number, entry in trace.items():
            shown = driver.find_element(By.ID, f"step-{number}").text  # type: ignore[attr-defined]
            if entry["refused"]:
                assert f"evidence refused: {entry['refused']}" in shown
            else:
                assert "evidence refused" not in shown
            if entry["stopped_by"]:
                assert f"stopped by: {entry['stopped_by']}" in shown
            else:
                assert "stopped by" not in shown
        first = driver.find_element(By.ID, "step-1").text  # type: ignore[attr-defined]
        assert "not one of the signal's evaluators" in first  # echo is no evaluation
        last = driver.find_element(By.ID, "step-3").text  # type: ignore[attr-defined]
        assert "stopped by: posture admissibility (compliant and non_compliant admissible" in last
        shot(driver, tmp_path, "run-echo-false")
    finally:
        running.close()


def test_a_tampered_database_is_not_verified_and_says_why(
    recorded: dict[str, object], browser: object, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By

    running = Viewer(str(recorded["tampered"]), "--public-key", str(recorded["public"]))
    try:
        driver = browser
        driver.get(running.url + "/?q=demo&sort=started")  # type: ignore[attr-defined]
        driver.find_element(By.CSS_SELECTOR, "#runs tr.run a").click()  # type: ignore[attr-defined]
        said = element(driver, "#verification").text  # type: ignore[attr-defined]
        differences = driver.find_element(By.ID, "differences").text  # type: ignore[attr-defined]
        marked = [r.text for r in driver.find_elements(By.CSS_SELECTOR, "#steps tr.changed")]  # type: ignore[attr-defined]
        shot(driver, tmp_path, "tampered")
    finally:
        running.close()
    assert said.startswith("not verified")
    assert "does not match its hash" in said
    assert "replayed BLOCK" in differences  # the gate, judging again, disagrees
    assert len(marked) == 1 and "ALLOW" in marked[0] and "judged again: BLOCK" in marked[0]


def test_two_runs_side_by_side(viewer: Viewer, browser: object, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    driver = browser
    driver.get(viewer.url + "/?q=demo")  # type: ignore[attr-defined]
    for tick in driver.find_elements(By.CSS_SELECTOR, "#runs input[name=pick]")[:2]:  # type: ignore[attr-defined]
        tick.click()
    driver.find_element(By.ID, "compare-picked").click()  # type: ignore[attr-defined]
    wait_for(lambda: driver.find_elements(By.ID, "diff"))  # type: ignore[attr-defined]
    table = driver.find_elements(By.CSS_SELECTOR, "#diff tbody tr")  # type: ignore[attr-defined]
    assert len(table) == 12  # the demo's twelve steps, aligned
    assert "the same verdict at every step" in driver.find_element(By.ID, "aligned").text  # type: ignore[attr-defined]
    assert not driver.find_elements(By.CSS_SELECTOR, "#diff tr.changed")  # type: ignore[attr-defined]
    assert "Termination accepted." in table[-1].text
    shot(driver, tmp_path, "diff")


def test_a_run_judged_again_under_a_stricter_profile_marks_what_changed(
    recorded: dict[str, object], browser: object, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    stricter = load_profile("ciso").model_dump(mode="json")
    stricter["stability_window"] = 3  # one more agreeing claim before termination
    profile = tmp_path / "stricter.yaml"
    profile.write_text(yaml.safe_dump(stricter))
    running = Viewer(
        str(recorded["db"]), "--public-key", str(recorded["public"]), "--profile", str(profile)
    )
    try:
        driver = browser
        driver.get(running.url + "/?q=demo")  # type: ignore[attr-defined]
        driver.find_element(By.CSS_SELECTOR, "#runs tr.run a").click()  # type: ignore[attr-defined]
        Select(element(driver, "#profile")).select_by_visible_text(str(profile))
        assert not driver.find_elements(By.ID, "rejudged")  # type: ignore[attr-defined]
        driver.find_element(By.ID, "replay").click()  # type: ignore[attr-defined]
        said = element(driver, "#rejudged").text  # type: ignore[attr-defined]
        changed = driver.find_elements(By.CSS_SELECTOR, "#steps tr.changed")  # type: ignore[attr-defined]
        driver.execute_script("arguments[0].scrollIntoView()", changed[0])  # type: ignore[attr-defined]
        shot(driver, tmp_path, "rejudged")
        assert said.startswith(f"Judged again under {profile}: 1 step judged otherwise")
        assert len(changed) == 1
        assert "BLOCK Termination blocked; belief incomplete." in changed[0].text
        assert (
            "stopped by: stability (last claims: unknown, non_compliant, non_compliant; "
            "3 equal and known needed)" in changed[0].text
        )  # this gate's mask, not the record's
        assert "recorded: TERMINATE Termination accepted." in changed[0].text
        driver.find_element(By.LINK_TEXT, "back to the run as recorded").click()  # type: ignore[attr-defined]
        wait_for(lambda: not driver.find_elements(By.CSS_SELECTOR, "#steps tr.changed"))  # type: ignore[attr-defined]
    finally:
        running.close()


def test_a_run_recorded_while_the_page_is_open_appears(
    viewer: Viewer, browser: object, recorded: dict[str, object]
) -> None:
    driver = browser
    driver.get(viewer.url + "/?q=demo")  # type: ignore[attr-defined]
    wait_for(lambda: rows(driver) is not None)
    before = len(rows(driver) or ())
    done = cmbs("demo", "--audit-db", str(recorded["db"]), "--signing-key", str(recorded["key"]))
    assert done.returncode == 0
    wait_for(lambda: len(rows(driver) or ()) == before + 1, seconds=60)  # the page reloaded itself


def test_the_list_filters_on_each_column_and_sorts(
    batched: dict[str, object], recorded: dict[str, object], browser: object, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    solve, lie = batched["agents"]  # type: ignore[misc]
    running = Viewer(str(batched["db"]), "--results", str(batched["results"]),
                     "--public-key", str(recorded["public"]))  # fmt: skip
    driver = browser

    def choose(name: str, label: str, count: int) -> list[str]:
        """Pick ``label`` in the filter ``name`` (the list follows at once): its rows."""
        menu = Select(driver.find_element(By.ID, name))  # type: ignore[attr-defined]
        value = next(o for o in menu.options if o.text == label).get_attribute("value")
        menu.select_by_visible_text(label)
        wait_for(lambda: parse_qs(urlparse(driver.current_url).query).get(name) == [value])  # type: ignore[attr-defined]
        wait_for(lambda: len(rows(driver) or ()) == count and f"{count} of 4 runs" in counted())
        return rows(driver) or []

    def counted() -> str:
        from selenium.common.exceptions import WebDriverException

        try:
            return str(driver.find_element(By.ID, "count").text)  # type: ignore[attr-defined]
        except WebDriverException:
            return ""

    def cells(column: str) -> list[str]:
        index = [
            h.text.rstrip(" ▲▼") for h in driver.find_elements(By.CSS_SELECTOR, "#runs th")
        ].index(column)  # type: ignore[attr-defined]
        return [r.find_elements(By.TAG_NAME, "td")[index].text  # type: ignore[attr-defined]
                for r in driver.find_elements(By.CSS_SELECTOR, "#runs tr.run")]  # type: ignore[attr-defined]  # fmt: skip

    try:
        driver.get(running.url + "/")  # type: ignore[attr-defined]
        wait_for(lambda: len(rows(driver) or ()) == 4)
        assert sorted(cells("Agent")) == sorted([solve, solve, lie, lie])  # from the results
        assert set(cells("Batch")) == {"results.jsonl\nresults line: verified"}
        assert set(cells("IT-Bench")) == {"—"}  # not scored
        assert choose("agent", solve, 2)
        [earned] = choose("outcome", "terminated", 1)
        assert "on" in earned.split() and "non_compliant right" in earned
        driver.find_element(By.ID, "clear").click()  # type: ignore[attr-defined]
        wait_for(lambda: len(rows(driver) or ()) == 4)
        wrong = choose("expected", "answered wrong", 3)
        assert all(" wrong " in row for row in wrong)
        assert len(choose("posture", "none", 3)) == 3  # all three ended with none
        assert len(choose("batch", "results.jsonl", 3)) == 3
        assert choose("pass", "pass", 0) == []
        assert len(choose("pass", "not scored", 3)) == 3
        search = driver.find_element(By.ID, "scenario")  # type: ignore[attr-defined]
        search.send_keys("off")
        driver.find_element(By.ID, "filter").click()  # type: ignore[attr-defined]
        wait_for(lambda: "scenario=off" in driver.current_url)  # type: ignore[attr-defined]
        wait_for(lambda: len(rows(driver) or ()) == 2 and "2 of 4 runs" in counted())
        assert set(cells("Scenario")) == {"off"}
        shot(driver, tmp_path, "runs-filtered")
        driver.find_element(By.ID, "clear").click()  # type: ignore[attr-defined]
        wait_for(lambda: "4 of 4 runs" in counted())
        driver.find_element(By.LINK_TEXT, "Steps").click()  # type: ignore[attr-defined]
        wait_for(lambda: "sort=-steps" in driver.current_url)  # type: ignore[attr-defined]
        wait_for(lambda: "Steps ▼" in element(driver, "#runs thead").text)  # type: ignore[attr-defined]
        steps = [int(n) for n in cells("Steps")]
        assert steps == sorted(steps, reverse=True) and steps[0] == 3  # the solver's three
        driver.find_element(By.PARTIAL_LINK_TEXT, "Steps").click()  # type: ignore[attr-defined]
        wait_for(lambda: "sort=steps" in driver.current_url)  # type: ignore[attr-defined]
        wait_for(lambda: "Steps ▲" in element(driver, "#runs thead").text)  # type: ignore[attr-defined]
        assert [int(n) for n in cells("Steps")] == sorted(steps)
    finally:
        running.close()


def test_the_batch_page_has_the_cli_summary_and_follows_the_batch(
    batched: dict[str, object], recorded: dict[str, object], browser: object, tmp_path: Path
) -> None:
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By

    results = tmp_path / "results.jsonl"
    shutil.copy(str(batched["results"]), results)
    printed = str(batched["printed"]).splitlines()
    running = Viewer("--results", str(results), "--public-key", str(recorded["public"]))
    driver = browser

    def text(selector: str) -> str | None:
        """What the page shows there; ``None`` while it reloads."""
        try:
            return str(driver.find_element(By.CSS_SELECTOR, selector).text)  # type: ignore[attr-defined]
        except WebDriverException:
            return None

    try:
        driver.get(running.url + "/batches")  # type: ignore[attr-defined]
        assert (text("#batch-1 p.lines") or "").startswith(
            "4 lines, one per run: all 4 verify against the operator's key"
        )
        assert text("#batch-1 td.runs") == "4"
        assert text("#batch-1 td.earned") == "0.25 (1/4)"
        assert text("#batch-1 td.accuracy") == "0.25 (1/4)"
        assert text("#batch-1 td.outcomes") == "agent_finished 3, terminated 1"
        # per agent, the numbers `cmbs batch` printed
        start = printed.index(next(line for line in printed if line.startswith("agent ")))
        for line in printed[start + 1 : start + 3]:
            agent, numbers = line.split()[0], " ".join(line.split()[1:])
            shown = driver.find_element(
                By.XPATH, f'//table[@class="agents"]/tbody/tr[td[1]="{agent}"]'
            )  # type: ignore[attr-defined]
            cells = [td.text for td in shown.find_elements(By.XPATH, "./td")][1:4]
            assert " ".join(cells) == numbers
        # the failures, grouped by reason as `cmbs batch` grouped them
        failures = text("#batch-1 table.failures") or ""
        start = next(i for i, line in enumerate(printed) if line.startswith("failures by reason"))
        assert text("#batch-1 h3.failures") == printed[start].replace("failures", "Failures")
        said = [line for line in printed[start + 1 :] if re.match(r"  \w", line)]
        assert said
        for line in said:
            outcome, runs, reason = re.findall(r"  (\w+) \((\d+) runs?\): (.*)", line)[0]
            assert f"{outcome} {runs} {reason.removesuffix('...')}" in failures
        shot(driver, tmp_path, "batch")

        first = json.loads(results.read_text().splitlines()[0])
        with results.open("a") as appended:
            appended.write(unsigned_line(first))
        # the page reloaded: the line shows, apart, and is not counted
        wait_for(lambda: text("#batch-1 tr.unverified td.runs") == "1", seconds=60)
        said = text("#batch-1 p.lines") or ""
        assert said.startswith("5 lines, one per run: 4 verify against the operator's key")
        assert "1 does not (1 unsigned)" in said
        assert text("#batch-1 td.runs") == "4"
        assert "agent_error" not in (text("#batch-1 tr.counted td.outcomes") or "")
        assert "endpoint unreachable" not in (text("#batch-1 table.failures") or "")
        assert text("#batch-1 tr.unverified td.outcomes") == "as written: agent_error 1"
        unsigned = text("#batch-1 div.apart.unsigned") or ""
        assert unsigned.startswith("Unsigned (1)")
        assert "agent_error" in unsigned and "endpoint unreachable" in unsigned
        shot(driver, tmp_path, "batch-after")
    finally:
        running.close()


def test_a_results_line_that_does_not_verify_is_marked_and_not_counted(
    forged: dict[str, object], recorded: dict[str, object], browser: object, tmp_path: Path
) -> None:
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By

    running = Viewer(str(forged["db"]), "--results", str(forged["results"]),
                     "--public-key", str(recorded["public"]))  # fmt: skip
    driver = browser

    def text(selector: str) -> str:
        try:
            return str(driver.find_element(By.CSS_SELECTOR, selector).text)  # type: ignore[attr-defined]
        except WebDriverException:
            return ""

    def marked(said: str) -> list[str]:
        return [row for row in rows(driver) or () if f"results line: {said}" in row]

    try:
        driver.get(running.url + "/batches")  # type: ignore[attr-defined]
        wait_for(lambda: text("#batch-1 p.lines"))
        said = text("#batch-1 p.lines")
        assert said.startswith("5 lines, one per run: 3 verify against the operator's key")
        assert "2 do not (1 changed after signing, 1 unsigned)" in said
        assert "The numbers below count the 3 runs with a line that verifies, not the 2" in said
        assert text("#batch-1 tr.counted td.runs") == "3"  # the edited line is not counted
        assert text("#batch-1 td.earned") == "0.33 (1/3)"
        assert text("#batch-1 tr.counted td.outcomes") == "agent_finished 2, terminated 1"
        assert text("#batch-1 tr.unverified td.runs") == "2"
        apart = text("#batch-1 tr.unverified td.outcomes")
        assert apart.startswith("as written:") and "terminated 1" in apart
        broken = text("#batch-1 div.apart.broken")
        assert broken.startswith("Changed after signing (1)")
        assert str(forged["edited"])[:12] in broken and "terminated" in broken
        assert text("#batch-1 div.apart.unsigned").startswith("Unsigned (1)")
        shot(driver, tmp_path, "batch-unverified")
        driver.execute_script("window.scrollTo(0, document.body.scrollHeight)")  # type: ignore[attr-defined]
        shot(driver, tmp_path, "batch-unverified-apart")

        driver.get(running.url + "/")  # type: ignore[attr-defined]
        wait_for(lambda: len(rows(driver) or ()) == 5)
        [broken_row] = marked("not verified (changed after signing)")
        [unsigned_row] = marked("not verified (unsigned)")
        assert len(marked("verified")) == 3
        assert "no audit run shown" in unsigned_row and "endpoint unreachable" in unsigned_row
        assert "no audit run shown" not in broken_row
        assert "agent_finished" in broken_row  # the run as its audit trail recorded it
        unverified = driver.find_elements(By.CSS_SELECTOR, "#runs tr.unverified")  # type: ignore[attr-defined]
        assert len(unverified) == 2
        driver.execute_script("arguments[0].scrollIntoView()", unverified[0])  # type: ignore[attr-defined]
        shot(driver, tmp_path, "runs-unverified")
        driver.get(running.url + "/?line=unverified")  # type: ignore[attr-defined]
        wait_for(lambda: "2 of 5 runs" in text("#count"))

        driver.get(running.url + f"/run/{forged['edited']}")  # type: ignore[attr-defined]
        wait_for(lambda: text("#results-line"))
        assert text("#verification").startswith("verified against the operator's key")
        assert text("#results-line").startswith(
            "results line: not verified (changed after signing)"
        )
        shot(driver, tmp_path, "run-unverified-line")
        driver.get(running.url + "/?line=verified")  # type: ignore[attr-defined]
        wait_for(lambda: "3 of 5 runs" in text("#count"))
        driver.find_element(By.CSS_SELECTOR, "#runs tr.run a").click()  # type: ignore[attr-defined]
        wait_for(lambda: text("#results-line"))
        assert text("#results-line").startswith("results line: verified")
    finally:
        running.close()


def test_a_batch_retried_says_its_lines_and_its_runs_apart(
    recorded: dict[str, object], browser: object, tmp_path: Path
) -> None:
    """``--retry-errors`` appends a line per try: the batch page counts the lines and the
    runs they are of, and says each run counts from its last line."""
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By

    pack = tmp_path / "pack"
    pack.mkdir()
    for name in ("a", "b"):
        (pack / f"{name}.yaml").write_text(f"id: {name}\ngoal: g\ndeadline_s: 60\n")
    results, db = tmp_path / "retried.jsonl", tmp_path / "retried.db"
    batch = ["batch", str(pack), "--agent", "stdio:false", "--out", str(results),
             "--audit-db", str(db), "--signing-key", str(recorded["key"])]  # fmt: skip
    for again in ([], ["--resume", "--retry-errors"], ["--resume", "--retry-errors"]):
        done = cmbs(*batch, *again)
        assert done.returncode == 3 and "Traceback" not in done.stderr, done.stderr  # errors
    assert len(results.read_text().splitlines()) == 6  # two runs, three tries each
    running = Viewer(str(db), "--results", str(results), "--public-key", str(recorded["public"]))
    driver = browser

    def text(selector: str) -> str:
        try:
            return str(driver.find_element(By.CSS_SELECTOR, selector).text)  # type: ignore[attr-defined]
        except WebDriverException:
            return ""

    try:
        driver.get(running.url + "/batches")  # type: ignore[attr-defined]
        wait_for(lambda: text("#batch-1 p.lines"))
        said = text("#batch-1 p.lines")
        assert said.startswith(
            "6 lines for 2 runs, each counted from its last line (a run retried or resumed has "
            "a line per try): all 6 verify against the operator's key"
        ), said
        assert text("#batch-1 tr.counted td.runs") == "2"
        assert text("#batch-1 tr.counted td.outcomes") == "agent_error 2"
        shot(driver, tmp_path, "batch-retried")
        first = json.loads(results.read_text().splitlines()[0])
        with results.open("a") as appended:
            appended.write(unsigned_line(first))  # a third run, by hand
        wait_for(lambda: text("#batch-1 tr.unverified td.runs") == "1", seconds=60)
        said = text("#batch-1 p.lines")
        assert said.startswith(
            "7 lines for 3 runs, each counted from its last line that verifies (a run retried "
            "or resumed has a line per try): 6 verify against the operator's key"
        ), said
        assert "1 does not (1 unsigned)" in said
        assert "The numbers below count the 2 runs with a line that verifies, not the 1" in said
        assert text("#batch-1 tr.counted td.runs") == "2"
        shot(driver, tmp_path, "batch-retried-unsigned")
    finally:
        running.close()


def test_results_lines_against_another_key_or_none(
    forged: dict[str, object], recorded: dict[str, object], tmp_path: Path
) -> None:
    from cmbs_async.audit import load_or_create_key, public_key_text
    from cmbs_async.audit.log import key_id
    from cmbs_async.view import Library

    results = Path(str(forged["results"]))
    other = public_key_text(load_or_create_key(tmp_path / "other"))
    [batch] = Library([], [results], trusted_key=other).batches()
    assert batch.runs == 0 and batch.lines == 5  # nothing verifies: nothing counted
    assert [(g["check"], g["runs"]) for g in batch.apart] == [("other key", 4), ("unsigned", 1)]
    assert batch.apart[0]["signers"] == [key_id(str(recorded["public"]))]
    unchecked = Library([], [results])
    [batch] = unchecked.batches()
    assert batch.key is None and batch.runs == 5 and batch.unsigned == 1 and not batch.apart
    assert sorted(str(row.line_said) for row in unchecked.runs()) == [
        *["not checked (no key given)"] * 4,
        "not verified (unsigned)",
    ]


def test_a_line_run_again_counts_once_and_the_old_one_says_so(
    forged: dict[str, object], recorded: dict[str, object], tmp_path: Path
) -> None:
    from cmbs_async.audit import load_or_create_key
    from cmbs_async.audit.signing import sign
    from cmbs_async.batch.results import signed_payload
    from cmbs_async.view import Library

    text = Path(str(forged["results"])).read_text()
    edited = next(
        line for line in map(json.loads, text.splitlines())
        if line.get("session_id") == forged["edited"]
    )  # fmt: skip
    again = {k: v for k, v in edited.items() if k != "signature"} | {"outcome": "agent_finished"}
    again["signature"] = sign(load_or_create_key(Path(str(recorded["key"]))), signed_payload(again))
    results = tmp_path / "resumed.jsonl"  # as `cmbs batch --resume` leaves it
    results.write_text(text + json.dumps(again) + "\n")
    [batch] = Library([], [results], trusted_key=str(recorded["public"])).batches()
    assert (batch.runs, batch.lines, batch.earned) == (4, 6, 1)
    assert (batch.all_runs, batch.verified, batch.apart_runs) == (5, 4, 1)
    [broken] = [g for g in batch.apart if g["check"] == "broken"]
    assert [line["again"] for line in broken["shown"]] == [True]


def test_what_a_command_printed_is_shown_never_run(viewer: Viewer, browser: object) -> None:
    from selenium.webdriver.common.by import By

    driver = browser
    driver.get(viewer.url + "/?q=hostile")  # type: ignore[attr-defined]
    driver.find_element(By.CSS_SELECTOR, "#runs tr.run a").click()  # type: ignore[attr-defined]
    element(driver, "#step-1 details.observation summary").click()  # type: ignore[attr-defined]
    shown = driver.find_element(By.CSS_SELECTOR, "#step-1 pre.stdout").text  # type: ignore[attr-defined]
    assert shown == HOSTILE  # the markup, as text
    assert driver.execute_script("return window.hacked === undefined")  # type: ignore[attr-defined]
    assert not driver.find_elements(By.CSS_SELECTOR, "#step-1 img")  # type: ignore[attr-defined]


def shown(page: str) -> str:
    """An exported page's text, as a browser shows it (near enough: no tags)."""
    return html.unescape(re.sub(r"<[^>]*>", "", page))


def test_the_bundle_is_static_pages(recorded: dict[str, object], tmp_path: Path) -> None:
    out = tmp_path / "site"
    done = cmbs("view", str(recorded["db"]), "--export", str(out))
    assert done.returncode == 0, done.stderr
    pages = sorted(p.name for p in (out / "run").iterdir())
    assert len(pages) >= 3 and (out / "index.html").is_file()
    index = (out / "index.html").read_text()
    assert all(f'href="run/{page}"' in index for page in pages)
    assert "<script>window.hacked" not in "".join(p.read_text() for p in (out / "run").iterdir())


def test_the_bundle_has_the_batch_and_its_runs(
    batched: dict[str, object], recorded: dict[str, object], tmp_path: Path
) -> None:
    out = tmp_path / "site"
    done = cmbs("view", str(batched["db"]), "--results", str(batched["results"]),
                "--public-key", str(recorded["public"]), "--export", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    index, batch = (out / "index.html").read_text(), (out / "batches.html").read_text()
    assert index.count('<tr class="run">') == 4 and index.count("results.jsonl") >= 4
    assert index.count("results line: verified") == 4
    assert "0.25 (1/4)" in batch and "Failures by reason (3 runs)" in batch
    assert "4 lines, one per run: all 4 verify against the operator's key" in shown(batch)


def test_the_bundle_keeps_the_marks_of_lines_that_do_not_verify(
    forged: dict[str, object], recorded: dict[str, object], tmp_path: Path
) -> None:
    out = tmp_path / "site"
    done = cmbs("view", str(forged["db"]), "--results", str(forged["results"]),
                "--public-key", str(recorded["public"]), "--export", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    index, batch = (out / "index.html").read_text(), (out / "batches.html").read_text()
    assert index.count('<tr class="run unverified">') == 2
    assert index.count("results line: not verified (changed after signing)") == 1
    assert index.count("results line: not verified (unsigned)") == 1
    assert "5 lines, one per run: 3 verify" in shown(batch)
    assert "Changed after signing (1)" in batch
    assert "Unsigned (1)" in batch and "0.33 (1/3)" in batch
    edited = (out / "run" / f"{forged['edited']}.html").read_text()
    assert "not verified (changed after signing)" in edited
    none = tmp_path / "keyless"
    done = cmbs("view", str(forged["db"]), "--results", str(forged["results"]),
                "--export", str(none), env=keyless(tmp_path / "data"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    batch = (none / "batches.html").read_text()
    assert "The lines were not checked" in shown(batch) and "1 of the lines unsigned" in batch
    assert "results line: not checked (no key given)" in (none / "index.html").read_text()


def test_a_result_line_being_written_shows_once_it_is_whole(tmp_path: Path) -> None:
    from cmbs_async.view import Library

    results = tmp_path / "results.jsonl"
    line = {"key": "a", "scenario_id": "s", "agent": "stdio:agent", "outcome": "terminated"}
    second = json.dumps(line | {"key": "b", "outcome": "agent_error"}) + "\n"
    results.write_text(json.dumps(line) + "\n" + second[:20])  # the batch is writing
    library = Library([], [results])
    assert [row.scenario for row in library.runs()] == ["s"]
    assert library.batches()[0].runs == 1
    with results.open("a") as more:
        more.write(second[20:])
    assert len(library.runs()) == 2
    assert library.batches()[0].outcomes == {"terminated": 1, "agent_error": 1}


def test_off_loopback_a_token_is_needed(recorded: dict[str, object]) -> None:
    running = Viewer(str(recorded["db"]), "--host", "0.0.0.0")  # noqa: S104 - the point
    try:
        assert running.process.stdout is not None
        printed = running.process.stdout.readline()  # where to go, with the token made up
        token = printed.split("?token=")[1].split()[0]
        url = f"http://127.0.0.1:{running.port}/"
        assert httpx.get(url).status_code == 401
        assert httpx.get(url + "?token=wrong").status_code == 401
        allowed = httpx.get(url + f"?token={token}")
        assert allowed.status_code == 200 and re.search(r"\d+ of \d+ runs", allowed.text)
        again = httpx.get(url + "batches", cookies=allowed.cookies)  # the cookie suffices
        assert again.status_code == 200
    finally:
        running.close()


def test_bad_input_is_one_line(tmp_path: Path, recorded: dict[str, object]) -> None:
    (tmp_path / "not.db").write_text("hello")
    (tmp_path / "bad.yaml").write_text("name: [")
    for args in (
        [str(tmp_path / "nope.db")],
        [str(tmp_path / "not.db")],
        [],
        [str(recorded["db"]), "--profile", str(tmp_path / "nope.yaml")],
        [str(recorded["db"]), "--profile", str(tmp_path / "bad.yaml")],
    ):
        done = cmbs("view", *args, "--export", str(tmp_path / "out"))
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_view_alone_shows_the_database_runs_record_into(tmp_path: Path) -> None:
    """``cmbs view`` with nothing named: the default database, or one line saying there
    is none yet."""
    empty = cmbs("view", "--export", str(tmp_path / "none"))
    assert empty.returncode == 2 and "no runs recorded yet" in empty.stderr
    assert empty.stderr.count("\n") == 1
    assert cmbs("demo").returncode == 0
    done = cmbs("view", "--export", str(tmp_path / "site"))
    assert done.returncode == 0, done.stderr
    assert "demo-sshd-x11-forwarding" in (tmp_path / "site" / "index.html").read_text()
