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
	@# the Megatron-Core checkpoint tests' outside judge: 0.19.2 declares Python >= 3.12 yet ships a cp311
	@# wheel (pip on 3.11 would quietly take 0.16.1); it needs only numpy, packaging and torch
	$(PY) -m pip install -q --ignore-requires-python megatron-core==0.19.2
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
	$(PY) -m bench.grid_bench
	$(PY) -m bench.comm_bench
	$(PY) -m bench.dp_vs_ddp
	$(PY) -m bench.cp_memory
	$(PY) -m bench.ray_startup_bench

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
