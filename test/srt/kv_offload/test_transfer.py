"""Row-copy kernel (transfer.py) against its pure-torch reference; CPU under TRITON_INTERPRET."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sglang.srt.mem_cache.sparsity.kv_offload.transfer import (
    CopyLaunchConfig,
    RowView,
    copy_rows,
    copy_rows_all_layers,
    default_backup_launch_config,
    default_load_launch_config,
)
from transfer_ref import copy_rows_all_layers_ref, copy_rows_ref

ROW_LAYOUTS = [(656, torch.uint8), (1152, torch.bfloat16)]


def _rows(n, row_bytes, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, (n, row_bytes), dtype=torch.uint8, generator=g)
    return b.view(dtype).reshape(n, 1, -1)  # the (rows, 1, dim) shape of kv_buffer[layer]


def _bytes(t):
    return t.reshape(t.shape[0], -1).view(torch.uint8)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    row_bytes=st.sampled_from([16, 24, 48, 656, 1152]),
    n=st.integers(0, 300),
    pad_frac=st.sampled_from([0.0, 0.3, 1.0]),
    count=st.sampled_from([None, "zero", "full", "over", "rand"]),
    idx_dtype=st.sampled_from([torch.int32, torch.int64]),
    rows_per_program=st.sampled_from([1, 3, 16, 64]),
    num_programs=st.sampled_from([1, 3, 8]),
    word_bytes=st.sampled_from([None, 4]),
    seed=st.integers(0, 2**16),
)
def test_kernel_matches_reference(
    row_bytes, n, pad_frac, count, idx_dtype, rows_per_program, num_programs, word_bytes, seed
):
    g = torch.Generator().manual_seed(seed)
    n_src, n_dst = n + 17, n + 5
    src = _rows(n_src, row_bytes, torch.uint8, seed)
    dst = _rows(n_dst, row_bytes, torch.uint8, seed + 1)
    want = dst.clone()
    # duplicate sources are allowed, duplicate destinations are not
    src_idx = torch.randint(0, n_src, (n,), generator=g)
    dst_idx = torch.randperm(n_dst, generator=g)[:n]
    pad = torch.rand(n, generator=g) < pad_frac
    src_idx[pad] = -1
    num_valid = {
        None: None,
        "zero": torch.tensor([0], dtype=torch.int32),
        "full": torch.tensor([n], dtype=torch.int32),
        "over": torch.tensor([n + 10], dtype=torch.int32),
        "rand": torch.randint(0, n + 1, (1,), dtype=torch.int32, generator=g),
    }[count]
    cfg = CopyLaunchConfig(num_programs, rows_per_program, 4, word_bytes)
    copy_rows(src, dst, src_idx.to(idx_dtype), dst_idx.to(idx_dtype), num_valid, cfg)
    copy_rows_ref(src, want, src_idx, dst_idx, num_valid)
    assert torch.equal(dst, want)
    # rows outside the processed prefix, padding rows and untouched rows keep their old bytes
    limit = n if num_valid is None else max(0, min(n, int(num_valid)))
    touched = torch.zeros(n_dst, dtype=torch.bool)
    live = src_idx[:limit] >= 0
    touched[dst_idx[:limit][live]] = True
    orig = _rows(n_dst, row_bytes, torch.uint8, seed + 1)
    assert torch.equal(dst[~touched], orig[~touched])
    assert torch.equal(dst[dst_idx[:limit][live]], src[src_idx[:limit][live]])


@pytest.mark.parametrize("row_bytes,dtype", ROW_LAYOUTS)
@pytest.mark.parametrize("n", [1, 63, 64, 65, 2047, 2048, 2049, 8191])
def test_round_trip_ragged(row_bytes, dtype, n):
    """device rows -> host rows (backup direction) -> other device rows (load), bit exact."""
    layers = 2
    dev = [_rows(n + 3, row_bytes, dtype, 10 + l) for l in range(layers)]
    host = [torch.zeros(n + 64, 1, row_bytes // dtype.itemsize, dtype=dtype) for _ in range(layers)]
    back = [torch.zeros_like(d) for d in dev]
    g = torch.Generator().manual_seed(n)
    dev_rows = torch.randperm(n + 3, generator=g)[:n]
    host_rows = torch.randperm(n + 64, generator=g)[:n].to(torch.int32)
    copy_rows_all_layers(dev, host, dev_rows, host_rows)
    perm = torch.randperm(n, generator=g)
    copy_rows_all_layers(host, back, host_rows[perm], dev_rows[perm])
    for l in range(layers):
        assert torch.equal(_bytes(back[l])[dev_rows], _bytes(dev[l])[dev_rows])
        assert torch.equal(_bytes(host[l])[host_rows.long()], _bytes(dev[l])[dev_rows])
        untouched = torch.ones(n + 3, dtype=torch.bool)
        untouched[dev_rows] = False
        assert not _bytes(back[l])[untouched].any()


def test_all_layers_matches_reference():
    src = [_rows(100, 656, torch.uint8, s) for s in range(3)]
    dst = [torch.zeros(80, 1, 656, dtype=torch.uint8) for _ in range(3)]
    want = [d.clone() for d in dst]
    si = torch.tensor([5, -1, 7, 99, 0, 5], dtype=torch.int64)
    di = torch.tensor([0, 1, 2, 79, 4, 6], dtype=torch.int64)
    nv = torch.tensor([5], dtype=torch.int32)
    copy_rows_all_layers(src, dst, si, di, nv)
    copy_rows_all_layers_ref(src, want, si, di, nv)
    for d, w in zip(dst, want):
        assert torch.equal(d, w)
        assert not d[1].any() and not d[6].any()  # -1 source, beyond num_valid


def test_num_valid_is_read_at_launch_time():
    """A fixed launch reused with new index contents and counts (what a graph replay does)."""
    src = _rows(64, 656, torch.uint8, 0)
    dst = torch.zeros(64, 1, 656, dtype=torch.uint8)
    si = torch.full((32,), -1, dtype=torch.int32)
    di = torch.arange(32, dtype=torch.int32)
    nv = torch.zeros(1, dtype=torch.int32)
    src_v, dst_v = RowView(src), RowView(dst)
    for step, count in enumerate([0, 32, 7]):
        si.copy_(torch.randperm(64)[:32].to(torch.int32))
        nv.fill_(count)
        dst.zero_()
        copy_rows(src_v, dst_v, si, di, nv)
        assert torch.equal(dst[:count], src[si[:count].long()]), step
        assert not dst[count:].any(), step


def test_errors_are_clear():
    src = torch.zeros(8, 656, dtype=torch.uint8)
    with pytest.raises(ValueError, match="row size mismatch"):
        copy_rows(
            src,
            torch.zeros(8, 1152, dtype=torch.uint8),
            torch.zeros(1).long(),
            torch.zeros(1).long(),
        )
    with pytest.raises(TypeError, match="int32 or int64"):
        copy_rows(src, src, torch.zeros(1), torch.zeros(1))
    with pytest.raises(ValueError, match="dst_idx has 2"):
        copy_rows(src, src, torch.zeros(1).long(), torch.zeros(2).long())
    with pytest.raises(ValueError, match="multiple of 4 bytes"):
        RowView(torch.zeros(8, 6, dtype=torch.uint8))
    with pytest.raises(ValueError, match="contiguous rows"):
        RowView(torch.zeros(8, 1312, dtype=torch.uint8)[:, :656])
    with pytest.raises(ValueError, match=r"\(1,\) int32"):
        copy_rows(src, src, torch.zeros(1).long(), torch.zeros(1).long(), torch.zeros(1).long())


# --------------------------------------------------------------------------------------------------
# GPU only: pinned host memory read through UVA.
# --------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("row_bytes,dtype", ROW_LAYOUTS)
@pytest.mark.parametrize("load_shape", ["default", "load", "backup"])
def test_gpu_pinned_uva_gather_and_scatter(row_bytes, dtype, load_shape):
    n_host, n = 200_000, 26_000
    host = _rows(n_host, row_bytes, dtype, 0).pin_memory()
    dev = torch.zeros(2 * n, 1, row_bytes // dtype.itemsize, dtype=dtype, device="cuda")
    si = torch.randperm(n_host, device="cuda")[:n].to(torch.int32)
    di = torch.randperm(2 * n, device="cuda")[:n]
    si[::9] = -1
    cfg = dict(
        default=None,
        load=default_load_launch_config(torch.device("cuda")),
        backup=default_backup_launch_config(torch.device("cuda")),
    )[load_shape]
    count = torch.tensor([n - 5], dtype=torch.int32, device="cuda")
    copy_rows(host, dev, si, di, count, cfg)
    si[n - 5 :] = -1  # past the device-side count: not copied
    torch.cuda.synchronize()
    live = si >= 0
    assert torch.equal(_bytes(dev)[di[live]].cpu(), _bytes(host)[si[live].long().cpu()])
    assert not _bytes(dev)[di[n - 5 :]].any()
    back = torch.zeros_like(host).pin_memory()
    copy_rows(dev, back, di[live], si[live], config=cfg)
    torch.cuda.synchronize()
    assert torch.equal(_bytes(back)[si[live].long().cpu()], _bytes(host)[si[live].long().cpu()])
