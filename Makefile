# The two commands of the README. Both create the virtual environment they need.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
# The torch build this repository is tested with (the range in pyproject.toml is wider).
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1
CONFIG ?= examples/resnet152.yaml

.PHONY: demo test lint clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_SPEC)
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

## demo: run the default example end to end (CPU when there is no GPU)
demo: $(VENV)/.installed
	$(VENV)/bin/mutwo-opt --check $(CONFIG)

# Test processes (pytest-xdist); each takes a test when it is free, so one long test does not
# hold back a file's others (the suite: about 20 minutes with two on a two-core machine); each runs torch
# on one thread (tests/conftest.py), and the longest tests (marked slow) start first.
TEST_WORKERS ?= 2

## test: the test suite (CUDA tests are skipped without a GPU)
test: $(VENV)/.installed
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check mutwo mutwo_ir passes runtime tools tests bench examples

clean:
	rm -rf $(VENV) mutwo-out .pytest_cache
