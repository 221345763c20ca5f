"""benchmark/kv_offload/persistent_gemm.py: the compute stand-in's persistent GEMM against torch."""

import sys
from pathlib import Path

import pytest
import torch

BENCH_DIR = Path(__file__).resolve().parents[3] / "benchmark" / "kv_offload"
sys.path.insert(0, str(BENCH_DIR))
from persistent_gemm import persistent_matmul  # noqa: E402

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
    w = torch.randn((k, n), generator=g).to(DTYPE).to(DEVICE)
    out = torch.full((m, n), float("nan"), dtype=DTYPE, device=DEVICE)
    persistent_matmul(x, w, out, programs=programs)
    ref = x.float() @ w.float()
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=0.25)


def test_persistent_matmul_rejects_bad_arguments():
    x = torch.zeros((4, 128), dtype=torch.bfloat16, device=DEVICE)
    w = torch.zeros((128, 64), dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="do not chain"):
        persistent_matmul(x, w, torch.empty((4, 65), dtype=torch.bfloat16, device=DEVICE), 1)
    with pytest.raises(ValueError, match="programs=0"):
        persistent_matmul(x, w, torch.empty((4, 64), dtype=torch.bfloat16, device=DEVICE), 0)
    with pytest.raises(ValueError, match="contiguous"):
        persistent_matmul(
            x, w.t().contiguous().t(), torch.empty((4, 64), dtype=torch.bfloat16, device=DEVICE), 1
        )
