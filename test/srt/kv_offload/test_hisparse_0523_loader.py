"""CPU checks of loader.py's pure-Python parts (no GPU, no nvcc, no tvm_ffi needed).

    HISPARSE_0523_SRC=/tmp/sg0523/src python -m pytest -q test/srt/kv_offload/test_hisparse_0523_loader.py

Skipped without ``HISPARSE_0523_SRC`` (an unpacked sglang 0.5.23 wheel, or ``loader.py extract``).
What is checked: 0.5.23's own hisparse.py runs against the shim; the coordinator-style call reaches
the JIT module with 0.5.23's module args, wrapper name and the 18 positional kernel arguments; the
block-size scan model flags 256 and passes 960.
"""

from __future__ import annotations

import os
import pathlib
import sys

import pytest

sys.path.insert(
    0,
    str(pathlib.Path(__file__).resolve().parents[3] / "benchmark" / "kv_offload" / "hisparse_0523"),
)
import loader  # noqa: E402

SRC = os.environ.get("HISPARSE_0523_SRC")
needs_src = pytest.mark.skipif(not SRC, reason="HISPARSE_0523_SRC not set")


def test_scan_model_blocks():
    bad = loader.scan_report(256)
    good = loader.scan_report(960)
    assert not bad["hit"]["ok"] and bad["evict"]["out_of_range"]
    assert all(good[k]["ok"] and not good[k]["out_of_range"] for k in ("hit", "evict", "miss"))
    for bs in (512, 640, 768, 896, 960, 1024):
        r = loader.scan_report(bs)
        assert all(r[k]["ok"] for k in ("hit", "evict", "miss")), bs
    for bs in (32, 64, 128, 256, 384, 480):
        r = loader.scan_report(bs)
        assert not all(r[k]["ok"] for k in ("hit", "evict", "miss")), bs


@needs_src
def test_coordinator_call_reaches_kernel(monkeypatch):
    torch = pytest.importorskip("torch")
    calls = {}

    class FakeModule:
        def load_cache_to_device_buffer(self, *args):
            calls["args"] = args

    def fake_build(src_root, module_args, **kw):
        calls["module_args"] = tuple(str(a) for a in module_args)
        calls["kw"] = kw
        return pathlib.Path("/nonexistent.so")

    monkeypatch.setattr(loader, "build_module", fake_build)
    monkeypatch.setattr(loader, "_load_so", lambda so: FakeModule())
    loader._OPS_CACHE.clear()
    ops = loader.load_ops(SRC, arch="90a")
    assert ops.__file__.endswith("sglang/kernels/ops/kvcache/hisparse.py")

    R, S, page, K, ctx, row, L = 3, 64, 64, 32, 256, 656, 2
    toks = torch.full((L, R, S + page), -1, dtype=torch.int32)
    locs = torch.full((L, R, S + page), -1, dtype=torch.int32)
    lru = torch.arange(S, dtype=torch.int16).view(1, 1, -1).repeat(L, R, 1).contiguous()
    host_pool = torch.full((R, ctx + page), -1, dtype=torch.int64)
    host_kv = torch.zeros((L, R * ctx, 1, row), dtype=torch.uint8)
    dev_kv = torch.zeros((L, R * (S + page), 1, row), dtype=torch.uint8)
    out_buf = torch.full((R, K), -1, dtype=torch.int32)
    rpi = torch.arange(2, dtype=torch.int64)
    seq = torch.full((2,), ctx, dtype=torch.int64)
    topk = torch.randint(0, ctx, (2, K), dtype=torch.int32)
    n = torch.tensor([2], dtype=torch.int32)
    out = loader.coordinator_swap_in(
        ops,
        top_k_result=topk,
        req_device_buffer_tokens_layer=toks[1],
        req_to_host_pool=host_pool,
        req_device_buffer_token_locs_layer=locs[1],
        host_kv_buffer_layer=host_kv[1],
        device_kv_buffer_layer=dev_kv[1],
        top_k_device_locs_buffer=out_buf,
        req_pool_indices=rpi,
        seq_lens=seq,
        lru_slots_layer=lru[1],
        num_real_reqs=n,
        item_size_bytes=row,
        top_k=K,
        device_buffer_size=S,
    )
    assert calls["module_args"] == (
        "sparse_cache", str(row), "960", str(K), str(S), "true", "false", "1", "false", "false", "false",
    )  # fmt: skip
    assert calls["kw"]["cuda_files"] == ["kvcacheio/hisparse.cuh"]
    assert calls["kw"]["cuda_wrappers"] == [
        ("load_cache_to_device_buffer",
         f"load_cache_to_device_buffer<960, {K}, {S}, true, false, 1, false, false, false>")
    ]  # fmt: skip
    a = calls["args"]
    assert len(a) == 18
    assert a[0] is topk and a[1].data_ptr() == toks[1].data_ptr()
    assert (
        a[4].data_ptr() == host_kv[1].data_ptr() and a[5].numel() == 0
    )  # host_cache_k, _v sentinel
    assert a[6].data_ptr() == dev_kv[1].data_ptr() and a[7].numel() == 0  # device_buffer_k, _v
    assert a[8].data_ptr() == out.data_ptr() and tuple(out.shape) == (2, K)
    assert a[12] is n and a[13] == 1 and a[14] == row  # num_real_reqs, page_size, item_size_bytes
    assert all(t.numel() == 0 for t in a[15:])  # miss plan sentinels

    # load_swap_in forces the coordinator's block size over a caller's 1024
    loader._OPS_CACHE.clear()
    fn = loader.load_swap_in(SRC, arch="90a")
    fn(top_k_tokens=topk, device_buffer_tokens=toks[0], host_cache_locs=host_pool,
       device_buffer_locs=locs[0], host_cache=host_kv[0], device_buffer=dev_kv[0],
       top_k_device_locs=out_buf[:2], req_pool_indices=rpi, seq_lens=seq, lru_slots=lru[0],
       item_size_bytes=row, num_top_k=K, hot_buffer_size=S, page_size=1, block_size=1024,
       num_real_reqs=n)  # fmt: skip
    assert calls["module_args"][2] == "960"


@needs_src
def test_ninja_matches_flags():
    root = loader.resolve_src_root(SRC)
    text = loader.ninja_text(
        name="x",
        include_paths=[str(loader.kernel_path(root) / "include")],
        arch="90a",
        tvm_ffi=(("/t/include",), "/t/lib", "tvm_ffi"),
    )
    assert (
        "-gencode=arch=compute_90a,code=sm_90a -DSGL_CUDA_ARCH=900 -std=c++20 -O3 --expt-relaxed-constexpr"
        in text
    )
    assert "-ltvm_ffi" in text and "-lcudart" in text
