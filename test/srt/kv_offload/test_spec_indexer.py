"""benchmark/kv_offload/spec_indexer.py: the speculative indexer's paged logits against torch."""

import sys
from pathlib import Path

import pytest
import torch

BENCH_DIR = Path(__file__).resolve().parents[3] / "benchmark" / "kv_offload"
sys.path.insert(0, str(BENCH_DIR))
from spec_indexer import paged_index_logits, paged_index_logits_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAGE, DIM, HEADS = 64, 128, 64


def _paged_cache(num_pages: int, g: torch.Generator) -> torch.Tensor:
    """Random fp8 keys and positive fp32 scales in the index buffer's per-page layout."""
    keys = (torch.randn((num_pages, PAGE * DIM), generator=g) / 4).to(torch.float8_e4m3fn)
    scale = torch.rand((num_pages, PAGE), generator=g) + 0.5
    return torch.cat([keys.view(torch.uint8), scale.view(torch.uint8)], dim=1).to(DEVICE)


@pytest.mark.parametrize("bs, pages_per_req, per_program", [(2, 5, 2), (3, 4, 8), (1, 3, 1)])
def test_paged_index_logits_matches_torch(bs, pages_per_req, per_program):
    g = torch.Generator().manual_seed(bs * 10 + pages_per_req)
    cache = _paged_cache(bs * pages_per_req + 3, g)
    # Each request's pages scattered over the buffer, none shared.
    table = torch.randperm(cache.shape[0], generator=g)[: bs * pages_per_req]
    table = table.view(bs, pages_per_req).to(torch.int32).to(DEVICE)
    q = (torch.randn((bs, HEADS, DIM), generator=g) / 4).to(torch.float8_e4m3fn)
    q = q.to(DEVICE) if DEVICE == "cuda" else q.float()  # the interpreter dots in fp32
    weights = torch.rand((bs, HEADS), generator=g).to(DEVICE)
    out = torch.full((bs, pages_per_req * PAGE), float("nan"), device=DEVICE)
    paged_index_logits(q, weights, cache, table, out, pages_per_program=per_program)
    ref = paged_index_logits_ref(q, weights, cache, table)
    assert ref.abs().max() > 0  # ReLU left some scores
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)


def test_paged_index_logits_rejects_a_buffer_of_another_layout():
    cache = torch.zeros((4, PAGE * (DIM + 4)), dtype=torch.uint8, device=DEVICE)
    q = torch.zeros((1, HEADS, DIM), device=DEVICE)
    table = torch.zeros((1, 2), dtype=torch.int32, device=DEVICE)
    weights = torch.zeros((1, HEADS), device=DEVICE)
    with pytest.raises(ValueError, match="index_k_with_scale_buffer"):
        paged_index_logits(q, weights, cache, table, torch.empty((1, 3 * PAGE), device=DEVICE))
    with pytest.raises(ValueError, match="do not fit"):
        paged_index_logits(
            q, weights, cache[:, :-4], table, torch.empty((1, 2 * PAGE), device=DEVICE)
        )
