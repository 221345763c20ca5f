"""Test-only helpers of the real-server suites; the servers themselves are
``scripts/tiny_server_proc.py``'s :class:`TinyServer` (``conftest.py`` puts ``scripts/`` on the
path)."""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator

MODEL_LAYERS = 2  # the tiny model's (fixtures/tiny-deepseek-v32)


def assert_row_bytes(state: Dict, row_bytes: int) -> None:
    """An offload state (``/server_info``) that counts KV rows of ``row_bytes``: its host pool's
    bytes and the bytes loaded host -> device."""
    pool = state["host_pool"]
    assert pool["bytes"] == pool["tokens"] * row_bytes * MODEL_LAYERS, (row_bytes, pool)
    assert state["loaded_bytes"] == state["loaded"] * row_bytes, (row_bytes, state)


@contextlib.contextmanager
def started(*servers) -> Iterator[None]:
    """Servers (anything with ``wait_ready`` and ``stop``) ready, and stopped afterwards."""
    try:
        for server in servers:
            server.wait_ready()
        yield
    finally:
        for server in servers:
            server.stop()
