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

# Two phases (tests/conftest.py's --launches): the tests that start no training on two
# workers (pytest-xdist), then the launches one at a time (each fills both cores).
# PYTEST_ARGS applies to both. pytest exits 5 when a phase collected nothing: one such phase
# is fine, both is a selection that ran no test, which must not pass.
define pytest_phases
	@rc1=0; rc2=0; \
	$(BIN)/python -m pytest -n 2 --dist loadgroup --suite=$(1) --launches=none $(PYTEST_ARGS) || rc1=$$?; \
	$(BIN)/python -m pytest --suite=$(1) --launches=only $(PYTEST_ARGS) || rc2=$$?; \
	if [ $$rc1 -eq 5 ] && [ $$rc2 -eq 5 ]; then \
	  echo "make $@: pytest collected no tests (exit 5); check PYTEST_ARGS='$(PYTEST_ARGS)'" >&2; exit 1; fi; \
	for rc in $$rc1 $$rc2; do [ $$rc -eq 0 ] || [ $$rc -eq 5 ] || exit $$rc; done
endef

test: $(STAMP)
	@scripts/install-ceph.sh
	@scripts/install-rclone.sh
	$(call pytest_phases,test)

# The benchmark smoke runs and the whole-system runs that repeat what `make test` proves.
test-slow: $(STAMP)
	@scripts/install-ceph.sh
	@scripts/install-rclone.sh
	$(call pytest_phases,slow)

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
