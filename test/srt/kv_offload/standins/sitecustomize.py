"""Installs the test-only kernel stand-ins in every process of the tiny real server.

Active only with ``KV_OFFLOAD_STANDINS=1`` (set by ``scripts/tiny_server.py``); see
``kv_offload_standins.py`` for what each stand-in replaces and ``kv_offload_faults.py`` for the
test-only fault injection switched on by ``KV_OFFLOAD_TEST_*`` variables.
"""

import os

if os.environ.get("KV_OFFLOAD_STANDINS") == "1":
    import kv_offload_faults
    import kv_offload_standins

    kv_offload_faults.register(kv_offload_standins.PATCHES)
    kv_offload_standins.install()
