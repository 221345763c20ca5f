"""The node-shared host pool (shared_host.py): real processes, a real gloo group, real files.

Each case spawns one process per TP rank; the ranks build a ``NodeSharedHostAllocator`` over the
gloo world group, as the scheduler processes of a TP server do over their CPU group. The real
server under TP=2 is in ``test_real_server.py`` (``TestTensorParallel``).
"""

from __future__ import annotations

import os
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from sglang.srt.mem_cache.sparsity.kv_offload.shared_host import NodeSharedHostAllocator

ROWS, ROW_BYTES = 256, 1152
DIMS = (
    2,
    ROWS,
    1,
    ROW_BYTES // 2,
)  # (layers, tokens, 1, dim) bf16: the host pool's layer_first shape


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mapping_inode(path_prefix: str):
    """(inode, bytes mapped) of this process's mappings of files starting with ``path_prefix``."""
    found = {}
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith(path_prefix):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                inode = int(parts[4])
                found[inode] = found.get(inode, 0) + hi - lo
    return found


def _rank_main(rank, world, ranks_per_node, port, shm_dir, dims, on_gpu, results):
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
        alloc = NodeSharedHostAllocator(dist.group.WORLD, ranks_per_node, shm_dir=shm_dir)
        try:
            if on_gpu:
                from sglang.srt.mem_cache.pool_host.common import alloc_with_host_register

                buf = alloc_with_host_register(dims, torch.bfloat16, "cpu", True, alloc)
            else:
                buf = alloc.allocate(dims, torch.bfloat16, "cpu")
        except Exception as exc:  # noqa: BLE001 - reported to the test
            results.put((rank, "error", f"{type(exc).__name__}: {exc}"))
            return
        rows = buf[1].view(ROWS, -1).view(torch.uint8)
        gen = torch.Generator().manual_seed(1 + alloc.node)
        expect = torch.randint(0, 256, rows.shape, dtype=torch.uint8, generator=gen)
        if alloc.is_writer:
            if on_gpu:  # a backup: GPU rows copied into the host pool by the UVA kernel
                from sglang.srt.mem_cache.sparsity.kv_offload.transfer import copy_rows

                idx = torch.arange(ROWS, device="cuda")
                copy_rows(expect.cuda(), rows, idx, idx)
                torch.cuda.synchronize()
            else:
                rows.copy_(expect)
        dist.barrier()
        if on_gpu:  # a load: host rows read into this rank's GPU
            from sglang.srt.mem_cache.sparsity.kv_offload.transfer import copy_rows

            seen = torch.zeros(rows.shape, dtype=torch.uint8, device="cuda")
            idx = torch.arange(ROWS, device="cuda")
            copy_rows(rows, seen, idx, idx)
            torch.cuda.synchronize()
            seen = seen.cpu()
        else:
            seen = rows.clone()
        prefix = os.path.join(shm_dir, "sglang-kv-offload-")
        results.put(
            (rank, "ok", alloc.is_writer, bool(torch.equal(seen, expect)), _mapping_inode(prefix))
        )
        dist.barrier()  # keep every mapping alive until all ranks have reported
    except Exception:  # noqa: BLE001
        results.put((rank, "crash", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run(world, ranks_per_node, shm_dir, dims=DIMS, on_gpu=False):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(r, world, ranks_per_node, port, str(shm_dir), dims, on_gpu, results),
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    out = sorted(results.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    crashed = [o for o in out if o[1] == "crash"]
    assert not crashed, crashed
    return out


def test_one_copy_per_node_written_by_its_first_rank(tmp_path):
    out = _run(world=2, ranks_per_node=2, shm_dir=tmp_path)
    (_, s0, writer0, ok0, maps0), (_, s1, writer1, ok1, maps1) = out
    assert (s0, s1) == ("ok", "ok")
    assert (writer0, writer1) == (True, False)
    assert ok0 and ok1, "the reading rank does not see what the writing rank wrote"
    # Both ranks map the same file (one inode) of exactly the pool's size: host memory counted once.
    pool_bytes = torch.Size(DIMS).numel() * 2
    assert len(maps0) == 1 and maps0 == maps1
    assert sum(maps0.values()) == pool_bytes
    assert os.listdir(tmp_path) == [], "the shared file must be unlinked once every rank mapped it"


def test_one_copy_per_node_on_two_nodes(tmp_path):
    # Four ranks as two nodes of two: each node has its own copy and its own writer.
    out = _run(world=4, ranks_per_node=2, shm_dir=tmp_path)
    assert [o[1] for o in out] == ["ok"] * 4
    assert [o[2] for o in out] == [True, False, True, False]
    assert all(o[3] for o in out)
    inodes = [set(o[4]) for o in out]
    assert inodes[0] == inodes[1] and inodes[2] == inodes[3] and inodes[0] != inodes[2]
    assert os.listdir(tmp_path) == []


def test_too_large_for_the_shared_memory_dir_fails_on_every_rank(tmp_path):
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    dims = (1, free // 1024 + 1, 1, 512)  # 1024 B per token: just over what the directory holds
    out = _run(world=2, ranks_per_node=2, shm_dir=tmp_path, dims=dims)
    assert [o[1] for o in out] == ["error", "error"]
    for _, _, message in out:
        assert "TP rank 0 could not create it" in message
        assert "--shm-size" in message and "share_host_pool=false" in message
    assert os.listdir(tmp_path) == []


def test_ranks_that_do_not_split_into_nodes_are_rejected():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_port()}", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="do not split into nodes of 2 ranks"):
            NodeSharedHostAllocator(dist.group.WORLD, ranks_per_node=2)
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_shared_pool_registered_in_every_rank(tmp_path):
    """cudaHostRegister on each rank's mapping: rank 0's GPU writes, rank 1's GPU reads (UVA)."""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else tmp_path
    out = _run(world=2, ranks_per_node=2, shm_dir=shm, on_gpu=True)
    assert [o[1] for o in out] == ["ok", "ok"], out
    assert all(o[3] for o in out)
    assert out[0][4] == out[1][4] and len(out[0][4]) == 1
