"""The web console in a real browser: headless Chromium (Debian's ``chromium`` and
``chromium-driver``, installed by ``tests/setup_browser.sh``) driven by selenium against a real
``raytron serve --simulate 2x4`` (local process launcher, 2 nodes x 4 GPU slots).

One server and one browser for the module; the tests run in file order (login first). Each
saves a screenshot under the module's pytest tmp dir (``.../console0/*.png``; the path is
printed), or under ``$RAYTRON_CONSOLE_ARTIFACTS`` when set. Without Chromium, chromedriver or
selenium the module skips and says why.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.helpers.paths import ROOT
from tests.helpers.server import TOKEN, Server, job_losses, tiny, wait_for

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[test]')")
from selenium.common.exceptions import StaleElementReferenceException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

pytestmark = pytest.mark.procs  # a real server process (and its job runners)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
CHROMEDRIVER = shutil.which("chromedriver")
if not (CHROMIUM and CHROMEDRIVER):
    pytest.skip(f"no headless browser: chromium={CHROMIUM}, chromedriver={CHROMEDRIVER}; run "
                f"tests/setup_browser.sh (apt-get install chromium chromium-driver)", allow_module_level=True)

ITERS = 20  # the example's own


def example_spec() -> dict:
    """examples/tiny-5d.yaml (tp 2 x pp 2 x dp 2 on 2 nodes x 4 GPUs) without its checkpoints."""
    spec = yaml.safe_load((ROOT / "examples" / "tiny-5d.yaml").read_text())
    spec["training"]["train_iters"] = ITERS
    spec.pop("checkpoint", None)
    return spec


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Path:
    where = os.environ.get("RAYTRON_CONSOLE_ARTIFACTS")
    path = Path(where) if where else tmp_path_factory.mktemp("console")
    path.mkdir(parents=True, exist_ok=True)
    print(f"console screenshots: {path}")
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("console-serve"), simulate="2x4").start()
    yield srv
    srv.stop()
    srv.kill_runners()
    assert "Traceback" not in srv.log.read_text()


@pytest.fixture(scope="module")
def api(server):
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def browser():
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1200", "--disable-extensions", "--no-first-run"):
        opts.add_argument(arg)
    try:
        driver = webdriver.Chrome(options=opts, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    except Exception as e:  # a broken install: say so rather than fail every test the same way
        pytest.skip(f"chromium would not start under chromedriver: {e}")
    driver.set_script_timeout(30)
    yield driver
    driver.quit()


def wait(driver, condition, timeout=60, message=""):
    # a live page redraws: an element found a moment ago may be gone; look again
    return WebDriverWait(driver, timeout, poll_frequency=0.2, ignored_exceptions=[StaleElementReferenceException]
                         ).until(lambda d: condition(d), message)


def visible(driver, css) -> bool:
    found = driver.find_elements(By.CSS_SELECTOR, css)
    return bool(found) and found[0].is_displayed()


def shoot(driver, artifacts: Path, name: str) -> None:
    """A full-page screenshot: the window grows to the page's height first."""
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1400, max(900, min(height + 40, 4000)))
    driver.save_screenshot(str(artifacts / f"{name}.png"))
    driver.set_window_size(1400, 1200)


def set_spec(driver, text: str) -> None:
    box = driver.find_element(By.ID, "spec")
    box.clear()
    box.send_keys(text)  # typed, as a paste would arrive


def test_login_asks_for_the_token_once_and_keeps_it_out_of_urls(server, browser, artifacts):
    browser.get(server.url + "/")
    wait(browser, lambda d: visible(d, "#login-view"), message="the login form")
    assert not visible(browser, "#jobs-view")
    # Nothing but the shell without the token: the page's own fetch of the API is refused.
    status = browser.execute_async_script(
        "fetch('/api/v1/jobs').then(r => arguments[0](r.status))")
    assert status == 401
    browser.find_element(By.ID, "token").send_keys("wrong-token")
    browser.find_element(By.ID, "login").click()
    wait(browser, lambda d: "Wrong token" in d.find_element(By.ID, "login-error").text)
    assert browser.execute_script("return sessionStorage.getItem('raytron-token')") is None
    browser.find_element(By.ID, "token").send_keys(TOKEN)
    browser.find_element(By.ID, "login").click()
    wait(browser, lambda d: visible(d, "#jobs-view"), message="the jobs page after login")
    assert browser.execute_script("return sessionStorage.getItem('raytron-token')") == TOKEN
    assert TOKEN not in browser.current_url
    browser.refresh()  # asked once: a reload of the tab keeps the session
    wait(browser, lambda d: visible(d, "#jobs-view"), message="the jobs page after a reload")
    assert not visible(browser, "#login-view")
    # every URL the page loaded (shell, scripts, API calls) is free of the token
    urls = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert urls and not any(TOKEN in u for u in urls)
    shoot(browser, artifacts, "jobs-empty")


def test_a_bad_spec_shows_the_422_field_errors(server, browser, api, artifacts):
    bad = example_spec()
    bad["parallel"]["tensor_model_parallel_size"] = 3
    bad["model"]["num_layers"] = 3
    expected = api.post("/jobs", json=bad).json()
    assert expected["code"] == "invalid_spec"
    set_spec(browser, yaml.safe_dump(bad, sort_keys=False))
    browser.find_element(By.ID, "submit-btn").click()
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#spec-errors li"), message="field errors")
    shown = [(li.get_attribute("data-field"), li.text) for li in
             browser.find_elements(By.CSS_SELECTOR, "#spec-errors li")]
    # one line per problem, its field and message as the API gives them
    assert [f for f, _ in shown] == [e["field"] for e in expected["errors"]]  # mutation: errors not listed
    assert all(text == f"{e['field']}: {e['message']}" for (_, text), e in zip(shown, expected["errors"]))
    assert {"resources.num_nodes", "model.num_layers"} <= {f for f, _ in shown} and len(shown) >= 5
    shoot(browser, artifacts, "bad-spec")
    set_spec(browser, "name: [unclosed")  # YAML that does not parse: its line and column
    browser.find_element(By.ID, "submit-btn").click()
    wait(browser, lambda d: "not valid YAML (line 1" in d.find_element(By.ID, "spec-message").text)
    assert api.get("/jobs").json()["count"] == 0  # nothing was stored


def fetched(driver, part: str) -> list[str]:
    """The URLs the page has fetched (since the last performance.clearResourceTimings()) that hold ``part``."""
    return driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name)"
                                 ".filter(u => u.includes(arguments[0]))", part)


def tp_groups_by_node_box(driver, container: str) -> dict[tuple, set[str]]:
    """Every TP group (ranks sharing pp, dp, cp) -> the node boxes its slots are drawn in."""
    slots = driver.execute_script(
        "return [...document.querySelectorAll(arguments[0] + ' .slot[data-rank]')].map(s => ({"
        "rank: +s.dataset.rank, tp: +s.dataset.tp, pp: +s.dataset.pp, dp: +s.dataset.dp, cp: +s.dataset.cp,"
        "node: s.closest('.node').dataset.node, group: s.dataset.group, colour: s.style.background}))", container)
    groups: dict[tuple, set[str]] = {}
    for s in slots:
        groups.setdefault((s["pp"], s["dp"], s["cp"]), set()).add(s["node"])
    return groups, slots


def test_plan_view_shows_the_map_memory_and_traffic(server, browser, api, artifacts, tmp_path):
    spec = example_spec()
    path = tmp_path / "tiny-5d.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    browser.find_element(By.ID, "spec-file").send_keys(str(path))  # an upload
    wait(browser, lambda d: "tiny-5d" in d.find_element(By.ID, "spec").get_attribute("value"))
    browser.find_element(By.ID, "plan-btn").click()
    wait(browser, lambda d: visible(d, "#plan-view") and d.find_elements(By.CSS_SELECTOR, "#plan-map .slot"))
    plan = api.post("/plan", json=spec).json()
    groups, slots = tp_groups_by_node_box(browser, "#plan-map")
    assert len(slots) == plan["world_size"] == 8 and len(groups) == 4
    assert all(len(nodes) == 1 for nodes in groups.values()), groups
    assert {s["rank"]: s["node"] for s in slots} == {p["rank"]: str(p["node"]) for p in plan["placement"]}
    traffic = {row.get_attribute("data-kind"): (
        int(row.find_element(By.CSS_SELECTOR, ".in-node").get_attribute("data-bytes")),
        int(row.find_element(By.CSS_SELECTOR, ".cross-node").get_attribute("data-bytes")))
        for row in browser.find_elements(By.CSS_SELECTOR, "#plan-traffic tr[data-kind]")}
    assert traffic == {k: (v["in_node"], v["cross_node"]) for k, v in plan["traffic"].items()}
    assert traffic["tp"][1] == 0 and traffic["pp"][1] > 0  # TP stays in a node, PP crosses nodes
    memory = [int(td.get_attribute("data-bytes")) for td in browser.find_elements(By.CSS_SELECTOR, "#plan-memory td.total")]
    assert memory == [m["total_bytes"] for m in plan["memory"]]
    shoot(browser, artifacts, "plan")


def test_submit_watch_the_curve_grow_to_succeeded_and_the_placement(server, browser, api, artifacts):
    browser.find_element(By.ID, "submit-btn").click()  # the uploaded example, still in the box
    wait(browser, lambda d: (d.find_element(By.ID, "spec-message").get_attribute("data-job-id") or "").startswith("tiny-5d-"))
    job_id = browser.find_element(By.ID, "spec-message").get_attribute("data-job-id")
    row = f"#jobs tr[data-job-id='{job_id}']"
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, row), message="the new job in the list")
    wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, row).get_attribute("data-state") in ("STARTING", "RUNNING"),
         180, "the job started, in the list")  # the list updates live
    browser.find_element(By.CSS_SELECTOR, f"{row} a").click()
    wait(browser, lambda d: visible(d, "#job-view"))
    assert browser.current_url.endswith(f"#/jobs/{job_id}")
    seen = []  # points on the loss curve, sampled while the job runs
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        values = browser.execute_script(
            "const l = document.querySelector('#charts polyline[data-series=loss]');"
            "return l ? JSON.parse(l.dataset.values) : []")
        seen.append(len(values))
        if browser.find_elements(By.CSS_SELECTOR, "#charts[data-complete=true]"):
            break
        time.sleep(0.2)
    job = api.get(f"/jobs/{job_id}").json()
    assert job["state"] == "SUCCEEDED", job
    assert browser.find_element(By.ID, "job-state").text == "SUCCEEDED"
    line = browser.find_element(By.CSS_SELECTOR, "#charts polyline[data-series=loss]")
    assert json.loads(line.get_attribute("data-values")) == job_losses(api, job_id)  # mutation: the wrong series
    assert json.loads(line.get_attribute("data-iterations")) == list(range(1, ITERS + 1))
    assert len(line.get_attribute("points").split()) == ITERS
    assert seen == sorted(seen) and any(0 < n < ITERS for n in seen), seen  # it grew while the job ran
    events = [(li.get_attribute("data-kind"), li.get_attribute("data-state"), li.text)
              for li in browser.find_elements(By.CSS_SELECTOR, "#events li")]
    states = [state for kind, state, _ in events if kind == "state"]
    assert states == ["QUEUED", "STARTING", "RUNNING", "SUCCEEDED"], events
    assert any(kind == "placement" for kind, _, _ in events)
    wait(browser, lambda d: "SUCCEEDED" in d.find_element(By.ID, "logs").text, 30, "the log tail")
    assert f"iteration {ITERS} loss" in browser.find_element(By.ID, "logs").text

    # the placement map: every TP group's slots in one node box, PP stages across both
    wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#placement-map .slot[data-rank]")) == 8)
    placement = api.get(f"/jobs/{job_id}/placement").json()["ranks"]
    groups, slots = tp_groups_by_node_box(browser, "#placement-map")
    assert len(groups) == 4 and all(len(nodes) == 1 for nodes in groups.values()), groups  # mutation: rank's node
    assert {s["rank"]: s["node"] for s in slots} == {p["rank"]: str(p["node"]) for p in placement}
    by_group = {}
    for s in slots:  # coloured by TP group (the default): one colour per group, a different one per group
        by_group.setdefault(s["group"], set()).add(s["colour"])
    assert len(by_group) == 4 and all(len(c) == 1 for c in by_group.values())
    assert len({next(iter(c)) for c in by_group.values()}) == 4
    stages = {}
    for s in slots:
        stages.setdefault(s["pp"], set()).add(s["node"])
    assert len({n for nodes in stages.values() for n in nodes}) == 2  # the stages span both nodes
    assert not browser.find_elements(By.CSS_SELECTOR, "#placement-map .node.spare, #placement-map .slot.from-spare")
    shoot(browser, artifacts, "job")
    select = browser.find_element(By.CSS_SELECTOR, "#job-view .colour-by")
    options = [o.get_attribute("value") for o in select.find_elements(By.TAG_NAME, "option")]
    assert {"group:tp", "group:pp", "group:dp", "group:cp", "group:ep", "coord:pp"} <= set(options)
    browser.execute_script("arguments[0].value = 'group:pp'; arguments[0].dispatchEvent(new Event('change'))", select)
    _, slots = tp_groups_by_node_box(browser, "#placement-map")
    pp_groups = {}
    for s in slots:
        pp_groups.setdefault(s["group"], set()).add(s["node"])
    assert len(pp_groups) == 4 and all(len(nodes) == 2 for nodes in pp_groups.values())  # PP groups cross nodes
    shoot(browser, artifacts, "job-by-pp")


def test_cancel_a_second_job_from_the_list(server, browser, api, artifacts):
    browser.get(server.url + "/#/")
    wait(browser, lambda d: visible(d, "#jobs-view"))
    set_spec(browser, json.dumps(tiny("long", world=2, iters=10 ** 6)))  # JSON works as well as YAML
    browser.find_element(By.ID, "submit-btn").click()
    # the id of this submission (job ids start with the job's name), not the last one's
    wait(browser, lambda d: (d.find_element(By.ID, "spec-message").get_attribute("data-job-id") or "").startswith("long-"))
    job_id = browser.find_element(By.ID, "spec-message").get_attribute("data-job-id")
    row = f"#jobs tr[data-job-id='{job_id}']"
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, row)
         and d.find_element(By.CSS_SELECTOR, row).get_attribute("data-state") == "RUNNING", 300, "RUNNING")
    wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, f"{row} td.iter").text.split(" /")[0] not in ("", "0"),
         120, "iterations counting up in the list")
    # the page asks for the list alone: its summaries carry every cell (no GET /jobs/{id} per row)
    browser.execute_script("performance.clearResourceTimings()")
    wait(browser, lambda d: len(fetched(d, "/api/v1/jobs?")) >= 2, 30, "two refreshes of the list")
    assert fetched(browser, "/api/v1/jobs/") == []  # mutation: a request per job again
    browser.find_element(By.CSS_SELECTOR, f"{row} button.cancel").click()
    wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, row).get_attribute("data-state") == "CANCELLED", 120,
         "CANCELLED in the list")
    assert wait_for(api, job_id, ("CANCELLED",), timeout_s=5)["state"] == "CANCELLED"
    assert not browser.find_element(By.CSS_SELECTOR, f"{row} button.cancel").is_displayed()
    listed = browser.execute_script(  # one snapshot of the live table
        "return [...document.querySelectorAll('#jobs tbody tr')].map(r => ({id: r.dataset.jobId,"
        "state: r.dataset.state, cells: [...r.cells].map(c => c.textContent)}))")
    assert [r["id"] for r in listed][0] == job_id and len(listed) == 2  # newest first
    finished = api.get(f"/jobs/{listed[1]['id']}").json()
    state, name, _, sizes, iteration, loss, restarts, age, _, owner = listed[1]["cells"]
    assert (state, name, sizes, iteration, restarts, owner) == ("SUCCEEDED", "tiny-5d", "tp2 pp2 dp2 cp1 ep1",
                                                                f"{ITERS} / {ITERS}", "0", "admin")
    assert loss == f"{finished['loss']:.4f}" and age.endswith(("s", "m"))
    shoot(browser, artifacts, "jobs")


def _series(browser, css: str) -> dict[str, tuple[list, list]]:
    """name -> (iterations, values) of every polyline under ``css``."""
    lines = browser.find_elements(By.CSS_SELECTOR, f"{css} polyline[data-series]")
    return {ln.get_attribute("data-series"): (json.loads(ln.get_attribute("data-iterations")),
                                             json.loads(ln.get_attribute("data-values"))) for ln in lines}


def _curve(api, job_id: str, name: str) -> tuple[list, list]:
    page = api.get(f"/jobs/{job_id}/metrics", params={"names": name, "points": 500}).json()
    pairs = [(it, v) for it, v in zip(page["iterations"], page[name]) if v is not None]
    return [it for it, _ in pairs], [v for _, v in pairs]


def test_throughput_chart_and_two_jobs_compared(server, browser, api, artifacts):
    """The job page draws tokens/s as the API reports it (and no loss scale: not fp16). Its Compare
    box, and the jobs page's ticks, open #/compare/A,B, where both jobs' loss and throughput share
    one chart each, one series per job, equal to their curves."""
    jobs = [j for j in api.get("/jobs").json()["jobs"] if j["iteration"] > 0]
    assert len(jobs) >= 2, jobs  # the finished job and the cancelled one (cancelled after it counted up)
    first, second = jobs[-1]["id"], jobs[0]["id"]
    browser.get(f"{server.url}/#/jobs/{first}")
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#charts .chart[data-chart=tokens_per_s] polyline"),
         60, "the throughput chart")
    drawn = _series(browser, "#charts .chart[data-chart=tokens_per_s]")
    assert drawn == {"tokens_per_s": _curve(api, first, "tokens_per_s")}  # mutation: another series plotted
    charts = [c.get_attribute("data-chart") for c in browser.find_elements(By.CSS_SELECTOR, "#charts .chart")]
    assert "loss_scale" not in charts and "loss" in charts, charts  # an fp32 job: no loss-scale chart
    shoot(browser, artifacts, "job-throughput")

    box = browser.find_element(By.ID, "compare-with")
    box.send_keys(second)
    browser.find_element(By.CSS_SELECTOR, "#compare-form button, #compare-form [type=submit]").click()
    wait(browser, lambda d: d.current_url.endswith(f"#/compare/{first},{second}"), 30, "the compare URL")
    wait(browser, lambda d: visible(d, "#compare-view"), 30, "the compare view")
    for name in ("loss", "tokens_per_s"):
        css = f"#compare-charts .chart[data-chart={name}]"
        wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, f"{css} polyline")) == 2, 60, f"two {name} series")
        assert _series(browser, css) == {first: _curve(api, first, name), second: _curve(api, second, name)}
    shoot(browser, artifacts, "compare")

    # the same from the jobs page: tick both rows, then its Compare button (newest first, as listed)
    browser.get(f"{server.url}/#/")
    wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#jobs tbody tr input.pick")) >= 2, 60, "the ticks")
    assert not browser.find_element(By.ID, "compare-picked").is_enabled()
    for job_id in (first, second):
        browser.find_element(By.CSS_SELECTOR, f"#jobs tr[data-job-id='{job_id}'] input.pick").click()
    button = browser.find_element(By.ID, "compare-picked")
    assert button.is_enabled() and button.text == "Compare 2 jobs"
    button.click()
    wait(browser, lambda d: d.current_url.endswith(f"#/compare/{second},{first}"), 30, "the compare URL from the list")
    wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#compare-charts .chart[data-chart=loss] polyline"))
         == 2, 60, "both jobs' loss")


def test_the_user_logged_in_and_an_owner_column_for_admins(server, browser, api, artifacts):
    """Teams (issue 22): the header names the token's user; an admin's jobs table has an owner
    column, a user's has none and lists only their own jobs."""
    api.post("/jobs", json={**tiny("teams-admin-job", world=1, iters=1)})
    token = api.post("/users", json={"name": "console-user"}).json()["token"]

    def log_in(as_token: str) -> None:
        browser.get(f"{server.url}/#/")
        browser.execute_script("sessionStorage.setItem('raytron-token', arguments[0])", as_token)
        browser.refresh()
        wait(browser, lambda d: visible(d, "#jobs-view"), message="the jobs page")

    log_in(token)
    wait(browser, lambda d: d.find_element(By.ID, "whoami").text == "console-user", 30, "the user's name")
    assert not visible(browser, "#jobs th.owner-col")  # mutation: the column shown to everyone
    assert not browser.find_elements(By.CSS_SELECTOR, "#jobs tbody tr")  # the admin's jobs are not theirs
    shoot(browser, artifacts, "teams-user")
    log_in(TOKEN)
    wait(browser, lambda d: d.find_element(By.ID, "whoami").text == "admin (admin)", 30, "the admin's name")
    wait(browser, lambda d: visible(d, "#jobs th.owner-col"), 30, "the owner column")
    # inside a wait: the list redraws as it polls, so a row found a moment ago may be gone or not drawn yet
    wait(browser, lambda d: (cells := d.find_elements(By.CSS_SELECTOR, "#jobs tbody tr td.owner-col"))
         and all(c.is_displayed() and c.text == "admin" for c in cells), 30, "every row's owner: admin")
    shoot(browser, artifacts, "teams-admin")


def test_hot_spares_on_the_placement_map_and_in_the_header(server, browser, api, artifacts):
    """Hot spares (resources.spare_nodes): the Ray launcher keeps them, and this server runs local
    processes, so the job's runner is this test: it writes the events a runner writes, through the
    job store, into the server's own database (a job over its owner's GPU quota, so that the
    scheduler never launches it): STARTING, the placement of the finished tiny-5d job's reported
    records with the ranks of node 1 restarted on a spare (``"spare": true``) and one spare node
    left with 3 of its 4 actors up, RUNNING. The map draws the spare node apart from the ranks'
    nodes (a "spare" box, its actors up or starting) and marks the restarted ranks; the header
    lists the job's spare nodes while it runs."""
    from service.control.events import JobEvent, JobState
    from service.server.store import JobStore, sqlite_url

    done = next(j for j in api.get("/jobs").json()["jobs"] if j["name"] == "tiny-5d")
    assert api.post("/users", json={"name": "spare-owner", "gpu_quota": 1}).status_code == 201
    store = JobStore(sqlite_url(server.data_dir))
    try:
        node_of = {r["rank"]: str(r["node"]) for r in api.get(f"/jobs/{done['id']}/placement").json()["ranks"]}
        moved = sorted(rank for rank, node in node_of.items() if node == "1")
        records = [{**r, "spare": r["rank"] in moved}
                   for r in store.events(done["id"], kind="placement")[-1]["data"]["placement"]]
        spares = [{"bundle": 2, "node_id": "spare-node-2", "actors": 4, "ready": 3}]
        spec = {**example_spec(), "name": "spared"}
        spec["resources"] = {**spec["resources"], "spare_nodes": 1}
        job_id = store.create_job(spec, owner="spare-owner", sizes=store.get_job(done["id"])["sizes"])["id"]
        store.update_job(job_id, state=JobState.STARTING.value, message="placing ranks")
        store.append_event(job_id, JobEvent.now("placement", JobState.STARTING, f"{len(records)} ranks placed",
                                                {"placement": records, "spares": spares}).to_dict())
        store.update_job(job_id, state=JobState.RUNNING.value, message="training")
        view = api.get(f"/jobs/{job_id}/placement").json()
        assert [{k: sp[k] for k in spares[0]} for sp in view["spares"]] == spares
        assert [r["rank"] for r in view["ranks"] if r["spare"]] == moved and len(moved) == 4

        browser.get(f"{server.url}/#/jobs/{job_id}")
        wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#placement-map .node.spare"), 30, "the spare node")
        boxes = browser.find_elements(By.CSS_SELECTOR, "#placement-map .node.spare")
        assert [(b.get_attribute("data-spare-bundle"), b.get_attribute("data-node"), b.get_attribute("data-actors"),
                 b.get_attribute("data-ready")) for b in boxes] == [("2", "spare-node-2", "4", "3")]
        box = boxes[0]
        assert box.find_element(By.CSS_SELECTOR, ".node-title .tag").text == "spare"
        assert not box.find_elements(By.CSS_SELECTOR, ".slot[data-rank]")  # no rank drawn in a spare node
        assert len(box.find_elements(By.CSS_SELECTOR, ".slot.spare-actor.up")) == 3
        assert len(box.find_elements(By.CSS_SELECTOR, ".slot.spare-actor.starting")) == 1
        assert box.value_of_css_property("border-top-style") == "dashed"  # drawn unlike the ranks' nodes
        ranks = browser.find_elements(By.CSS_SELECTOR, "#placement-map .node:not(.spare) .slot[data-rank]")
        assert len(ranks) == 8
        marked = sorted(int(s.get_attribute("data-rank")) for s in ranks if s.get_attribute("data-spare") == "true")
        assert marked == moved  # mutation: the spare flag not drawn
        assert all("from-spare" in s.get_attribute("class") and "from spare" in s.text
                   for s in ranks if int(s.get_attribute("data-rank")) in marked)
        wait(browser, lambda d: visible(d, "#cluster-spares"), 30, "the header's hot spares")
        link = browser.find_element(By.CSS_SELECTOR, f"#cluster-spares a.spares-of[data-job-id='{job_id}']")
        assert (link.get_attribute("data-nodes"), link.get_attribute("data-ready"), link.get_attribute("data-actors")) \
            == ("1", "3", "4") and link.get_attribute("href").endswith(f"#/jobs/{job_id}")
        assert [sp["job_id"] for sp in api.get("/cluster").json()["spares"]] == [job_id]
        shoot(browser, artifacts, "job-spares")
        store.update_job(job_id, state=JobState.CANCELLED.value, message="cancelled by the test")
        browser.get(f"{server.url}/#/")  # a finished job's spares leave the header
        wait(browser, lambda d: visible(d, "#jobs-view"))
        wait(browser, lambda d: not visible(d, "#cluster-spares"), 30, "no hot spares in the header")
    finally:
        store.close()
