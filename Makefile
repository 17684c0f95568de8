# raytron: two commands on a fresh machine, `make run` and `make test`.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup run test test-fast bench clean

# Re-installs only when pyproject.toml changed (or the venv is missing).
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	@# setuptools' editable-install notices are advice for package authors, not for someone running make
	PYTHONWARNINGS=ignore $(PY) -m pip install -q -e '.[test]'
	@touch $(STAMP)

setup: $(STAMP)

run: setup
	scripts/run_demo.sh examples/tiny-5d.yaml

test: setup
	sh tests/setup_browser.sh
	$(PY) -m pytest -q

# Pure and single-process tests only (rank math, spec, controller, CLI parsing): seconds.
test-fast: setup
	$(PY) -m pytest -q -m "not slow and not procs and not ray and not gpu"

bench: setup
	$(PY) bench/grid_bench.py
	$(PY) bench/comm_bench.py
	$(PY) bench/dp_vs_ddp.py
	$(PY) bench/cp_memory.py
	$(PY) bench/ray_startup_bench.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
