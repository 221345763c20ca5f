# Two entry points; each does all its own set-up on a fresh machine (venv, pinned wheel, patches).
PY ?= python3
VENV := .venv

.PHONY: demo test test-fast build check fmt serve-tiny serve-tiny-pd

build:
	$(PY) scripts/kv_offload_tree.py build

demo: build
	$(VENV)/bin/python scripts/demo.py

# The real `python -m sglang.launch_server` on a tiny random-weight DeepSeek-V3.2 (CPU here, GPU where
# there is one); ARGS go to launch_server unchanged, e.g. ARGS="--port 30000 --enable-kv-offload".
serve-tiny: build
	$(VENV)/bin/python scripts/tiny_server.py $(ARGS)

# A PD pair on the tiny model: prefill + decode servers (Mooncake over TCP on loopback) and the mini
# load balancer on PORT; ARGS go to both servers, DECODE_ARGS to the decode server only, e.g.
# DECODE_ARGS="--enable-kv-offload --kv-offload-config '{\"pd_direct_to_host\": true}'".
PORT ?= 30000
serve-tiny-pd: export TINY_PD_ARGS = $(ARGS)
serve-tiny-pd: export TINY_PD_DECODE_ARGS = $(DECODE_ARGS)
serve-tiny-pd: build
	$(VENV)/bin/python scripts/tiny_pd.py --port $(PORT)

# Everything, the real-server and PD suites included (what .ci/run runs).
test: build
	$(VENV)/bin/python -m pytest -q test/srt/kv_offload $(PYTEST_ARGS)

# A contributor's first check: everything but the real-server suites (tests marked slow).
test-fast: build
	$(VENV)/bin/python -m pytest -q test/srt/kv_offload -m "not slow" $(PYTEST_ARGS)

check:
	$(PY) scripts/kv_offload_tree.py check

fmt: build
	$(VENV)/bin/python -m black python test benchmark scripts
	$(VENV)/bin/python -m isort python test benchmark scripts
