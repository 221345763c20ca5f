"""KVOffloadConfig parsing and range checks (pure Python, no upstream imports)."""

import dataclasses
import json

import pytest
from sglang.srt.mem_cache.sparsity.kv_offload.config import KVOffloadConfig, KVOffloadConfigError

# The documented defaults (docs/kv_offload.md, "Flags and defaults"), written out by hand.
DOCUMENTED_DEFAULTS = {
    "sparse_slots_per_req": 4096,
    "host_pool_size_gb": 0.0,
    "host_pool_ratio": 1.0,
    "pin_host_memory": True,
    "pd_direct_to_host": False,
    "status_log_interval": 1000,
    "share_host_pool": True,
}


def test_defaults_when_absent():
    assert dataclasses.asdict(KVOffloadConfig.from_json(None)) == DOCUMENTED_DEFAULTS
    for text in ("{}", {}):
        assert dataclasses.asdict(KVOffloadConfig.from_json(text)) == DOCUMENTED_DEFAULTS, text


def test_values_round_trip():
    raw = {
        "sparse_slots_per_req": 8192,
        "host_pool_size_gb": 200,
        "pin_host_memory": False,
        "pd_direct_to_host": True,
        "status_log_interval": 0,
        "share_host_pool": False,
    }
    cfg = KVOffloadConfig.from_json(json.dumps(raw))
    # Every passed value is kept; every other key keeps its default.
    assert dataclasses.asdict(cfg) == {**DOCUMENTED_DEFAULTS, **raw}
    assert dataclasses.asdict(cfg) == {**dataclasses.asdict(KVOffloadConfig()), **raw}
    assert isinstance(cfg.host_pool_size_gb, float)  # JSON 200 is coerced to 200.0
    assert KVOffloadConfig.from_json(raw) == cfg
    ratio = KVOffloadConfig.from_json('{"host_pool_ratio": 2}')
    assert dataclasses.asdict(ratio) == {**DOCUMENTED_DEFAULTS, "host_pool_ratio": 2.0}


@pytest.mark.parametrize(
    "text, needle",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"sparse_slot": 4096}', "unknown key(s) ['sparse_slot']"),
        ('{"prefetch_next_layer": true}', "unknown key(s) ['prefetch_next_layer']"),
        ('{"sparse_slots_per_req": 4000}', "multiple of 64"),
        ('{"sparse_slots_per_req": -64}', "positive multiple of 64"),
        ('{"sparse_slots_per_req": 0}', "positive multiple of 64"),
        ('{"sparse_slots_per_req": "4096"}', "must be a JSON int"),
        ('{"sparse_slots_per_req": 4096.0}', "must be a JSON int"),
        ('{"sparse_slots_per_req": true}', "must be a JSON int"),
        ('{"sparse_pool_slots": 65536}', "sparse_pool_slots is no longer used"),
        ('{"host_pool_size_gb": -1}', "must be a finite number >= 0"),
        ('{"host_pool_ratio": 0.5}', "must be >= 1"),
        ('{"host_pool_size_gb": 10, "host_pool_ratio": 2}', "set only one of them"),
        ('{"pin_host_memory": 1}', "must be a JSON bool"),
        ('{"pd_direct_to_host": "yes"}', "pd_direct_to_host must be a JSON bool"),
        ('{"sparse_slots_per_req": 40000}', "above 32767, the most the GPU LRU can order"),
        ('{"host_pool_size_gb": Infinity}', "must be a finite number >= 0"),
        ('{"host_pool_size_gb": NaN}', "must be a finite number >= 0"),
        ('{"host_pool_ratio": Infinity}', "host_pool_ratio=inf"),
        ("", "is empty"),
        ("   ", "is empty"),
        ('{"sparse_slots_per_req": 4096, "sparse_slots_per_req": 8192}', "more than once"),
    ],
)
def test_rejections_name_the_flag_and_the_problem(text, needle):
    with pytest.raises(KVOffloadConfigError) as info:
        KVOffloadConfig.from_json(text)
    message = str(info.value)
    assert "--kv-offload-config" in message
    assert needle in message


@pytest.mark.parametrize(
    "key, value",
    [("prefetch_next_layer", True), ("prefetch_max_bs", 2), ("h2d_programs_per_req", 4)],
)
def test_removed_keys_are_rejected_with_the_valid_keys(key, value):
    """Keys of removed experiments (JOURNAL.md, "Experiments that left the tree") fail loudly, so an
    old deployment's config is not half applied."""
    with pytest.raises(KVOffloadConfigError) as info:
        KVOffloadConfig.from_json(json.dumps({"sparse_slots_per_req": 4096, key: value}))
    message = str(info.value)
    assert f"--kv-offload-config has unknown key(s) ['{key}']" in message
    assert f"Valid keys: {sorted(DOCUMENTED_DEFAULTS)}" in message


def test_buffer_must_cover_index_topk():
    cfg = KVOffloadConfig.from_json('{"sparse_slots_per_req": 1024}')
    cfg.check(index_topk=1024)
    with pytest.raises(KVOffloadConfigError, match="at least 2048"):
        cfg.check(index_topk=2048)
    with pytest.raises(KVOffloadConfigError, match="at least 2112"):
        cfg.check(index_topk=2050)
