"""The benchmark-only decode top-k replay of the stand-ins (``KV_OFFLOAD_STANDINS_TOPK_PERIOD``):
real-DSA-like selections, the same in every server, at the churn the serving benchmark names."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmark" / "kv_offload"))
import kv_offload_standins as standins  # noqa: E402
from bench_serving_dsa import TOPK_REPLAY_PERIODS  # noqa: E402

TOPK, CONTEXT = 2048, 32768
POS = torch.arange(CONTEXT)


def selection(layer: int, n: int, period: int) -> torch.Tensor:
    scores = standins.replay_scores(layer, POS, torch.tensor([[n]]), period)
    return scores.masked_fill(POS[None] >= n, float("-inf")).topk(TOPK, dim=1).indices[0]


def drifting(picks: torch.Tensor, n: int) -> set:
    keep = (picks >= standins.REPLAY_SINKS) & (picks < n - standins.REPLAY_WINDOW)
    return set(picks[keep].tolist())


@pytest.mark.parametrize("churn", sorted(TOPK_REPLAY_PERIODS))
def test_churn_per_step_is_the_benchmarks(churn):
    period, steps = TOPK_REPLAY_PERIODS[churn], 16
    prev, changed = None, []
    for n in range(CONTEXT - steps, CONTEXT):
        picks = selection(0, n, period)
        # Sinks and the local window are selected at every step.
        assert set(range(standins.REPLAY_SINKS)) <= set(picks.tolist())
        assert set(range(n - standins.REPLAY_WINDOW, n)) <= set(picks.tolist())
        cur = drifting(picks, n)
        if prev is not None:
            changed.append(1 - len(cur & prev) / len(cur))
        prev = cur
    measured = sum(changed) / len(changed)
    assert abs(measured - churn) < 0.25 * churn, (churn, measured)


def test_adjacent_layers_share_most_of_their_selection():
    n = CONTEXT - 100
    a, b = (set(selection(layer, n, 3).tolist()) for layer in (0, 1))
    assert 0.7 < len(a & b) / TOPK < 1.0


def test_a_rows_scores_depend_only_on_its_context_and_layer():
    lens = torch.tensor([[30000], [20000], [30000]])
    scores = standins.replay_scores(2, POS, lens, 3)
    assert torch.equal(scores[0], scores[2]) and not torch.equal(scores[0], scores[1])
    alone = standins.replay_scores(2, POS, lens[1:2], 3)
    assert torch.equal(alone[0], scores[1])  # batch-invariant: the same in every server


def test_paged_logits_serve_the_replay_when_asked(monkeypatch):
    batch, heads, dim, pages = 2, 4, standins.INDEX_HEAD_DIM, 6
    page_bytes = standins.INDEX_PAGE_TOKENS * (dim + 4)
    cache = torch.zeros((pages, standins.INDEX_PAGE_TOKENS, 1, page_bytes // 64), dtype=torch.uint8)
    q = torch.randn(batch, 1, heads, dim)
    weights = torch.randn(batch, heads)
    lens = torch.tensor([[200], [300]], dtype=torch.int32)
    table = torch.arange(pages, dtype=torch.int32).reshape(1, -1).repeat(batch, 1)
    args = (q, cache, weights, lens, table, None, 384)
    random_weights = standins.fp8_paged_mqa_logits(*args)
    monkeypatch.setenv("KV_OFFLOAD_STANDINS_TOPK_PERIOD", "3")
    monkeypatch.setattr(standins, "_REPLAY_LAYERS", {})
    replayed = standins.fp8_paged_mqa_logits(*args)
    want = standins.replay_scores(0, torch.arange(384), lens.long(), 3)
    want = want.masked_fill(torch.arange(384)[None] >= lens, float("-inf"))
    assert torch.equal(replayed, want) and not torch.equal(replayed, random_weights)


def test_production_indexer_logits_are_replayed_in_place(monkeypatch):
    """B1: with production kernels, the real DeepGEMM decode logits run and are then overwritten in
    place by the same scores S4's replay gives; without the replay the real kernel is left as is."""
    batch, next_n, heads, dim, width = 2, 2, 4, standins.INDEX_HEAD_DIM, 384
    cache = torch.zeros((6, standins.INDEX_PAGE_TOKENS, 1, 132), dtype=torch.uint8)
    q = torch.randn(batch, next_n, heads, dim)
    lens = torch.tensor([[200, 201], [300, 301]], dtype=torch.int32)
    padded = torch.randn(batch * next_n, 512)  # DeepGEMM's row-padded output layout
    calls = []

    def real(*args, clean_logits=True):
        calls.append(args[6])
        return padded[:, : args[6]]

    module = type(sys)("deep_gemm")
    module.fp8_paged_mqa_logits = real
    monkeypatch.setenv("KV_OFFLOAD_KERNELS", "production")
    standins._patch_deep_gemm(module)
    assert module.fp8_paged_mqa_logits is real  # no replay asked: untouched

    monkeypatch.setenv("KV_OFFLOAD_STANDINS_TOPK_PERIOD", "3")
    monkeypatch.setattr(standins, "_REPLAY_LAYERS", {})
    standins._patch_deep_gemm(module)
    out = module.fp8_paged_mqa_logits(q, cache, None, lens, None, None, width, clean_logits=False)
    assert calls == [width] and out.data_ptr() == padded.data_ptr() and out.stride(0) == 512
    # MTP rows: the first of a request's two sees one token fewer.
    row_lens = torch.tensor([[200], [201], [300], [301]])
    want = standins.replay_scores(0, torch.arange(width), row_lens, 3)
    want = want.masked_fill(torch.arange(width)[None] >= row_lens, float("-inf"))
    assert torch.equal(out, want)


def test_fused_replay_kernel_gives_the_torch_replays_selection():
    """The CUDA servers' one-kernel replay (``replay_kernel.replay_logits``, here under the Triton
    interpreter) gives the torch replay's scores (the same int64 hash and float64 normals; the
    transcendentals may differ in the last bit) and the same top-k, masks included."""
    from replay_kernel import replay_logits

    width, period = 5000, 3
    lens = torch.tensor([[4999], [3000], [131], [2]])  # long, mid, inside the window, tiny
    for layer in (0, 5):
        got = replay_logits(
            layer, lens, width, period, standins.REPLAY_SHARE, standins.REPLAY_SINKS,
            standins.REPLAY_WINDOW,
        )  # fmt: skip
        want = standins.replay_scores(layer, torch.arange(width), lens, period)
        want = want.masked_fill(torch.arange(width)[None] >= lens, float("-inf"))
        assert got.shape == want.shape and got.dtype == want.dtype
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        k = 64
        assert torch.equal(
            got.topk(k, dim=1).indices.sort(dim=1).values,
            want.topk(k, dim=1).indices.sort(dim=1).values,
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_replay_kernel_on_the_gpu_at_serving_shapes():
    """The compiled kernel at a serving point's shapes (27 rows of 32K + 4K): the torch replay's
    scores and its top-2048 on the same GPU."""
    from replay_kernel import replay_logits

    width, period = 36864, 3
    lens = torch.randint(32768, width, (27, 1), device="cuda")
    lens[0, 0] = width
    got = replay_logits(
        3, lens, width, period, standins.REPLAY_SHARE, standins.REPLAY_SINKS,
        standins.REPLAY_WINDOW,
    )  # fmt: skip
    pos = torch.arange(width, device="cuda")
    want = standins.replay_scores(3, pos, lens, period).masked_fill(
        pos[None] >= lens, float("-inf")
    )
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    picks = lambda x: x.topk(TOPK, dim=1).indices.sort(dim=1).values  # noqa: E731
    assert (picks(got) == picks(want)).float().mean() > 0.999  # ties at the last bit aside
