"""benchmark/kv_offload/persistent_gemm.py: the compute stand-in's persistent GEMM against torch."""

import sys
from pathlib import Path

import pytest
import torch

BENCH_DIR = Path(__file__).resolve().parents[3] / "benchmark" / "kv_offload"
sys.path.insert(0, str(BENCH_DIR))
from persistent_gemm import padded, persistent_matmul  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The bench runs it in bf16; the Triton interpreter's bf16 dot returns garbage, so on CPU the same
# kernel runs in fp32.
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32


@pytest.mark.parametrize(
    "m, k, n, programs",
    [
        (5, 256, 200, 3),  # a ragged last tile in both dimensions, programs < tiles
        (130, 128, 64, 7),  # two row tiles of 128; more programs than tiles
        (64, 384, 130, 1),  # one program does every tile
    ],
)
def test_persistent_matmul_matches_torch(m, k, n, programs):
    g = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn((m, k), generator=g).to(DTYPE).to(DEVICE)
    w = padded(k, n, DTYPE, DEVICE)
    w.copy_(torch.randn((k, n), generator=g))
    out = padded(m, n, DTYPE, DEVICE).fill_(float("nan"))
    persistent_matmul(x, w, out, programs=programs)
    ref = x.float() @ w.float()
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=0.25)


def test_padded_rows_are_16_byte_aligned():
    for dtype in (torch.bfloat16, torch.float32):
        t = padded(3, 130, dtype, DEVICE)
        assert t.shape == (3, 130) and t.stride(1) == 1
        assert t.stride(0) * t.element_size() % 16 == 0 and t.stride(0) - 130 < 16


def test_persistent_matmul_rejects_bad_arguments():
    x = torch.zeros((4, 128), dtype=DTYPE, device=DEVICE)
    w = torch.zeros((128, 64), dtype=DTYPE, device=DEVICE)
    out = torch.empty((4, 64), dtype=DTYPE, device=DEVICE)
    with pytest.raises(ValueError, match="do not chain"):
        persistent_matmul(x, w, torch.empty((4, 65), dtype=DTYPE, device=DEVICE), 1)
    with pytest.raises(ValueError, match="programs=0"):
        persistent_matmul(x, w, out, 0)
    with pytest.raises(ValueError, match="16-byte aligned rows"):
        persistent_matmul(x, w.t().contiguous().t(), out, 1)
    with pytest.raises(ValueError, match="persistent_gemm.padded"):
        persistent_matmul(x, torch.zeros((128, 65), dtype=DTYPE, device=DEVICE)[:, :64], out, 1)
