# Two commands on a fresh machine:
#   make train   # create .venv, install, train the debug model on the bundled corpus (CPU or GPU)
#   make test    # create .venv, install, run the whole test suite
# Pass trainer flags with ARGS, e.g. make train ARGS="--training.steps 20".

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch first, pinned, so pip does not resolve the newest (CUDA) build through a dependency.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
ARGS ?=
# Test files run in this many processes at once (pytest-xdist, a file's tests in one process:
# module fixtures such as the numerics launches run once). One file alone leaves a third of two
# cores idle (launcher start-up, one-process reference runs, waits for signals and timeouts).
TEST_WORKERS ?= 2

.PHONY: setup train test test-torch2.11 lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@echo "[1/3] creating $(VENV)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@echo "[2/3] installing $(TORCH_SPEC) (the largest download, a few minutes)"
	@# A progress bar on a terminal; in a log (CI) it would print thousands of lines.
	$(PY) -m pip install $$([ -t 1 ] && echo --progress-bar on || echo --quiet) "$(TORCH_SPEC)"
	@echo "[3/3] installing torchtitan and its dependencies"
	$(PY) -m pip install --quiet -e ".[dev,float8]"
	@echo "done: $(VENV) is ready"
	touch $(STAMP)

train: $(STAMP)
	PYTHON=$(PY) ./run_train.sh --validation.sample_prompt "The " $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q --durations=15 -n $(TEST_WORKERS) --dist loadfile tests

lint: $(STAMP)
	$(VENV)/bin/ruff check torchtitan tests scripts benchmarks
	$(VENV)/bin/ruff format --check torchtitan tests scripts benchmarks

# The oldest torch we support (what the lent GPU machines run), on CPU: PyPI's torch 2.11 wheel
# is its CUDA build (a few GB); torchao 0.17 is the release built for it. Not part of CI.
VENV211 ?= .venv-torch2.11
$(VENV211)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV211)
	$(VENV211)/bin/python -m pip install --quiet --upgrade pip
	$(VENV211)/bin/python -m pip install --quiet "torch==2.11.0" "torchao==0.17.*"
	$(VENV211)/bin/python -m pip install --quiet -e ".[dev]"
	touch $@

test-torch2.11: $(VENV211)/.installed
	$(VENV211)/bin/python -m pytest -q --durations=15 -n $(TEST_WORKERS) --dist loadfile tests

clean:
	rm -rf $(VENV) $(VENV211) outputs .pytest_cache
