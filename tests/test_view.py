"""``cmbs view`` in a real browser (Debian's chromium, driven headless by Selenium through
its chromedriver): the runs list loads and filters, a blocked step shows its reason and
the masks, a tampered database says "not verified" and why, two runs side by side, a run
recorded while the page is open appears, and what an agent's command printed is shown,
never run. Also the exported bundle and the token off loopback."""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .helpers import CMBS, step
from .sshd import free_port

CHROMIUM, DRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"

pytestmark = [
    pytest.mark.skipif(
        not (os.path.exists(CHROMIUM) and os.path.exists(DRIVER)) and not os.environ.get("CI"),
        reason="chromium and chromium-driver are not installed",
    ),
]

HOSTILE = '<script>window.hacked = 1</script><img src=x onerror="window.hacked = 2">'


def cmbs(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CMBS, *args], capture_output=True, text=True, timeout=120, cwd=cwd)


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


class Viewer:
    def __init__(self, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            [*CMBS, "view", *args, "--port", str(self.port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
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


def wait_for(condition: object, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return
        time.sleep(0.2)
    raise AssertionError("not seen in time")


def shot(driver: object, tmp_path: Path, name: str) -> None:
    """Screenshots of every page, kept with the test's files to look at."""
    driver.save_screenshot(str(tmp_path / f"{name}.png"))  # type: ignore[attr-defined]


def rows(driver: object) -> list[str] | None:
    """The list's rows as text; ``None`` while the page is being replaced (a reload)."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    try:
        return [r.text for r in driver.find_elements(By.CSS_SELECTOR, "#runs tr.run")]  # type: ignore[attr-defined]
    except StaleElementReferenceException:
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
    first = driver.find_element(By.ID, "step-1")  # type: ignore[attr-defined]
    assert "BLOCK" in first.text
    assert "Posture declaration not permitted without successful execution." in first.text
    assert "masks after: evidence none, admissible compliant and non_compliant" in first.text
    assert "termination not allowed" in first.text
    verified = driver.find_element(By.ID, "verification").text  # type: ignore[attr-defined]
    assert verified.startswith("verified against the operator's key")
    shot(driver, tmp_path, "run")


def test_a_tampered_database_is_not_verified_and_says_why(
    recorded: dict[str, object], browser: object, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By

    running = Viewer(str(recorded["tampered"]), "--public-key", str(recorded["public"]))
    try:
        driver = browser
        driver.get(running.url + "/?q=demo&sort=started")  # type: ignore[attr-defined]
        driver.find_element(By.CSS_SELECTOR, "#runs tr.run a").click()  # type: ignore[attr-defined]
        said = driver.find_element(By.ID, "verification").text  # type: ignore[attr-defined]
        differences = driver.find_element(By.ID, "differences").text  # type: ignore[attr-defined]
        shot(driver, tmp_path, "tampered")
    finally:
        running.close()
    assert said.startswith("not verified")
    assert "does not match its hash" in said
    assert "replayed BLOCK" in differences  # the gate, judging again, disagrees


def test_two_runs_side_by_side(viewer: Viewer, browser: object) -> None:
    from selenium.webdriver.common.by import By

    first, second = re.findall(r'href="/run/([0-9a-f]+)"', httpx.get(viewer.url + "/?q=demo").text)[
        :2
    ]
    driver = browser
    driver.get(f"{viewer.url}/diff?a={first}&b={second}")  # type: ignore[attr-defined]
    table = driver.find_elements(By.CSS_SELECTOR, "#diff tbody tr")  # type: ignore[attr-defined]
    assert len(table) == 12  # the demo's twelve steps, aligned
    assert not driver.find_elements(By.CSS_SELECTOR, "#diff tr.changed")  # type: ignore[attr-defined]
    assert "Termination accepted." in table[-1].text


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


def test_what_a_command_printed_is_shown_never_run(viewer: Viewer, browser: object) -> None:
    from selenium.webdriver.common.by import By

    driver = browser
    driver.get(viewer.url + "/?q=hostile")  # type: ignore[attr-defined]
    driver.find_element(By.CSS_SELECTOR, "#runs tr.run a").click()  # type: ignore[attr-defined]
    driver.find_element(By.CSS_SELECTOR, "#step-1 details.observation summary").click()  # type: ignore[attr-defined]
    shown = driver.find_element(By.CSS_SELECTOR, "#step-1 pre.stdout").text  # type: ignore[attr-defined]
    assert shown == HOSTILE  # the markup, as text
    assert driver.execute_script("return window.hacked === undefined")  # type: ignore[attr-defined]
    assert not driver.find_elements(By.CSS_SELECTOR, "#step-1 img")  # type: ignore[attr-defined]


def test_the_bundle_is_static_pages(recorded: dict[str, object], tmp_path: Path) -> None:
    out = tmp_path / "site"
    done = cmbs("view", str(recorded["db"]), "--export", str(out))
    assert done.returncode == 0, done.stderr
    pages = sorted(p.name for p in (out / "run").iterdir())
    assert len(pages) >= 3 and (out / "index.html").is_file()
    index = (out / "index.html").read_text()
    assert all(f'href="run/{page}"' in index for page in pages)
    assert "<script>window.hacked" not in "".join(p.read_text() for p in (out / "run").iterdir())


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


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "not.db").write_text("hello")
    for args in ([str(tmp_path / "nope.db")], [str(tmp_path / "not.db")], []):
        done = cmbs("view", *args, "--export", str(tmp_path / "out"))
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
