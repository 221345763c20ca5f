"""Per-request offload life cycle for ``--enable-kv-offload`` (the scheduler side).

A request's KV moves through three places:

* **GPU tail** — rows that have a physical KV row behind their logical loc (the allocator's
  logical→physical mapping). Prefill / PD transfer leaves the whole prompt here, and each decode
  token lands here. Attention reads tail rows in place, so a request is runnable the moment it is
  admitted: nothing waits for its backup.
* **host** — complete pages are backed up on the controller's write stream; when the copy finishes,
  ``loc_to_host`` is set and the physical pages are freed (page granular). The tail < 64 stays.
* **sparse slots** — per-request physical rows granted from the same physical allocator and managed
  by the GPU LRU (:mod:`sparse_cache`, :mod:`lru_kernels`): each layer's top-k misses are loaded
  into them just before attention.

A PD decode server with ``pd_direct_to_host`` skips the first place for the prompt: the prefill
side writes it straight into host pages (:meth:`admit_from_host` takes it over from there).

With the radix cache (``share_prefixes``) a request's row may start with a cached prefix: locs the
tree owns, whose index keys and host rows (or, until their backup completes, GPU rows) all its users
read; only the sparse slots are per request. Each page is backed up once, by the first request
admitted with it (``HOST_CLAIMED`` in ``loc_to_host`` marks a claimed page until its backup
completes). Released requests leave no backup in flight: whatever the tree keeps is on the host.

The scheduler-side calls (:meth:`admit`, :meth:`admit_from_host`, :meth:`before_decode_step`,
:meth:`poll`, :meth:`release`) run between forward passes and may touch host state; the per-layer
swap-in inside the forward is the attention adapter's
(:class:`sglang.srt.layers.attention.dsa_offload.adapter.DSAOffloadAdapter`), which reads the
state kept here.
"""

from __future__ import annotations

import logging
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from sglang.srt.mem_cache.sparsity.kv_offload.admission import (
    AdmissionLedger,
    OffloadedRequest,
)
from sglang.srt.mem_cache.sparsity.kv_offload.lru_kernels import PlanReport, PlanWorkspace
from sglang.srt.mem_cache.sparsity.kv_offload.sparse_cache import SparseCacheState

logger = logging.getLogger(__name__)

# ``loc_to_host`` value of a page whose backup a request has claimed (radix cache; see admit).
HOST_CLAIMED = -2


class KVOffloadCoordinator:
    """Owns every request's offload state.

    Args:
        req_to_token: ``ReqToTokenPool.req_to_token`` (logical locs per request position).
        allocator: ``KVOffloadTokenToKVPoolAllocator`` (logical, physical and host bookkeeping).
        controller: ``KVOffloadCacheController`` (loads and backups).
        sparse_cache: the GPU LRU state; its slot allocator is the physical allocator.
        max_bs: the largest decode batch (CUDA-graph capture size); sizes the plan workspace
            the attention adapter plans into.
        pd_direct_to_host: PD prompts arrive in host pages (:meth:`admit_from_host`), not GPU rows.
        tail_pages: GPU tail pages a decoding request may hold beyond its slots (2; speculative
            decoding allocates draft positions ahead, see ``runtime.speculative_shape``).
        verify_tokens: tokens per request of a speculative target verify (1: no speculation).
        forward_stream: the stream the model runner's forwards run on (``ModelRunner.forward_stream``).
            Under the overlap scheduler the scheduler-side calls run while the previous batch's
            forward is still in flight; each first makes the current stream wait for this one, so
            their device work (backups of pages that forward writes, LRU and mapping updates it
            reads, slot and row reuse) is ordered after it, as HiSparse's producer-stream waits do.

    Admission control (what each live request is promised, and whether a new one fits beside
    them) is :attr:`admission`'s (:class:`~.admission.AdmissionLedger`); the coordinator keeps the
    promises as requests are admitted, go sparse and end.
    """

    def __init__(
        self,
        req_to_token: torch.Tensor,
        allocator,
        controller,
        sparse_cache: SparseCacheState,
        max_bs: int,
        pd_direct_to_host: bool = False,
        status_log_interval: int = 0,
        forward_stream: Optional[torch.Stream] = None,
        tail_pages: int = 2,
        verify_tokens: int = 1,
        share_prefixes: bool = False,
    ) -> None:
        self.req_to_token = req_to_token
        self.share_prefixes = share_prefixes
        self.allocator = allocator
        self.controller = controller
        self.sparse_cache = sparse_cache
        self.page_size = allocator.page_size
        self.device = sparse_cache.device
        self.pd_direct_to_host = pd_direct_to_host
        self.forward_stream = forward_stream if self.device.type == "cuda" else None
        self.workspace = PlanWorkspace(
            max_bs, sparse_cache.topk, sparse_cache.max_slots, self.device
        )
        # Speculative target verify plans each request's ``verify_tokens`` top-k rows as one row
        # of their union (``DSAOffloadAdapter``), counting into the decode plan's counters.
        self.verify_workspace = (
            PlanWorkspace(
                max_bs,
                verify_tokens * sparse_cache.topk,
                sparse_cache.max_slots,
                self.device,
                counters_of=self.workspace,
            )
            if verify_tokens > 1
            else None
        )
        self.requests: Dict[int, OffloadedRequest] = {}
        self.admission = AdmissionLedger(allocator, sparse_cache, self.requests, tail_pages)
        # Radix cache: (logical locs, physical rows) of host-only prefix pages read back into GPU
        # rows for an extend (restore_for_extend), released at the next scheduler iteration.
        self._restored: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self.status_log_interval = status_log_interval
        self.decode_steps = 0
        self.report = PlanReport(self.workspace, controller.mem_pool_device.row_bytes)
        self._serving = False
        self.initial_free = self.allocator.free_counts()
        self.stats = {
            "admitted": 0,
            "admitted_from_host": 0,
            "released": 0,
            "backup_tokens": 0,
            "deferred_backups": 0,
            "slots_from_own_rows": 0,
            "shared_prefix_tokens": 0,
            "release_drains": 0,
            "restored_prefix_tokens": 0,
            "resident": 0,
        }

    # ------------------------------------------------------------------ scheduler side
    def admit(
        self,
        req_pool_idx: int,
        seq_len: int,
        written_len: Optional[int] = None,
        final_len: Optional[int] = None,
    ) -> None:
        """Take over a request whose prompt KV sits in GPU tail rows (after prefill or PD transfer).

        ``seq_len`` positions have logical locs; the first ``written_len`` (default: all) have their
        KV written. A request that may reach ``final_len`` positions (default: unknown) in no more
        rows than its sparse slots and tail pages stays in its GPU rows (resident); any other starts the backup of its complete
        written pages and asks for sparse slots, neither waited for. Raises if the request is
        already admitted (exactly-once).
        """
        r = int(req_pool_idx)
        if r in self.requests:
            raise RuntimeError(f"kv_offload: req_pool_idx {r} is already admitted")
        self._after_inflight_forward()
        self._start_serving()
        n = int(seq_len)
        req = OffloadedRequest(
            req_pool_idx=r, seq_len=n, written_len=n if written_len is None else int(written_len)
        )
        on_host_only = self._claim_prompt_pages(req) if self.share_prefixes else False
        # A cached prefix on the host only must be loaded into slots: not resident.
        if final_len is None:  # promised at staging, or unknown (then sparse)
            final_len = self.admission.final_len(r)
        req.resident = self.admission.resident_len(final_len) and not on_host_only
        self.requests[r] = req
        self.admission.admitted(r, resident_len=final_len if req.resident else None)
        self.stats["admitted"] += 1
        self.stats["resident"] += req.resident
        self._grant_slots(req)
        self._start_backups([req])
        if on_host_only and req.slots_from_backup:
            self._drain()  # its first step has misses: its slots cannot wait for the backup
        if on_host_only and not req.has_slots:
            # Its cached prefix is on the host only: without slots no miss could be placed.
            req.fail_reason = self._no_slots_reason(req)

    def _claim_prompt_pages(self, req: OffloadedRequest, end: Optional[int] = None) -> bool:
        """Radix cache: split the written prompt pages (those before ``end``, default all) into
        those another request backs up (a cached prefix: host slot set or claimed) and this
        request's own, which it claims.

        One small device read per admission. Returns whether some prefix page is on the host only.
        """
        page = self.page_size
        full = req.written_len // page * page
        req.backed_up_end = full
        end = full if end is None else end
        if end == 0:
            return False
        locs = self.req_to_token[req.req_pool_idx, :end].to(torch.int64)
        firsts = locs[::page]
        host = self.allocator.loc_to_host[firsts].cpu()
        mine = host == -1
        if bool(mine.any()):
            own = locs.view(-1, page)[mine.to(locs.device)].reshape(-1)
            self.allocator.set_host_locs(own, HOST_CLAIMED)
            req.own_pages = own
        self.stats["shared_prefix_tokens"] += int((~mine).sum()) * page
        return bool((host >= 0).any())

    def admit_from_host(self, req_pool_idx: int, prompt_len: int, prefix_len: int = 0) -> None:
        """Take over a PD request whose prompt KV the prefill side wrote into host pages.

        Positions ``[prefix_len, prompt_len)`` have logical locs and host slots in ``loc_to_host``
        (whole pages, from ``alloc_extend_to_host``) and no physical row; the first ``prefix_len``
        (whole pages of the decode server's radix cache) are the tree's, on the host or in GPU
        rows, and pages of them without a backup are claimed as in :meth:`admit`. Complete pages stay on the host
        as they are: no backup runs. A partial last page (``prompt_len % page_size`` rows) becomes
        the GPU decode tail, exactly as after a staged admission: it gets a physical page, its
        prompt rows are loaded from the host on the current stream and the host page is returned
        once that load has read it. Decode tokens then continue the page on the GPU, and its backup,
        once the page is complete, copies 64 correct rows.

        Sparse slots are granted first: every prompt row is on the host, so without slots nothing
        could be read. Raises RuntimeError, with nothing changed, when the prompt is not on the host
        or the physical pool cannot give the slots and the tail page (the pool is sized so that it
        can; see ``runtime.build_device_pool``).
        """
        r = int(req_pool_idx)
        if r in self.requests:
            raise RuntimeError(f"kv_offload: req_pool_idx {r} is already admitted")
        self._after_inflight_forward()
        self._start_serving()
        n, prefix = int(prompt_len), int(prefix_len)
        page = self.page_size
        full = n // page * page
        locs = self.req_to_token[r, :n].to(torch.int64)
        host = self.allocator.loc_to_host[locs].cpu()  # one small sync per admission
        if n == 0 or bool((host[prefix:] < 0).any()):
            raise RuntimeError(
                f"kv_offload: req_pool_idx {r} has {int((host[prefix:] < 0).sum())} of "
                f"{n - prefix} transferred prompt positions without a host slot; direct-to-host "
                "requests must be pre-allocated with alloc_extend_to_host (runtime.pd_prealloc)"
            )
        if not self.sparse_cache.admit(r, n):
            raise RuntimeError(
                f"kv_offload: no sparse slots for direct-to-host req_pool_idx {r} "
                "(the GPU budget is full). Its prompt is on the host only, so it cannot run "
                "without them; pd_can_admit keeps their rows free, so this is a bug to report"
            )
        if n > full:
            physical = self.allocator.hisparse_attn_allocator.alloc(page)
            if physical is None:
                self.sparse_cache.release(r)
                raise RuntimeError(
                    f"kv_offload: no physical page for the decode tail of direct-to-host "
                    f"req_pool_idx {r} (the GPU budget is full); pd_can_admit keeps its rows free, "
                    "so this is a bug to report"
                )
            tail_locs = locs[full:]
            tail_rows = physical[: n - full]
            page_locs = tail_locs[0] + torch.arange(page, device=tail_locs.device)
            host_page = host[full] + torch.arange(page, dtype=torch.int64)
            self.allocator.map_rows(tail_locs, tail_rows)
            self.controller.load_rows(host_page[: n - full], tail_rows)
            self.allocator.set_host_locs(page_locs, -1)
            self.controller.free_host_when_read(host_page)
        req = OffloadedRequest(
            req_pool_idx=r, seq_len=n, written_len=n, backed_up_end=full, has_slots=True
        )
        if prefix:
            self._claim_prompt_pages(req, prefix)
        self.requests[r] = req
        self.admission.admitted(r)
        self.stats["admitted"] += 1
        self.stats["admitted_from_host"] += 1
        if req.own_pages is not None:
            self._start_backups([req])

    def before_decode_step(
        self,
        req_pool_indices: Sequence[int],
        seq_lens: Sequence[int],
        written_lens: Sequence[int],
    ) -> List[Tuple[int, str]]:
        """Between forwards: complete finished backups, back up newly completed pages, grow slots.

        ``seq_lens`` are the lengths including the token about to be decoded (whose logical loc and
        tail row are already allocated, but whose KV the coming forward writes): only the
        written positions, ``written_lens`` (``seq_len - 1`` in plain decode; the committed tokens
        under speculative decoding, whose draft positions up to ``seq_len`` are allocated ahead),
        are backed up, so a page completed by the coming token waits for the next step.

        Returns ``(req_pool_idx, reason)`` for requests that must fail now rather than attend
        rows they could not be given: slots that could not grow with the context, or a plan error
        flag raised by an earlier step (then every request of the step).
        """
        # Slot growth and new backups change state the in-flight forward reads and copy rows it
        # writes: all of it after that forward.
        self._after_inflight_forward()
        self.poll()
        self.decode_steps += 1
        if self.status_log_interval and self.decode_steps % self.status_log_interval == 0:
            logger.info("%s", self.status_line())
        failed: List[Tuple[int, str]] = []
        new_errors = self.report.new_errors()
        if new_errors:
            reason = self.report.describe(new_errors)
            logger.error("kv_offload: %s; failing the %d running requests", reason, len(seq_lens))
            failed = [(int(r), reason) for r in req_pool_indices]
        reqs = []
        for r, n, w in zip(req_pool_indices, seq_lens, written_lens):
            req = self.requests.get(int(r))
            if req is None:
                continue  # not offloaded (e.g. admitted in this very step by the caller later)
            req.seq_len = int(n)
            req.written_len = int(w)
            if req.fail_reason is not None:
                failed.append((req.req_pool_idx, req.fail_reason))
            elif not self._grant_slots(req):
                failed.append((req.req_pool_idx, self._no_slots_reason(req)))
            reqs.append(req)
        self._start_backups(reqs)
        self.report.launch()
        return failed

    def status_line(self) -> str:
        """One line of offload state for the log (host-side counters only: no device sync)."""
        free = self.allocator.free_counts()
        st = self.stats
        return (
            f"kv_offload: step {self.decode_steps}, {len(self.requests)} requests "
            f"({sum(not r.has_slots and not r.resident for r in self.requests.values())} "
            "waiting for slots), "
            f"{sum(r.resident for r in self.requests.values())} resident, "
            f"{len(self.admission)} promised, {self.admission.owed_rows()} rows owed; free logical "
            f"{free['logical']}, physical {free['physical']}, host {free.get('host', 0)}; backed "
            f"up {st['backup_tokens']} tokens ({st['deferred_backups']} deferred), "
            f"{st['slots_from_own_rows']} paid their slots with their own rows, admitted "
            f"{st['admitted']} ({st['admitted_from_host']} from host), released {st['released']}"
        )

    def restore_for_extend(self, prefixes: Sequence[torch.Tensor]) -> None:
        """Before an extend (prefill chunk) whose requests start with a cached prefix: read every
        prefix page that has no GPU row (backed up, physical rows freed) back from the host into
        fresh physical pages, mapped as tail rows, on the current stream (the forward follows).

        The prefill reads the whole prefix through the logical->physical mapping; decode steps
        of other requests read a mapped page as tail rows too (same content). The pages are
        released by :meth:`release_restored` at the next scheduler iteration, after that extend
        (the prefix's tree nodes are locked by the requests until then). One device read.
        Raises RuntimeError when the physical pool cannot hold them (``can_stage_prefill`` counts
        the whole prompt, prefix included, as staging, so it can).
        """
        page = self.page_size
        mapping = self.allocator.full_to_hisparse_device_index_mapping
        locs = torch.cat([p.to(mapping.device, torch.int64) for p in prefixes])
        first = torch.unique(locs // page) * page
        first = first[mapping[first] <= 0].cpu()  # the one sync
        if first.numel() == 0:
            return
        self._after_inflight_forward()
        n = first.numel() * page
        physical = self.allocator.hisparse_attn_allocator.alloc(n)
        if physical is None:
            raise RuntimeError(
                f"kv_offload: no GPU rows to read {n} cached prefix tokens back for a prefill "
                f"({self.allocator.physical_available_size()} free)"
            )
        logical = (first[:, None] + torch.arange(page)).reshape(-1).to(mapping.device)
        host = self.allocator.loc_to_host[logical]
        self.controller.load_rows(host, physical)
        self.allocator.map_rows(logical, physical)
        self._restored.append((logical, physical))
        self.stats["restored_prefix_tokens"] += n

    def release_restored(self) -> None:
        """Give back the pages :meth:`restore_for_extend` mapped, after the extends that read
        them (ordered after the forward in flight)."""
        if not self._restored:
            return
        self._after_inflight_forward()
        logical = torch.cat([lg for lg, _ in self._restored])
        physical = torch.cat([ph for _, ph in self._restored])
        self._restored = []
        mapping = self.allocator.full_to_hisparse_device_index_mapping
        # A page the tree evicted meanwhile was freed with its rows: not ours to free any more.
        ours = (mapping[logical] == physical.to(mapping.dtype)).view(-1, self.page_size).all(1)
        ours = ours.cpu()
        if bool(ours.any()):
            keep = ours.repeat_interleave(self.page_size).to(logical.device)
            self.allocator.release_physical(logical[keep])

    def poll(self) -> int:
        """Complete finished backups without blocking; returns how many completed. Called once per
        scheduler iteration (``runtime.on_scheduler_iteration``) and by :meth:`before_decode_step`,
        whose slot grants read the free counts; besides them only the blocking drains complete
        backups (reads such as :meth:`offload_state` do not). Completion frees physical pages and
        changes the mapping an in-flight forward reads, so it is ordered after it; an iteration
        that completes nothing changes nothing and leaves the scheduler's stream alone (under the
        overlap scheduler that stream prepares the next batch beside the forward)."""
        return self._completed(self.controller.poll(before_complete=self._after_inflight_forward))

    def _drain(self) -> None:
        """Wait for every backup and complete it (:meth:`_completed`)."""
        self._completed(self.controller.drain())

    def _completed(self, handles) -> int:
        """After backups completed (their rows freed): grant the slots of the requests that pay
        for them with those rows. Returns how many completed."""
        for h in handles:
            req = self.requests.get(h.tag)
            if req is None or not req.slots_from_backup:
                continue
            req.slots_from_backup = False
            req.has_slots = self.sparse_cache.admit(req.req_pool_idx, req.seq_len)
            if not req.has_slots:  # its freed rows were taken: it cannot be served
                req.fail_reason = self._no_slots_reason(req)
        return len(handles)

    def release(self, req_pool_idx: int, kv_len: int = 0) -> bool:
        """Finish / abort / retract / failed transfer. Exactly once; a second call does nothing.

        Frees the sparse slots and LRU entries, cancels in-flight backups (their host slots are
        returned when the copy ends). The caller frees the request's logical locs and, through the
        allocator, their physical rows and host slots (upstream's ``release_kv_cache`` path).

        With the radix cache the tree may keep any of the request's complete pages (and frees
        the rest, duplicates of pages it had included), so nothing is cancelled: the request's
        complete written pages not yet backed up are backed up now and every backup is waited for
        (:meth:`_flush_for_tree`). The tree then owns host rows only.
        """
        self.admission.withdraw(req_pool_idx)
        req = self.requests.pop(int(req_pool_idx), None)
        if req is None:
            if self.share_prefixes and kv_len >= self.page_size:
                self._flush_unadmitted(int(req_pool_idx), int(kv_len))
            return False
        self._after_inflight_forward()
        self.sparse_cache.release(req.req_pool_idx)
        if self.share_prefixes:
            self._flush_for_tree(req)
        else:
            self.controller.cancel_tag(req.req_pool_idx)
        self.stats["released"] += 1
        return True

    def drain(self) -> None:
        """Wait for every backup (shutdown, tests, the idle leak check)."""
        self._drain()

    def before_relocation(self) -> None:
        """Before the arena moves physical pages: every forward launched so far and every backup
        (the write stream reads physical rows) are done with the old rows. Nothing completes
        here: a completion frees rows and grants slots, which would take pages the arena is
        moving; the next :meth:`poll` completes them."""
        self._after_inflight_forward()
        self.controller.wait_copies()

    def relocate_rows(self, remap) -> None:
        """Rewrite the physical rows held here (sparse slots, pages read back for a prefill)."""
        ocls = self.sparse_cache.out_cache_loc_sparse
        ocls.copy_(remap(ocls))
        self._restored = [(logical, remap(physical)) for logical, physical in self._restored]

    def _flush_unadmitted(self, r: int, kv_len: int) -> None:
        """Radix cache: a request released before any decode step (finished by its prefill,
        aborted or retracted while prefilling) leaves prompt pages the tree may keep in GPU rows
        that nobody has claimed: back them up now and wait (as :meth:`_flush_for_tree`)."""
        page = self.page_size
        full = kv_len // page * page
        locs = self.req_to_token[r, :full].to(torch.int64)
        host = self.allocator.loc_to_host[locs[::page]].cpu()
        mine = host == -1
        if not bool(mine.any()):
            return
        self._after_inflight_forward()
        own = locs.view(-1, page)[mine.to(locs.device)].reshape(-1)
        if self.controller.backup_batch([(r, own, 0, full)]) is None:
            logger.warning(
                "kv_offload: host pool full when req %d ended before decoding; its prompt pages "
                "stay in GPU rows until the radix cache evicts them or a request claims them",
                r,
            )
            return
        self.stats["backup_tokens"] += own.numel()
        self.stats["release_drains"] += 1
        self._drain()

    def _flush_for_tree(self, req: OffloadedRequest) -> None:
        """Back up ``req``'s complete pages that have no backup yet and wait for every backup in
        flight, so that no backup completes after the tree has freed (or another request reads as
        backed up) a page of this request.

        Its KV is written up to ``seq_len`` (the last decode step's forward writes the last
        position; a later one of the overlap scheduler, if any, is ordered before the copy). Pages
        past what the tree keeps are backed up for nothing and freed with the request. Blocking:
        one wait for the write stream, which runs after the forward in flight
        (docs/kv_offload_design.md, "Radix cache").
        """
        req.written_len = max(req.written_len, req.seq_len)
        # Backups wait for slots only for the plan's sake; this request (popped) plans no more.
        req.has_slots = True
        self._start_backups([req])
        if req.own_pages is not None:
            # Unclaimed again, so that a later request with this prefix backs them up.
            self.allocator.set_host_locs(req.own_pages, -1)
        if req.own_pages is not None or req.backed_up_end < req.written_len // self.page_size * (
            self.page_size
        ):
            logger.warning(
                "kv_offload: host pool full when req %d ended; its last pages stay in GPU rows "
                "until the radix cache evicts them",
                req.req_pool_idx,
            )
        if self.controller.has_inflight():
            self.stats["release_drains"] += 1
            self._drain()

    # ------------------------------------------------------------------ helpers
    def _after_inflight_forward(self) -> None:
        """Order the current stream's next work after every forward launched so far (no host
        sync). The caller then changes state those forwards read or write."""
        if self.forward_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.forward_stream)

    def _start_serving(self) -> None:
        """At the first admission: forget what the CUDA-graph capture warm-ups left in the plan
        counters and error flags (they plan dummy rows of a request with no slots)."""
        if self._serving:
            return
        self._serving = True
        self.report.reset()

    def _grant_slots(self, req: OffloadedRequest) -> bool:
        """Slots for ``req``'s context; False only when it holds slots that could not grow (it
        would overflow them). A resident request needs none unless it outgrows its slots (then it
        goes sparse). A sparse one takes free rows only beyond every other request's promise;
        otherwise, when its own complete prompt pages are enough, their backup pays for its slots
        (granted when it frees them, :meth:`_completed`), else it waits. Until then it keeps its
        KV in its tail rows, where the plan reads every position in place."""
        if req.resident:
            if self.admission.resident_len(req.seq_len):
                return True
            req.resident = False
            self.admission.admitted(req.req_pool_idx)
            logger.warning(
                "kv_offload: req %d outgrew its %d GPU rows (more tokens than its max_new_tokens "
                "promised); it goes sparse",
                req.req_pool_idx,
                self.admission.sparse_rows,
            )
        if req.has_slots:
            return self.sparse_cache.grow(req.req_pool_idx, req.seq_len)
        if req.slots_from_backup:
            return True
        r = req.req_pool_idx
        need = self.sparse_cache.slots_for(req.seq_len)
        if self.allocator.fits(max(0, need - self.admission.owed(r)), 0):
            req.has_slots = self.sparse_cache.admit(r, req.seq_len)
        if not req.has_slots:
            req.slots_from_backup = self._own_backup_rows(req) >= need
            self.stats["slots_from_own_rows"] += req.slots_from_backup
            if not req.slots_from_backup:
                logger.debug("kv_offload: no sparse slots for req %d yet", r)
        return True

    def _own_backup_rows(self, req: OffloadedRequest) -> int:
        """Rows ``req``'s next backup frees: its complete written pages no backup has started
        for and its claimed prompt pages."""
        end = req.written_len // self.page_size * self.page_size
        own = req.own_pages.numel() if req.own_pages is not None else 0
        return max(0, end - req.backed_up_end) + own

    def _no_slots_reason(self, req: OffloadedRequest) -> str:
        return (
            f"kv offload could not grow the sparse slots of this request to "
            f"{self.sparse_cache.slots_for(req.seq_len)} rows at {req.seq_len} tokens "
            "(the GPU budget is full); raise --mem-fraction-static or lower "
            "--max-running-requests"
        )

    def offload_state(self) -> Dict[str, object]:
        """What ``GET /get_server_info`` reports as ``internal_states[i]["kv_offload"]``: free
        counts now and at start (equal when nothing leaked), live requests and counters.

        A pure read: backups that finished since the last :meth:`poll` still count as in flight
        (their rows as used) until the next scheduler iteration completes them."""
        return {
            "free": self.allocator.free_counts(),
            "initial_free": dict(self.initial_free),
            "host_pending_free": self.allocator.host_pending_free,
            "requests": len(self.requests),
            "promised": len(self.admission),
            "prefill_waits": self.admission.prefill_waits,
            "sparse_slots_held": sum(self.sparse_cache.num_slots_cpu),
            "backups_in_flight": len(self.controller.inflight),
            "host_pool": self.controller.host_pool_info(),
            "arena": self.allocator.arena.state(),
            "resident_requests": sum(r.resident for r in self.requests.values()),
            "decode_steps": self.decode_steps,
            "error_flags": self.report.error_flags_seen,
            **self.stats,
            **self.report.counters(),
        }

    def _start_backups(self, reqs: Iterable[OffloadedRequest]) -> None:
        items: List[Tuple[int, torch.Tensor, int, int]] = []
        pending: List[Tuple[OffloadedRequest, int]] = []
        for req in reqs:
            end = req.written_len // self.page_size * self.page_size
            # Only requests that hold sparse slots, or are granted them when this backup frees
            # its rows, give up their tail rows: without slots the plan could not place a miss.
            waits = not (req.has_slots or req.slots_from_backup)
            if waits or (end <= req.backed_up_end and req.own_pages is None):
                continue
            locs = self.req_to_token[req.req_pool_idx, req.backed_up_end : end].to(torch.int64)
            if req.own_pages is not None:  # claimed prompt pages before backed_up_end
                locs = torch.cat([req.own_pages, locs])
            items.append((req.req_pool_idx, locs, req.backed_up_end, max(end, req.backed_up_end)))
            pending.append((req, max(end, req.backed_up_end)))
        if not items:
            return
        handles = self.controller.backup_batch(items)
        if handles is None:
            self.stats["deferred_backups"] += 1
            return
        for (req, end), (_, locs, _, _) in zip(pending, items):
            self.stats["backup_tokens"] += locs.numel()
            req.backed_up_end = end
            req.own_pages = None
