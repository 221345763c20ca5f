"""KVOffloadConfig parsing and range checks (pure Python, no upstream imports)."""

import json

import pytest
from sglang.srt.mem_cache.sparsity.kv_offload.config import KVOffloadConfig, KVOffloadConfigError


def test_defaults_when_absent():
    for text in (None, "", "  ", "{}"):
        cfg = KVOffloadConfig.from_json(text)
        assert cfg == KVOffloadConfig()
    assert KVOffloadConfig().sparse_slots_per_req == 4096


def test_values_round_trip():
    raw = {
        "sparse_slots_per_req": 8192,
        "sparse_pool_slots": 65536,
        "host_pool_size_gb": 200,
        "pin_host_memory": False,
        "h2d_programs_per_req": 4,
        "backup_chunk_tokens": 4096,
        "pd_direct_to_host": True,
    }
    cfg = KVOffloadConfig.from_json(json.dumps(raw))
    assert cfg.sparse_slots_per_req == 8192
    assert cfg.sparse_pool_slots == 65536
    assert cfg.host_pool_size_gb == 200.0 and isinstance(cfg.host_pool_size_gb, float)
    assert cfg.pin_host_memory is False
    assert cfg.h2d_programs_per_req == 4
    assert cfg.pd_direct_to_host is True and KVOffloadConfig().pd_direct_to_host is False
    assert KVOffloadConfig.from_json(raw) == cfg


@pytest.mark.parametrize(
    "text, needle",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"sparse_slot": 4096}', "unknown key(s) ['sparse_slot']"),
        ('{"sparse_slots_per_req": 4000}', "multiple of 64"),
        ('{"sparse_slots_per_req": -64}', "positive multiple of 64"),
        ('{"sparse_slots_per_req": 0}', "positive multiple of 64"),
        ('{"sparse_slots_per_req": "4096"}', "must be a JSON int"),
        ('{"sparse_slots_per_req": 4096.0}', "must be a JSON int"),
        ('{"sparse_slots_per_req": true}', "must be a JSON int"),
        ('{"sparse_pool_slots": 100}', "multiple of 64"),
        ('{"sparse_pool_slots": 1024}', "cannot hold even one request"),
        ('{"host_pool_size_gb": -1}', "must be >= 0"),
        ('{"host_pool_ratio": 0.5}', "must be >= 1"),
        ('{"host_pool_size_gb": 10, "host_pool_ratio": 2}', "set only one of them"),
        ('{"pin_host_memory": 1}', "must be a JSON bool"),
        ('{"h2d_programs_per_req": -4}', "must be >= 0"),
        ('{"backup_chunk_tokens": 100}', "multiple of 64"),
        ('{"pd_direct_to_host": "yes"}', "pd_direct_to_host must be a JSON bool"),
    ],
)
def test_rejections_name_the_flag_and_the_problem(text, needle):
    with pytest.raises(KVOffloadConfigError) as info:
        KVOffloadConfig.from_json(text)
    message = str(info.value)
    assert "--kv-offload-config" in message
    assert needle in message


def test_buffer_must_cover_index_topk():
    cfg = KVOffloadConfig.from_json('{"sparse_slots_per_req": 1024}')
    cfg.check(index_topk=1024)
    with pytest.raises(KVOffloadConfigError, match="at least 2048"):
        cfg.check(index_topk=2048)
    with pytest.raises(KVOffloadConfigError, match="at least 2112"):
        cfg.check(index_topk=2050)
