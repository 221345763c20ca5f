"""CPU test set-up for kv_offload.

``TRITON_INTERPRET`` must be set before any ``@triton.jit`` module is imported, so it is set here,
at collection time. The import-time stand-ins for binary packages are added only where the real
package is missing (see cpu_stubs/README.md).
"""

import importlib.util
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

_HAS_CUDA = False
try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    pass

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(_HERE)))
_STUBS = os.path.join(_HERE, "cpu_stubs")
_needs_stubs = any(importlib.util.find_spec(p) is None for p in ("sgl_kernel",))
if _needs_stubs and _STUBS not in sys.path:
    sys.path.insert(0, _STUBS)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (_STUBS, os.environ.get("PYTHONPATH")) if p
    )

# The server harness the suites import (scripts/: tiny_server, tiny_server_proc, tiny_pd).
sys.path.insert(0, os.path.join(_ROOT, "scripts"))
# The test-only torch references (standins/: kv_offload_standins), last on the path: the folder
# holds a deep_gemm stand-in that must not shadow the real package on the GPU.
sys.path.append(os.path.join(_HERE, "standins"))

# Property tests draw the same examples on every run (CI must not go red on a new random draw);
# HYPOTHESIS_PROFILE=explore draws fresh ones locally.
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def published_cpu_topology():
    """SGLang 0.5.23's pools and allocators read the process's published configuration (parallel
    widths, memory and schedule bags): publish a one-rank CPU topology for every test, as
    upstream's own unit tests do (``sglang.test.test_utils.published_topology``, whose module
    imports benchmark datasets)."""
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    reset_context()
    publish(
        ServerArgs(model_path="dummy", device="cpu"),
        role="test",
        ranks=SpawnRanks(world_rank=0, dp_rank=None),
    )
    try:
        yield
    finally:
        reset_context()
