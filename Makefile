# Quick start: `make demo` and `make test` each set up everything on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-gpu lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Pin torch first when none is importable: the development and CI machines keep a CPU build of
	# 2.13.0 on disk, which pip takes; a torch already in the venv (any build) is kept.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[s3,dev]"
	touch $(STAMP)

demo: setup
	$(VENV)/bin/asynccache bench multiturn

test: setup
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check asynccache kernels storage_backends tests

test-gpu: setup
	$(PY) -m pytest -q -m gpu

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis out
