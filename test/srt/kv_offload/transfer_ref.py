"""Test reference: :mod:`transfer`'s copies in plain torch (they sync; the tests compare the
kernels with these bit for bit)."""

from typing import Optional, Union

import torch
from sglang.srt.mem_cache.sparsity.kv_offload.transfer import RowView


def _byte_rows(x: Union[RowView, torch.Tensor]) -> torch.Tensor:
    t = x.tensor if isinstance(x, RowView) else x
    return t.reshape(t.shape[0], -1).view(torch.uint8)


def copy_rows_ref(
    src: Union[RowView, torch.Tensor],
    dst: Union[RowView, torch.Tensor],
    src_idx: torch.Tensor,
    dst_idx: torch.Tensor,
    num_valid: Optional[torch.Tensor] = None,
) -> None:
    """Reference semantics of :func:`copy_rows` (syncs; not for the hot path)."""
    s_rows, d_rows = _byte_rows(src), _byte_rows(dst)
    n = src_idx.shape[0]
    if num_valid is not None:
        n = max(0, min(n, int(num_valid.reshape(-1)[0].item())))
    s = src_idx[:n].long().cpu()
    d = dst_idx[:n].long().cpu()
    keep = (s >= 0) & (d >= 0)
    s, d = s[keep], d[keep]
    d_rows[d.to(d_rows.device)] = s_rows[s.to(s_rows.device)].to(d_rows.device)


def copy_rows_all_layers_ref(src_layers, dst_layers, src_idx, dst_idx, num_valid=None) -> None:
    for s, d in zip(src_layers, dst_layers):
        copy_rows_ref(s, d, src_idx, dst_idx, num_valid)
