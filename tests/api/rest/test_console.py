"""The web console's server side, without a browser: what is served without the token, the YAML
helper, and that a non-editable install ships the static files. The page itself is tested in a
real browser by ``test_console_browser.py``."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile

import httpx
import pytest

from tests.helpers.paths import ROOT
from tests.helpers.server import TOKEN, module_server

STATIC = ["index.html", "console.css", "console.js", "api.js", "plot.js", "placement.js"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from module_server(tmp_path_factory, "console-api", clean_log=False)


@pytest.mark.procs
def test_the_shell_and_its_files_need_no_token_and_hold_no_data(server):
    shell = httpx.get(f"{server.url}/")
    assert shell.status_code == 200 and shell.headers["content-type"].startswith("text/html")
    assert '<script type="module" src="/static/console.js">' in shell.text
    for name in STATIC:  # every file the shell loads, with a type the browser accepts
        r = httpx.get(f"{server.url}/static/{name}")
        assert r.status_code == 200, name  # mutation: StaticFiles not mounted -> 404
        kind = {"html": "text/html", "css": "text/css", "js": "javascript"}[name.rsplit(".", 1)[1]]
        assert kind in r.headers["content-type"], (name, r.headers["content-type"])
    for asset in ["index.html", "console.js", "api.js"]:  # offline: nothing loaded from elsewhere
        text = httpx.get(f"{server.url}/static/{asset}").text
        assert "http://" not in text.replace("http://www.w3.org/2000/svg", "") and "https://" not in text
    # the data is not: the API, the YAML helper and the metrics all want the token
    for method, path in [("GET", "/api/v1/jobs"), ("POST", "/console/yaml"), ("GET", "/metrics")]:
        assert httpx.request(method, server.url + path, content=b"a: 1").status_code == 401, path
    assert httpx.get(f"{server.url}/static/../app.py").status_code == 404
    assert httpx.get(f"{server.url}/static/%2e%2e/app.py").status_code == 404


@pytest.mark.procs
def test_the_yaml_helper_reads_yaml_and_json_and_points_at_errors(server):
    headers = {"Authorization": f"Bearer {TOKEN}"}
    spec = (ROOT / "examples" / "tiny-5d.yaml").read_text()
    r = httpx.post(f"{server.url}/console/yaml", content=spec, headers=headers)
    assert r.status_code == 200 and r.json()["spec"]["parallel"]["tensor_model_parallel_size"] == 2
    assert httpx.post(f"{server.url}/console/yaml", content='{"name": "x"}', headers=headers).json() == {
        "spec": {"name": "x"}}
    r = httpx.post(f"{server.url}/console/yaml", content="name: x\nmodel: [1,\n", headers=headers)
    assert r.status_code == 400 and r.json()["code"] == "invalid_yaml"
    assert "(line 3, column 1)" in r.json()["message"]  # mutation: problem_mark dropped -> no line
    r = httpx.post(f"{server.url}/console/yaml", content=b"a" * (2 << 20), headers=headers)
    assert r.status_code == 413  # the body limit holds here too


@pytest.mark.slow
def test_a_wheel_ships_the_static_files(tmp_path):
    """A non-editable install: the built wheel holds api/rest/static/* and api/rest/routes/console.py."""
    # a copy of the sources: a build in the checkout would leave build/ there, whose stale files
    # a later wheel could pick up
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__",
                                                              ".pytest_cache", "raytron-data"))
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path), str(src)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    wheel = next(tmp_path.glob("raytron-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    # mutation: package-data line for api removed -> the static files are missing
    assert {f"api/rest/static/{n}" for n in STATIC} <= names, sorted(n for n in names if n.startswith("api/"))
    assert "api/rest/routes/console.py" in names
