# The README's commands. Each creates .venv on first use (Python 3.11: the CPU build of
# torch 2.13.0 on this kind of machine is for 3.11) and reinstalls when setup.cfg changes.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.rtp-installed
PYTEST_ARGS ?=
DEMO_ARGS ?=

.PHONY: help demo test test-slow lint format golden bench clean

help:
	@echo "make demo   - set up .venv and run the whole pipeline locally (rtp local)"
	@echo "make test   - set up .venv and run the test suite"
	@echo "make test-slow - the benchmark smoke runs and whole-system repeats (CI runs both)"
	@echo "make lint   - ruff + mypy + lint-imports (the layering in pyproject.toml)"
	@echo "make golden - regenerate the compiled-pipeline golden file and the job examples after an intended change"
	@echo "make clean  - remove .venv and rtp-work"

$(STAMP): setup.cfg pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info[:2] >= (3, 11) else "rtp needs Python >= 3.11; set PYTHON=python3.11")'
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/rtp local $(DEMO_ARGS)

# One pytest session on two workers (pytest-xdist), whole modules to a worker (a module's
# shared runs are made once; tests/conftest.py orders the modules that launch training
# first). A launch rarely fills both cores: its ranks wait on each other, on timeouts and on
# files, and the other worker's tests run meanwhile. PYTEST_ARGS is added to the command.
define pytest_suite
	$(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder --suite=$(1) $(PYTEST_ARGS)
endef

test: $(STAMP)
	@scripts/install-ceph.sh
	@scripts/install-rclone.sh
	$(call pytest_suite,test)

# The benchmark smoke runs and the whole-system runs that repeat what `make test` proves.
test-slow: $(STAMP)
	@scripts/install-ceph.sh
	@scripts/install-rclone.sh
	$(call pytest_suite,slow)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

golden: $(STAMP)
	RTP_UPDATE_GOLDEN=1 $(BIN)/python -m pytest -q tests/pipelines/test_compile.py -k golden
	@# The job examples in deploy/eks are rendered by the command on their third line.
	@for f in deploy/eks/pytorchjob-example.yaml deploy/eks/trainjob-example.yaml; do \
	  head -3 $$f > $$f.new && eval "$(BIN)/python -m rtp_cli.main $$(sed -n 3p $$f | sed 's/^# rtp //') -o -" >> $$f.new \
	  && mv $$f.new $$f || { rm -f $$f.new; exit 1; }; done

bench: $(STAMP)
	$(BIN)/python -m benchmarks.demo_pipeline

clean:
	rm -rf $(VENV) rtp-work
