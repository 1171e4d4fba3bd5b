# Quick start: `make demo` and `make test` each set up everything on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-gpu bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Install the CPU build of torch first when none is importable (a plain `torch` would pull CUDA).
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[s3,dev]"
	touch $(STAMP)

demo: setup
	$(VENV)/bin/asynccache bench multiturn

test: setup
	$(PY) -m pytest -q

test-gpu: setup
	$(PY) -m pytest -q -m gpu

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis out
