"""``bench_capacity.py sizing``: the product's sizing code against what the GPU servers ran."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmark" / "kv_offload"))
import bench_capacity  # noqa: E402
from sglang.srt.mem_cache.sparsity.kv_offload.device_pool import (  # noqa: E402
    LOGICAL_LOC_STATE_BYTES,
    size_arena,
)

FP8_ROW, INDEX_ROW, LAYERS = 656, 132, 4  # the H100 serving runs' 4-layer DeepSeek-V3.2 shapes


def _h100_point(max_total_tokens, prompt, output):
    """A point of the 2026-12-07 H100 runs (``bench_serving_dsa.py --layers 4``, fp8 KV, 4096
    sparse slots): the arena the flag-on server built from the flag-off ``--max-total-tokens``."""
    budget = max_total_tokens * (FP8_ROW + INDEX_ROW) * LAYERS
    sizing = size_arena(
        budget, LAYERS, FP8_ROW, INDEX_ROW, 64, logical_loc_bytes=LOGICAL_LOC_STATE_BYTES
    )
    point = bench_capacity.sizing_point(
        sizing, max_total_tokens, prompt + output, 4096, 2, prompt_len=prompt
    )
    return sizing, point


def test_staging_bounds_the_128k_batch_as_measured():
    """128K in / 2K out, ``--max-total-tokens 266368``: the server logged 147 arena units and a
    logical capacity of 1,532,416 tokens, held 2 requests without the flag, and ran 5 at once with
    it (each new prompt staged only when a running request ended) where 10 fit once staged."""
    sizing, point = _h100_point(266368, 131072, 2048)
    assert sizing.layout.num_units == 147 and sizing.logical_tokens == 1532416
    assert point["flag_off_requests"] == 2 and point["flag_on_requests"] == 10
    assert point["flag_on_running_while_staging"] == 5


def test_the_staging_bound_is_not_above_what_a_burst_ran():
    """The bound counts every running request's index keys at its final length; upstream admits
    against fewer while they decode, so a burst may run more than it (27 at 32K / 4K, where it
    says 25), never more than fit once staged (the 128K point, where they are equal, is above)."""
    _, point = _h100_point(279040, 32768, 4096)
    assert point["flag_on_running_while_staging"] <= 27 <= point["flag_on_requests"]


def test_a_resident_request_stages_in_its_own_rows():
    """A request that stays on the GPU stages in the rows it keeps: no bound beyond its fit."""
    _, point = _h100_point(279040, 1024, 1024)
    assert point["mode"] == "resident"
    assert point["flag_on_running_while_staging"] == point["flag_on_requests"]
