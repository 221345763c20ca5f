# Two entry points; each does all its own set-up on a fresh machine (venv, pinned sdist, patches).
PY ?= python3
VENV := .venv

.PHONY: demo test build check fmt

build:
	$(PY) scripts/kv_offload_tree.py build

demo: build
	$(VENV)/bin/python scripts/demo.py

test: build
	$(VENV)/bin/python -m pytest -q test/srt/kv_offload $(PYTEST_ARGS)

check:
	$(PY) scripts/kv_offload_tree.py check

fmt: build
	$(VENV)/bin/python -m black python test benchmark scripts
	$(VENV)/bin/python -m isort python test benchmark scripts
