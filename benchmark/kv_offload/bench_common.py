"""Shapes and helpers shared by the kv offload benchmarks that drive the pools directly.

DeepSeek-V3.2's MLA latent row and index key sizes, the process set-up that must run before sglang
is imported, the row decoding used to check loaded bytes, one-request allocation helpers, and the
results writer.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CPU_STUBS = os.path.join(ROOT, "test", "srt", "kv_offload", "cpu_stubs")

PAGE = 64
KV_LORA = 512
ROPE = 64
LATENT = KV_LORA + ROPE  # 576
INDEX_DIM = 128
FP8_ROW_BYTES = KV_LORA + KV_LORA // 128 * 4 + ROPE * 2  # 656
RESULTS_LINE = 160  # results_json's longest one-line list


def results_json(doc: Any, level: int = 0) -> str:
    """``doc`` as JSON indented by one space per level, with each list of scalars (tokens, a
    shape) and each list of lists that fits in ``RESULTS_LINE`` characters (a profiled kernel) on
    one line: half the bytes of ``json.dumps(doc, indent=1)``, which keeps the work tree small
    enough to carry to the GPU."""
    inner, outer = " " * (level + 1), " " * level
    if isinstance(doc, dict) and doc:
        items = (
            f"{inner}{json.dumps(str(k))}: {results_json(v, level + 1)}" for k, v in doc.items()
        )
        return "{\n" + ",\n".join(items) + f"\n{outer}}}"
    if not isinstance(doc, list) or not doc:
        return json.dumps(doc)
    if not any(isinstance(v, dict) for v in doc):  # serialized only where it may be the answer
        flat = json.dumps(doc)
        if len(flat) <= RESULTS_LINE or not any(isinstance(v, list) for v in doc):
            return flat
    return "[\n" + ",\n".join(inner + results_json(v, level + 1) for v in doc) + f"\n{outer}]"


def read_results(path: str) -> Any:
    """A results file, ``.json`` or gzip'd ``.json.gz`` (the largest committed ones, compressed to
    keep the work tree small enough to carry to the GPU: ``zcat`` reads them too)."""
    if str(path).endswith(".gz"):
        with gzip.open(path, "rt") as f:
            return json.load(f)
    return json.loads(Path(path).read_text())


def write_results(path: str, doc: Any) -> None:
    """Write a benchmark's results as JSON (``results_json``; creating the folder), say where."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(results_json(doc))
    print(f"wrote {path}")


def prepare_environment(device: str) -> None:
    """Set up a process before sglang is imported: Triton interpreter on CPU, import stand-ins.

    ``TRITON_INTERPRET`` must be set before any ``@triton.jit`` module is imported; the
    ``sgl_kernel`` stand-in is added only where the real package is missing; the process publishes
    a one-rank configuration (:func:`publish_standalone_context`).
    """
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        # The benchmarks' CPU matmuls are tiny: with a second busy process on a small box, intra-op
        # threads cost far more in contention than they gain (30x on the 2-core CI machine).
        torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if importlib.util.find_spec("sgl_kernel") is None and CPU_STUBS not in sys.path:
        sys.path.insert(0, CPU_STUBS)
    publish_standalone_context(device)


def publish_standalone_context(device: str) -> None:
    """Publish a one-rank configuration for this process: SGLang 0.5.23's pools and allocators
    read it (parallel widths, memory and schedule bags), as a server's scheduler publishes its own.
    """
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    publish(
        ServerArgs(model_path="dummy", device=device),
        role="test",
        ranks=SpawnRanks(world_rank=0, dp_rank=None),
    )


def dequantize_rows(rows: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """``(..., row_bytes)`` uint8 rows -> ``(..., 576)`` float32 latent KV."""
    shape = rows.shape[:-1]
    flat = rows.reshape(-1, rows.shape[-1])
    if kv_dtype == "bf16":
        return flat.view(torch.bfloat16).float().view(*shape, LATENT)
    n = flat.shape[0]
    q = flat[:, :KV_LORA].contiguous().view(torch.float8_e4m3fn).float().view(n, 4, 128)
    scale = flat[:, KV_LORA : KV_LORA + 16].contiguous().view(torch.float32)
    rope = flat[:, KV_LORA + 16 :].contiguous().view(torch.bfloat16).float()
    nope = (q * scale[..., None]).view(n, KV_LORA)
    return torch.cat([nope, rope], dim=-1).view(*shape, LATENT)


def alloc_extend(alloc: Any, n: int, device: torch.device) -> Optional[torch.Tensor]:
    z = torch.zeros(1, dtype=torch.int64, device=device)
    seq = torch.tensor([n], dtype=torch.int64, device=device)
    last = torch.full((1,), -1, dtype=torch.int64, device=device)
    return alloc.alloc_extend(z, z.cpu(), seq, seq.cpu(), last, n)


def alloc_decode(
    alloc: Any, r2t: torch.Tensor, reqs: Sequence[int], lens: Sequence[int]
) -> Optional[torch.Tensor]:
    device = r2t.device
    idx = torch.tensor(list(reqs), dtype=torch.int64, device=device)
    old = torch.tensor(list(lens), dtype=torch.int64, device=device)
    last = r2t[idx, old - 1].to(torch.int64)
    seq = old + 1
    return alloc.alloc_decode(seq, seq.cpu(), last)
