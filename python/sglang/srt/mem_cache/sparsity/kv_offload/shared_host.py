"""One host pool per node under tensor parallelism.

MLA keeps one latent KV row per token that every TP rank computes identically (``kv_a_proj`` is
replicated), so a host pool per rank holds ``tp_size`` copies of the same bytes. Here the first TP
rank of each node creates the pool as a shared-memory file, every rank of the node maps it (and
registers its own mapping with CUDA), and only the first rank writes backups into it; all ranks
read it. The name is unlinked as soon as every rank has mapped it, so nothing is left in
``/dev/shm`` whatever happens to the processes later.

Ordering. A rank that does not write learns that the writer's backup finished through the
controller's MIN all-reduce of completed backups (no rank completes a backup before every rank
does). A host slot is rewritten only after it was freed on every rank, and the writer's copy is
ordered after every forward it launched so far (``KVOffloadCoordinator._after_inflight_forward``);
each TP forward ends with collectives that the other ranks reach only after their own loads of
that forward, so no rank can still be reading a slot the writer overwrites.
"""

from __future__ import annotations

import logging
import math
import os
import uuid
from typing import Optional

import torch
from sglang.srt.mem_cache.pool_host.common import HostTensorAllocator

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"


class SharedHostPoolError(RuntimeError):
    """The node-shared host pool could not be created or mapped."""


class NodeSharedHostAllocator(HostTensorAllocator):
    """``HostTensorAllocator`` whose buffer is shared by the TP ranks of one node.

    ``allocate`` is collective over ``group`` (every rank calls it once, as the host pools of all
    ranks are built together). ``is_writer`` is True on the node's first rank.
    """

    def __init__(
        self,
        group: torch.distributed.ProcessGroup,
        ranks_per_node: int,
        shm_dir: str = SHM_DIR,
    ):
        super().__init__()
        self.group = group
        self.rank = torch.distributed.get_rank(group=group)
        self.world_size = torch.distributed.get_world_size(group=group)
        if ranks_per_node <= 0 or self.world_size % ranks_per_node != 0:
            raise ValueError(
                f"{self.world_size} TP ranks do not split into nodes of {ranks_per_node} ranks"
            )
        self.ranks_per_node = ranks_per_node
        self.node = self.rank // ranks_per_node
        self.is_writer = self.rank % ranks_per_node == 0
        self.shm_dir = shm_dir
        self.path: Optional[str] = None

    def allocate(self, dims: tuple, dtype: torch.dtype, device: str) -> torch.Tensor:
        if str(device) != "cpu":
            raise ValueError(f"a shared host pool lives in host memory, not on {device!r}")
        self.dims, self.dtype = dims, dtype
        nbytes = math.prod(dims) * torch.empty((), dtype=dtype).element_size()
        name = [f"sglang-kv-offload-{os.getpid()}-{uuid.uuid4().hex[:12]}"]
        torch.distributed.broadcast_object_list(
            name, src=torch.distributed.get_global_rank(self.group, 0), group=self.group
        )
        self.path = os.path.join(self.shm_dir, f"{name[0]}-node{self.node}")
        error = self._create(nbytes) if self.is_writer else None
        try:
            self._agree(error, "create")
            buffer, error = None, None
            try:
                buffer = torch.from_file(self.path, shared=True, size=nbytes, dtype=torch.uint8)
            except RuntimeError as exc:
                error = str(exc)
            self._agree(error, "map")
        finally:
            if self.is_writer:
                _unlink(self.path)  # every rank has mapped it (or failed): nothing stays behind
        logger.info(
            "kv_offload host pool: %.2f GB shared by %d TP ranks on node %d (%s)",
            nbytes / 1e9,
            self.ranks_per_node,
            self.node,
            "written by this rank" if self.is_writer else "read-only on this rank",
        )
        return buffer.view(dtype).view(dims)

    def _create(self, nbytes: int) -> Optional[str]:
        """Create and reserve the file (the writer); returns an error message or None."""
        stat = os.statvfs(self.shm_dir)
        free = stat.f_bavail * stat.f_frsize
        if nbytes > free:
            return (
                f"the shared host pool needs {nbytes / 1e9:.2f} GB in {self.shm_dir} but it has "
                f"{free / 1e9:.2f} GB free. Enlarge it (docker: --shm-size or --ipc=host), lower "
                "host_pool_size_gb, or set share_host_pool=false in --kv-offload-config"
            )
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            return f"cannot create {self.path}: {exc}"
        try:
            # Reserve the pages now: a sparse tmpfs file that runs out of space later would kill
            # the process with SIGBUS on first touch instead of failing here.
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            os.close(fd)
            _unlink(self.path)
            return (
                f"cannot reserve {nbytes / 1e9:.2f} GB in {self.shm_dir} ({exc.strerror}). "
                "Enlarge it (docker: --shm-size or --ipc=host), lower host_pool_size_gb, or set "
                "share_host_pool=false in --kv-offload-config"
            )
        os.close(fd)
        return None

    def _agree(self, error: Optional[str], step: str) -> None:
        """All ranks learn whether any rank failed ``step``; every rank raises the same error."""
        errors = [None] * self.world_size
        torch.distributed.all_gather_object(errors, error, group=self.group)
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if failed:
            rank, message = failed[0]
            raise SharedHostPoolError(
                f"kv_offload shared host pool: TP rank {rank} could not {step} it: {message}"
            )


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
