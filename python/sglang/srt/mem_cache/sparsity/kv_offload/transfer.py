"""Row-granular copies between KV row buffers (device <-> pinned host) for kv_offload.

One Triton kernel serves every direction: host -> device loads of sparse-cache misses (per layer,
inside the CUDA graph) and device -> host backups (prompt pages and completed decode pages, on the
write stream). Rows are fixed-size byte records (656 B fp8 layout, 1152 B bf16); a pinned host buffer
is dereferenced directly by the GPU through UVA, so no staging copy and no host involvement.

The launch is data independent: the grid is a fixed number of programs that loop over tiles of rows,
the row count is read from a device tensor, and padding entries (-1) are masked. Nothing here syncs,
allocates device memory or inspects index values on the host, so a launch can be captured in a CUDA
graph and replayed with different index contents.

No upstream sglang imports: this module is shared by the runtime, the tests and the benchmark.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Union

import torch
import triton
import triton.language as tl

__all__ = [
    "CopyLaunchConfig",
    "RowView",
    "copy_rows",
    "copy_rows_all_layers",
    "default_backup_launch_config",
    "default_launch_config",
    "default_load_launch_config",
]


class _UvaPointer:
    """Hands a host tensor's address to a Triton launch on the GPU.

    Triton refuses CPU tensors as kernel arguments, but a pinned / cudaHostRegister'ed buffer is
    addressable from the GPU through UVA. The launcher only needs ``data_ptr()`` and ``dtype``.
    """

    __slots__ = ("_tensor", "dtype")

    def __init__(self, tensor: torch.Tensor):
        self._tensor = tensor  # keeps the storage alive for as long as the view exists
        self.dtype = tensor.dtype

    def data_ptr(self) -> int:
        return self._tensor.data_ptr()


class RowView:
    """A kernel-ready view of a buffer of fixed-size rows.

    ``tensor`` may have any shape whose first dimension is the row index and whose remaining
    dimensions are contiguous (e.g. ``kv_buffer[layer]`` of shape ``(rows, 1, dim)``). Build it once
    (pools keep one per layer): ``copy_rows`` then does no tensor work per call.
    """

    def __init__(self, tensor: torch.Tensor, word_bytes: Optional[int] = None):
        if tensor.dim() < 1:
            raise ValueError("RowView needs a tensor with a leading row dimension")
        rows = tensor.shape[0]
        flat = tensor.reshape(rows, -1) if tensor.dim() != 2 else tensor
        if not flat.is_contiguous():
            raise ValueError(
                f"RowView needs contiguous rows (got strides {tuple(tensor.stride())}); "
                "pass a layer_first per-layer view, e.g. kv_buffer[layer]"
            )
        row_bytes = flat.shape[1] * flat.element_size()
        if word_bytes is None:
            word_bytes = 8 if row_bytes % 8 == 0 else 4
        if word_bytes not in (4, 8) or row_bytes % word_bytes != 0:
            raise ValueError(
                f"row size {row_bytes} B is not a multiple of the copy word ({word_bytes} B); "
                "rows must be a multiple of 4 bytes (656 B fp8 and 1152 B bf16 KV rows are)"
            )
        if flat.data_ptr() % 16 != 0:
            raise ValueError(
                f"row buffer base address {flat.data_ptr():#x} is not 16-byte aligned; "
                "allocate the pool with torch.empty/zeros and take views at row boundaries"
            )
        self.tensor = tensor
        self.num_rows = rows
        self.row_bytes = row_bytes
        self.word_bytes = word_bytes
        word_dtype = torch.int64 if word_bytes == 8 else torch.int32
        self.words = flat.view(torch.uint8).view(word_dtype)
        self.row_words = row_bytes // word_bytes
        self.is_host = tensor.device.type == "cpu"
        self._other_word: Optional[RowView] = None

    def with_word_bytes(self, word_bytes: Optional[int]) -> "RowView":
        """The same rows read as ``word_bytes`` words (cached: no per-call tensor work)."""
        if word_bytes is None or word_bytes == self.word_bytes:
            return self
        if self._other_word is None or self._other_word.word_bytes != word_bytes:
            self._other_word = RowView(self.tensor, word_bytes)
        return self._other_word

    def kernel_arg(self, on_cuda: bool) -> Union[torch.Tensor, _UvaPointer]:
        if on_cuda and self.is_host:
            return _UvaPointer(self.words)
        return self.words

    def __repr__(self) -> str:
        return (
            f"RowView(rows={self.num_rows}, row_bytes={self.row_bytes}, "
            f"device={self.tensor.device})"
        )


@dataclass(frozen=True)
class CopyLaunchConfig:
    """Launch shape of the row-copy kernel (the journal's "Host tier" gives the sweep that chose it).

    num_programs: fixed grid size; programs stride over tiles, so it does not depend on the data.
    rows_per_program: rows per tile (one 2D load of ``rows x row`` per loop iteration).
    num_warps: warps per program.
    word_bytes: element type of the load (8: int64, 4: int32); both vectorise to 16 B accesses when
        the row size is a multiple of 16 B.
    """

    num_programs: int
    rows_per_program: int = 4
    num_warps: int = 4
    word_bytes: Optional[int] = None


BACKUP_PROGRAMS = 16
"""Programs of a device -> host page backup (``default_backup_launch_config``), whatever the SMs."""


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_launch_config(device: Optional[torch.device] = None) -> CopyLaunchConfig:
    """A sensible default: a few programs per SM on GPU; a handful under the CPU interpreter."""
    if device is not None and device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        return CopyLaunchConfig(num_programs=4 * _sm_count(idx), rows_per_program=4, num_warps=4)
    return CopyLaunchConfig(num_programs=4, rows_per_program=64, num_warps=4)


def default_backup_launch_config(device: Optional[torch.device] = None) -> CopyLaunchConfig:
    """Launch shape of the device -> host page backups, which run beside the decode forward.

    A small fixed grid (``BACKUP_PROGRAMS`` programs of 4-row tiles, whatever the SM count): the
    writes are bound by the link, not by SMs, and a backup on the write stream shares the GPU with
    the forward of every running request, which a grid on every SM would slow. The measurements
    behind the shape are in benchmark/kv_offload/JOURNAL.md ("Host tier").
    """
    if device is not None and device.type == "cuda":
        return CopyLaunchConfig(num_programs=BACKUP_PROGRAMS, rows_per_program=4, num_warps=4)
    return default_launch_config(device)


def default_load_launch_config(device: Optional[torch.device] = None) -> CopyLaunchConfig:
    """Launch shape of the per-layer H2D miss load (scattered rows from a large host pool).

    A 61-layer pool's host rows are spread over tens of GB, so nearly every row needs a fresh
    GPU-side address translation. Many small programs (one row per tile, 128 per SM) keep the most
    translations in flight (``bench_lru.py --compact-variants`` compares shapes; JOURNAL.md). The
    grid is capped by the index capacity, so small batches launch fewer programs.
    """
    if device is not None and device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        return CopyLaunchConfig(num_programs=128 * _sm_count(idx), rows_per_program=1, num_warps=4)
    return default_launch_config(device)


@triton.jit
def _copy_rows_kernel(
    src_ptr,
    dst_ptr,
    src_idx_ptr,
    dst_idx_ptr,
    num_valid_ptr,
    n_entries,
    HAS_NUM_VALID: tl.constexpr,
    ROW_WORDS: tl.constexpr,
    BLOCK_W: tl.constexpr,
    ROWS: tl.constexpr,
):
    pid = tl.program_id(0)
    n = n_entries
    if HAS_NUM_VALID:
        n = tl.minimum(tl.load(num_valid_ptr).to(tl.int32), n_entries)
    n_tiles = tl.cdiv(n, ROWS)
    rows_in_tile = tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_W)
    col_ok = cols < ROW_WORDS
    for tile in range(pid, n_tiles, tl.num_programs(0)):
        e = tile * ROWS + rows_in_tile
        e_ok = e < n
        s = tl.load(src_idx_ptr + e, mask=e_ok, other=-1).to(tl.int64)
        d = tl.load(dst_idx_ptr + e, mask=e_ok, other=-1).to(tl.int64)
        row_ok = (s >= 0) & (d >= 0)
        m = row_ok[:, None] & col_ok[None, :]
        # ROW_WORDS is a constexpr so the compiler knows each row start is 16 B aligned when the
        # row size is a multiple of 16 B, and emits 16 B vector accesses.
        v = tl.load(src_ptr + s[:, None] * ROW_WORDS + cols[None, :], mask=m)
        tl.store(dst_ptr + d[:, None] * ROW_WORDS + cols[None, :], v, mask=m)


def _check_index(name: str, idx: torch.Tensor) -> None:
    if idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {idx.dtype}")
    if idx.dim() != 1 or not idx.is_contiguous():
        raise ValueError(f"{name} must be a contiguous 1-D tensor, got shape {tuple(idx.shape)}")


def _as_view(x: Union[RowView, torch.Tensor], word_bytes: Optional[int]) -> RowView:
    if isinstance(x, RowView):
        return x.with_word_bytes(word_bytes)
    return RowView(x, word_bytes)


def _matched_views(src, dst, src_idx, dst_idx, word_bytes):
    """Kernel views of ``src``/``dst`` with equal row sizes and copy words; checks the index lists."""
    src_v = _as_view(src, word_bytes)
    dst_v = _as_view(dst, src_v.word_bytes)
    if src_v.row_bytes != dst_v.row_bytes:
        raise ValueError(
            f"row size mismatch: src rows are {src_v.row_bytes} B, dst rows {dst_v.row_bytes} B"
        )
    _check_index("src_idx", src_idx)
    _check_index("dst_idx", dst_idx)
    return src_v, dst_v


def copy_rows(
    src: Union[RowView, torch.Tensor],
    dst: Union[RowView, torch.Tensor],
    src_idx: torch.Tensor,
    dst_idx: torch.Tensor,
    num_valid: Optional[torch.Tensor] = None,
    config: Optional[CopyLaunchConfig] = None,
) -> None:
    """``dst[dst_idx[i]] = src[src_idx[i]]`` for ``i < min(len, num_valid)`` on the current stream.

    Entries with a negative source (or destination) index are skipped. Duplicate sources are fine;
    duplicate destinations give an unspecified winner (the caller must not produce them).
    ``num_valid`` is an optional ``(1,) int32`` device tensor: only its first entries are read, so a
    compacted miss list can live in a fixed-size buffer. Index values are not range-checked (that
    would need a host sync); callers own their validity.

    Either buffer may be a host tensor: on a CUDA launch it must be pinned or cudaHostRegister'ed.
    Capture-safe: the launch depends only on shapes and ``config``.
    """
    if config is not None and config.word_bytes is not None:
        word_bytes = config.word_bytes
    else:
        word_bytes = src.word_bytes if isinstance(src, RowView) else None
    src_v, dst_v = _matched_views(src, dst, src_idx, dst_idx, word_bytes)
    n = src_idx.shape[0]
    if dst_idx.shape[0] != n:
        raise ValueError(f"src_idx has {n} entries but dst_idx has {dst_idx.shape[0]}")
    if num_valid is not None and (num_valid.numel() != 1 or num_valid.dtype != torch.int32):
        raise ValueError("num_valid must be a (1,) int32 tensor on the index device")
    if n == 0:
        return

    idx_device = src_idx.device
    on_cuda = idx_device.type == "cuda"
    if dst_idx.device != idx_device or (num_valid is not None and num_valid.device != idx_device):
        raise ValueError("src_idx, dst_idx and num_valid must be on the same device")
    for v, name in ((src_v, "src"), (dst_v, "dst")):
        if on_cuda and not v.is_host and v.tensor.device != idx_device:
            raise ValueError(f"{name} buffer is on {v.tensor.device}, indices on {idx_device}")
        if not on_cuda and not v.is_host:
            raise ValueError(f"{name} buffer is on {v.tensor.device} but indices are on the CPU")

    cfg = config or default_launch_config(idx_device)
    rows = triton.next_power_of_2(max(1, cfg.rows_per_program))
    block_w = triton.next_power_of_2(src_v.row_words)
    # More programs than tiles only adds empty programs; still data independent, since ``n`` is
    # the static length of the index buffers and not the (device-side) valid count.
    grid = (max(1, min(cfg.num_programs, triton.cdiv(n, rows))),)
    _copy_rows_kernel[grid](
        src_v.kernel_arg(on_cuda),
        dst_v.kernel_arg(on_cuda),
        src_idx,
        dst_idx,
        num_valid if num_valid is not None else src_idx,
        n,
        HAS_NUM_VALID=num_valid is not None,
        ROW_WORDS=src_v.row_words,
        BLOCK_W=block_w,
        ROWS=rows,
        num_warps=cfg.num_warps,
    )


def copy_rows_all_layers(
    src_layers: list,
    dst_layers: list,
    src_idx: torch.Tensor,
    dst_idx: torch.Tensor,
    num_valid: Optional[torch.Tensor] = None,
    config: Optional[CopyLaunchConfig] = None,
) -> None:
    """``copy_rows`` for every layer with the same index lists (prompt / decode-page backups).

    One launch per layer: at >= a few MB per layer the launch cost is noise, and per-layer views keep
    the host pool free of pointer tables.
    """
    if len(src_layers) != len(dst_layers):
        raise ValueError(
            f"{len(src_layers)} source layers but {len(dst_layers)} destination layers"
        )
    for s, d in zip(src_layers, dst_layers):
        copy_rows(s, d, src_idx, dst_idx, num_valid, config)
