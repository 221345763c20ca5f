"""PD decode receive path into kv offload, over a real Mooncake transfer engine (TCP, 127.0.0.1).

Runs twice: with the prompt KV destination on the GPU (physical pages, backed up after admission)
and with ``pd_direct_to_host`` (host pool pages, no GPU staging, no backup). Three spawned processes
per run (the pytest process only orchestrates):

- decode: the kv offload pools and coordinator built by ``runtime.build_device_pool`` + ``runtime.build_allocator`` (fp8 656 B
  rows, 2 layers); registers the KV buffers the patched ``_init_kv_manager`` registers
  (``KVOffloadHooks.pd_kv_buf_infos``: device pool, or host pool) and the index-state buffers (logical pages)
  with sglang's ``MooncakeTransferEngine``; pre-allocates requests through the patched
  ``DecodePreallocQueue._pre_alloc`` and computes the destination pages as the patched
  ``pop_preallocated`` does (KV: ``kv_to_page_indices(pd_kv_destination_locs(locs))``; state:
  ``kv_to_page_indices(locs)``);
- prefill (two of them): an upstream ``NSATokenToKVPool`` with the same page layout holding random KV
  and index pages; writes them to the decode side page by page with ``batch_transfer_sync``, with the
  per-page pointer arithmetic of ``MooncakeKVManager._send_kvcache_generic`` (src ``ptr + page *
  item_len``, dst likewise, one item per page and layer buffer), then reports what it sent.

The decode side checks the received bytes (KV through logical -> physical or logical -> host, index
pages by logical page) and the physical allocator (direct-to-host: untouched by the transfer), admits
the requests into the coordinator (direct-to-host: ``KVOffloadHooks.admit_transferred``, as the patched
``process_decode_queue`` does), drains the backups and checks the host copies of the complete pages
and the GPU tails, then releases everything through the patched
``release_kv_cache`` and checks that every allocator's free count is back at its start. Failures: a
prefill process killed mid-transfer (the decode side sees the connection drop, or times out waiting
for "done") and a sender that sends fewer pages than expected (page-count check before admission);
both abort the request the way decode.py's ``KVPoll.Failed`` branch does.

The native libraries the Mooncake wheel needs (libibverbs, libnl) come from
``scripts/env/fetch_debian_libs.sh`` (``make test`` / ``kv_offload_tree.py build`` run it); without them
this test fails, it does not skip.
"""

import ctypes
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import pytest

P = 64
LAYERS = 2
ROW = 656
OK_PROMPTS = (1, 63, 64, 65, 200)
SHORT_PROMPTS = (130, 100)  # the sender drops the last page of the first one
LONG_PROMPT = 1000  # 16 pages; its sender is killed after DIE_AFTER_PAGES
DIE_AFTER_PAGES = 6
DONE_TIMEOUT_S = 20.0  # decode: how long to wait for a sender's "done"
RUN_TIMEOUT_S = 150.0  # the whole three-process run
MODES = ("gpu_pages", "direct_to_host")  # where the prompt KV lands on the decode side

LIBS = ("libnl-3.so.200", "libnl-route-3.so.200", "libibverbs.so.1")
FETCH_SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "env" / "fetch_debian_libs.sh"

logger = logging.getLogger("test_mooncake_pd")


# --------------------------------------------------------------------------------------------------
# Native libraries for the Mooncake wheel
# --------------------------------------------------------------------------------------------------


def _debian_lib_dir() -> Optional[str]:
    """The folder holding libibverbs + libnl: env override, the venv's record, or the cache."""
    candidates = [os.environ.get("KV_OFFLOAD_DEBIAN_LIBS")]
    pointer = Path(sys.prefix) / "kv-offload-debian-libs"
    if pointer.exists():
        candidates.append(pointer.read_text().strip())
    cache = os.environ.get("KV_OFFLOAD_CACHE", str(Path.home() / ".cache" / "kv-offload"))
    candidates.append(os.path.join(cache, "debroot", "lib"))
    for d in candidates:
        if d and all(os.path.exists(os.path.join(d, so)) for so in LIBS):
            return d
    return None


def _system_has_ibverbs() -> bool:
    try:
        ctypes.CDLL("libibverbs.so.1")
        return True
    except OSError:
        return False


def _require_debian_libs() -> Optional[str]:
    """The lib folder (None: the system has them); fails the test with the fix when they are absent."""
    d = _debian_lib_dir()
    if d is not None or _system_has_ibverbs():
        return d
    res = subprocess.run(["bash", str(FETCH_SCRIPT)], capture_output=True, text=True)
    d = _debian_lib_dir()
    if d is None:
        pytest.fail(
            "Mooncake needs libibverbs.so.1, libnl-3.so.200 and libnl-route-3.so.200 and none were "
            f"found ($KV_OFFLOAD_DEBIAN_LIBS, {sys.prefix}/kv-offload-debian-libs, the cache's "
            f"debroot/lib). Running {FETCH_SCRIPT} failed (rc {res.returncode}): "
            f"{res.stderr.strip()[-2000:]}. Install Debian libibverbs1 libnl-3-200 libnl-route-3-200 "
            "or make `apt-get download` work, then rerun `make test`.",
            pytrace=False,
        )
    return d


def _import_mooncake(lib_dir: Optional[str]) -> None:
    """Preload the libraries (RTLD_GLOBAL, so the wheel's DT_NEEDED resolve to them), then import."""
    os.environ.setdefault("MC_FORCE_TCP", "1")  # TCP even where an RDMA device exists
    if lib_dir is not None:
        for so in LIBS:
            ctypes.CDLL(os.path.join(lib_dir, so), mode=ctypes.RTLD_GLOBAL)
    from mooncake.engine import (  # noqa: F401  (fails here, clearly, if still missing)
        TransferEngine,
    )


def _engine():
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        MooncakeTransferEngine,
    )

    return MooncakeTransferEngine(hostname="127.0.0.1", gpu_id=0, ib_device=None)


def _exit_child(status) -> None:
    status.close()  # a pipe of its own: nothing shared that a killed peer could leave locked
    os._exit(0)  # skip the engine's and torch's teardown; every result has been sent


# --------------------------------------------------------------------------------------------------
# Prefill process
# --------------------------------------------------------------------------------------------------


def _send_pages(engine, session, src_ptrs, dst_ptrs, item_lens, src_pages, dst_pages) -> None:
    """``_send_kvcache_generic`` without the contiguous grouping: one item per page, per layer."""
    for layer in range(len(src_ptrs)):
        item = item_lens[layer]
        srcs = [src_ptrs[layer] + int(s) * item for s in src_pages]
        dsts = [dst_ptrs[layer] + int(d) * item for d in dst_pages]
        rc = engine.batch_transfer_sync(session, srcs, dsts, [item] * len(srcs))
        if rc < 0:
            raise RuntimeError(f"Mooncake batch_transfer_sync failed (rc {rc}) for layer {layer}")


def _prefill_main(conn, status, lib_dir, name) -> None:
    try:
        _import_mooncake(lib_dir)
        import torch
        from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool

        pool = NSATokenToKVPool(
            size=32 * P,
            page_size=P,
            kv_lora_rank=512,
            dtype=torch.float8_e4m3fn,
            qk_rope_head_dim=64,
            layer_num=LAYERS,
            device="cpu",
            index_head_dim=128,
            enable_memory_saver=False,
            kv_cache_dim=ROW,
        )
        engine = _engine()
        kv_ptrs, kv_lens, kv_items = pool.get_contiguous_buf_infos()
        st_ptrs, st_lens, st_items = pool.get_state_buf_infos()
        engine.batch_register(kv_ptrs + st_ptrs, kv_lens + st_lens)
        gen = torch.Generator().manual_seed(1234 + len(name))
        kv_rows = [b.view(b.shape[0], -1).view(torch.uint8) for b in pool.kv_buffer]
        index = pool.index_k_with_scale_buffer
        num_pages = pool.size // P
        while True:
            msg = conn.recv()
            if msg[0] == "exit":
                break
            job = msg[1]
            assert (
                job["kv_item_lens"] == kv_items and job["state_item_lens"] == st_items
            ), "page layouts differ between prefill and decode"
            for buf in kv_rows + index:  # fresh random content for every job
                buf.copy_(torch.randint(0, 256, buf.shape, generator=gen, dtype=torch.uint8))
            # This prefill's own pages for the prompts, shuffled (never the padding page 0).
            free = (torch.randperm(num_pages, generator=gen) + 1).tolist()
            report = {}
            for rid, n, dst_kv, dst_state in job["reqs"]:
                npages = len(dst_kv)
                src = [free.pop() for _ in range(npages)]
                rows = torch.tensor([src[i // P] * P + i % P for i in range(n)])
                report[rid] = {
                    "kv_rows": [kv_rows[l][rows].numpy().copy() for l in range(LAYERS)],
                    "index_pages": [index[l][src].numpy().copy() for l in range(LAYERS)],
                }
                send = npages
                if job["mode"] == "short" and rid == job["reqs"][0][0]:
                    send = npages - 1  # a sender bug: the last page never goes out
                step = 1 if job["mode"] == "die" else send
                for p0 in range(0, send, step):
                    pages = slice(p0, min(send, p0 + step))
                    for ptrs, dptrs, items, dst in (
                        (kv_ptrs, job["kv_ptrs"], kv_items, dst_kv),
                        (st_ptrs, job["state_ptrs"], st_items, dst_state),
                    ):
                        _send_pages(
                            engine, job["session"], ptrs, dptrs, items, src[pages], dst[pages]
                        )
                    if job["mode"] == "die" and pages.stop == DIE_AFTER_PAGES:
                        status.send(("progress", name, pages.stop))
                        time.sleep(3600)  # the orchestrator kills this process now
                report[rid]["kv_pages_sent"] = send
                report[rid]["state_pages_sent"] = send
            conn.send(("done", report))
    except BaseException:
        status.send(("error", name, traceback.format_exc()))
    _exit_child(status)


# --------------------------------------------------------------------------------------------------
# Decode process
# --------------------------------------------------------------------------------------------------


def _wait_done(conn, timeout_s: float):
    """The sender's report, or (None, reason) when it died or went silent."""
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if conn.poll(0.05):
                kind, report = conn.recv()
                return report, None
    except (EOFError, OSError) as e:
        return None, f"prefill connection lost before the transfer completed ({type(e).__name__})"
    return None, f"no transfer completion from prefill within {timeout_s:.0f}s"


class _Decode:
    def __init__(self, direct: bool):

        import sglang.srt.server_args as server_args_module
        from _stand_in_runner import make_runner, offload_global_server_args
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.chunk_cache import ChunkCache

        server_args_module.set_global_server_args_for_scheduler(offload_global_server_args())
        self.direct = direct
        config = {"sparse_slots_per_req": 128, "pd_direct_to_host": direct}
        self.runner = make_runner(max_total_tokens=4096, max_reqs=8, config=config)
        self.pool = self.runner.token_to_kv_pool
        self.allocator = self.runner.token_to_kv_pool_allocator
        self.coordinator = self.allocator.kv_offload.coordinator
        self.host = self.allocator.host_pool
        self.tree_cache = ChunkCache(
            CacheInitParams(
                disable=True,
                req_to_token_pool=self.runner.req_to_token_pool,
                token_to_kv_pool_allocator=self.allocator,
                page_size=P,
            )
        )
        # The fields the patched DecodePreallocQueue._pre_alloc reads.
        self.prealloc_queue = SimpleNamespace(
            req_to_token_pool=self.runner.req_to_token_pool,
            token_to_kv_pool_allocator=self.allocator,
            scheduler=SimpleNamespace(
                enable_hisparse=False, server_args=SimpleNamespace(enable_kv_offload=True)
            ),
        )
        self.engine = _engine()
        self.kv_ptrs, kv_lens, self.kv_items = self.allocator.kv_offload.pd_kv_buf_infos()
        self.st_ptrs, st_lens, self.st_items = self.pool.get_state_buf_infos()
        rc = self.engine.batch_register(self.kv_ptrs + self.st_ptrs, kv_lens + st_lens)
        assert rc == 0, f"batch_register returned {rc}"
        self.start = self.allocator.free_counts()
        # A request already decoding: its sparse slots, backed-up pages (and, direct to host, its
        # host pages) shift the physical and host page ids away from the logical ones, so a
        # destination computed in the wrong space shows.
        self.resident, _, _ = self.prealloc("resident", 200)
        self.admit(self.resident, 200)
        self.coordinator.drain()

    def release_resident(self) -> dict:
        from sglang.srt.mem_cache.common import release_kv_cache

        release_kv_cache(self.resident, self.tree_cache, is_insert=False)
        self.coordinator.drain()
        return {"free_counts": self.allocator.free_counts(), "start_counts": self.start}

    def prealloc(self, rid: str, n: int):
        """The patched ``DecodePreallocQueue._pre_alloc`` + destination pages of ``pop_preallocated``."""
        from _stand_in_runner import new_req
        from sglang.srt.disaggregation.decode import DecodePreallocQueue
        from sglang.srt.disaggregation.utils import kv_to_page_indices

        req = new_req(n)
        req.rid, req.return_logprob, req.finished_reason = rid, False, None
        DecodePreallocQueue._pre_alloc(self.prealloc_queue, req)
        locs = self.runner.req_to_token_pool.req_to_token[req.req_pool_idx, :n]
        dst_kv = kv_to_page_indices(
            self.allocator.kv_offload.pd_kv_destination_locs(locs).numpy(), P
        )
        dst_state = kv_to_page_indices(locs.numpy(), P)
        return req, dst_kv.tolist(), dst_state.tolist()

    def admit(self, req, n: int) -> None:
        """Direct to host: at transfer success (patched ``process_decode_queue``); else the
        coordinator admits from GPU rows (what the first decode step's hook does)."""
        if self.direct:
            self.allocator.kv_offload.admit_transferred([req])
        else:
            self.coordinator.admit(req.req_pool_idx, n)

    def abort(self, req, reason: str) -> str:
        """decode.py's ``KVPoll.Failed`` branch: abort, then release the pre-allocated KV."""
        from sglang.srt.disaggregation.utils import prepare_abort
        from sglang.srt.mem_cache.common import release_kv_cache

        message = f"Decode transfer failed for request {req.rid=}: {reason}"
        logger.error(message)
        prepare_abort(req, message)
        release_kv_cache(req, self.tree_cache, is_insert=False)
        return message

    def check_received(self, req, n, dst_state, sent) -> None:
        import numpy as np

        mapping = self.allocator.full_to_hisparse_device_index_mapping
        locs = self.runner.req_to_token_pool.req_to_token[req.req_pool_idx, :n].long()
        if self.direct:
            host = self.allocator.loc_to_host[locs]
            assert bool((host >= 0).all()), (req.rid, "prompt positions without a host slot")
            assert bool((mapping[locs] == 0).all()), (req.rid, "prompt positions with GPU rows")
        for layer in range(LAYERS):
            if self.direct:
                got = self.host.host_row_view(layer)[host].numpy()
            else:
                got = self.pool.device_row_view(layer)[mapping[locs]].numpy()
            assert np.array_equal(got, sent["kv_rows"][layer]), (req.rid, layer, "KV rows")
            pages = self.pool.index_k_with_scale_buffer[layer][dst_state].numpy()
            assert np.array_equal(pages, sent["index_pages"][layer]), (req.rid, layer, "index")

    def check_offloaded(self, req, n, sent, dst_kv) -> dict:
        import numpy as np

        mapping = self.allocator.full_to_hisparse_device_index_mapping
        loc_to_host = self.allocator.loc_to_host
        locs = self.runner.req_to_token_pool.req_to_token[req.req_pool_idx, :n].long()
        full = n // P * P
        host_slots = loc_to_host[locs[:full]]
        assert bool((host_slots >= 0).all()), (req.rid, "complete pages not on the host")
        assert bool((mapping[locs[:full]] == 0).all()), (req.rid, "backed-up pages kept GPU rows")
        assert bool((loc_to_host[locs[full:]] == -1).all()), (req.rid, "tail went to the host")
        assert bool((mapping[locs[full:]] > 0).all()), (req.rid, "tail lost its GPU rows")
        if self.direct:  # the complete pages stay in the host pages Mooncake wrote
            pages = (host_slots[::P] // P).tolist()
            assert pages == dst_kv[: full // P], (req.rid, "complete pages moved on the host")
        for layer in range(LAYERS):
            expect = sent["kv_rows"][layer]
            on_host = self.host.host_row_view(layer)[host_slots].numpy()
            assert np.array_equal(on_host, expect[:full]), (req.rid, layer, "host copy")
            tail = self.pool.device_row_view(layer)[mapping[locs[full:]]].numpy()
            assert np.array_equal(tail, expect[full:]), (req.rid, layer, "GPU tail")
        return {"host_tokens": full, "gpu_tail": n - full}

    def run_job(self, conn, name: str, prompts, mode: str) -> dict:
        """One PD round: pre-allocate, ask the sender, verify, admit + offload, release."""
        from sglang.srt.mem_cache.common import release_kv_cache

        out = {"aborted": {}, "admitted": {}, "error": None}
        out["start_counts"] = self.allocator.free_counts()
        physical_start = self.allocator.physical_available_size()
        reqs = []
        try:
            for i, n in enumerate(prompts):
                req, dst_kv, dst_state = self.prealloc(f"{name}-{i}", n)
                reqs.append((req, n, dst_kv, dst_state))
            # The KV destination is the physical page space, the state the logical one.
            out["dst"] = {r.rid: (kv, st) for r, _, kv, st in reqs}
            conn.send(
                (
                    "job",
                    {
                        "session": self.engine.session_id,
                        "mode": mode,
                        "kv_ptrs": self.kv_ptrs,
                        "kv_item_lens": self.kv_items,
                        "state_ptrs": self.st_ptrs,
                        "state_item_lens": self.st_items,
                        "reqs": [(r.rid, n, kv, st) for r, n, kv, st in reqs],
                    },
                )
            )
            t0 = time.monotonic()
            report, failure = _wait_done(conn, DONE_TIMEOUT_S)
            out["wait_s"] = time.monotonic() - t0
            # Physical rows taken by pre-allocation + transfer (direct to host: none).
            out["physical_for_transfer"] = physical_start - self.allocator.physical_available_size()
            backups_before = self.coordinator.stats["backup_tokens"]
            sys.stderr.write(f"[decode] {name}: sender answered in {out['wait_s']:.1f}s\n")
            live = []
            for req, n, dst_kv, dst_state in reqs:
                if failure is not None:
                    out["aborted"][req.rid] = self.abort(req, failure)
                    continue
                sent = report[req.rid]
                # Page-count check before admission: every destination page must have been written.
                if (sent["kv_pages_sent"], sent["state_pages_sent"]) != (
                    len(dst_kv),
                    len(dst_state),
                ):
                    reason = (
                        f"page count mismatch: expected {len(dst_kv)} KV / {len(dst_state)} index "
                        f"pages, prefill sent {sent['kv_pages_sent']} / {sent['state_pages_sent']}"
                    )
                    out["aborted"][req.rid] = self.abort(req, reason)
                    continue
                self.check_received(req, n, dst_state, sent)
                self.admit(req, n)
                live.append((req, n, sent, dst_kv))
            self.coordinator.drain()
            out["prompt_backup_tokens"] = self.coordinator.stats["backup_tokens"] - backups_before
            # Held once admitted and backed up: sparse slots plus the GPU tail page of ragged prompts.
            out["physical_held"] = physical_start - self.allocator.physical_available_size()
            out["physical_expected"] = sum(
                self.coordinator.sparse_cache.slots_for(n) + (P if n % P else 0)
                for _, n, _, _ in live
            )
            for req, n, sent, dst_kv in live:
                out["admitted"][req.rid] = self.check_offloaded(req, n, sent, dst_kv)
            for req, _, _, _ in live:  # finish
                release_kv_cache(req, self.tree_cache, is_insert=False)
            self.coordinator.drain()
            out["free_counts"] = self.allocator.free_counts()
            out["requests_left"] = [
                r for r in self.coordinator.requests if r != self.resident.req_pool_idx
            ]
            sys.stderr.write(f"[decode] {name}: done in {time.monotonic() - t0:.1f}s\n")
            self.coordinator.sparse_cache.check_invariants()
        except BaseException:
            out["error"] = traceback.format_exc()
        return out


def _decode_main(conn_ok, conn_die, status, lib_dir, direct) -> None:
    try:
        t0 = time.monotonic()
        _import_mooncake(lib_dir)
        decode = _Decode(direct)
        sys.stderr.write(f"[decode] set up in {time.monotonic() - t0:.1f}s\n")
        results = {
            "ok": decode.run_job(conn_ok, "ok", OK_PROMPTS, "full"),
            "short": decode.run_job(conn_ok, "short", SHORT_PROMPTS, "short"),
            "killed": decode.run_job(conn_die, "killed", (LONG_PROMPT, 65), "die"),
        }
        results["final"] = decode.release_resident()
        conn_ok.send(("exit",))
        status.send(("decode_result", "decode", results))
    except BaseException:
        status.send(("error", "decode", traceback.format_exc()))
    _exit_child(status)


# --------------------------------------------------------------------------------------------------
# Orchestration (the pytest process: no engine, no pools)
# --------------------------------------------------------------------------------------------------


# Imported once by the fork server, so the three children start in well under a second instead of
# importing torch + sglang each (about 12 s apiece on a small CPU machine). Mooncake is not preloaded:
# its engine threads must start in the children.
_PRELOAD = [
    "torch",
    "numpy",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.mem_cache.sparsity.kv_offload.runtime",
    "sglang.srt.mem_cache.sparsity.kv_offload.coordinator",
    "sglang.srt.mem_cache.common",
    "sglang.srt.mem_cache.chunk_cache",
    "sglang.srt.disaggregation.utils",
    "sglang.srt.disaggregation.decode",
    "sglang.srt.distributed.device_communicators.mooncake_transfer_engine",
    "_stand_in_runner",
]


def _pd_run(mode: str) -> dict:
    """One three-process PD run with the prompt KV destination ``mode`` (see ``MODES``)."""
    lib_dir = _require_debian_libs()
    # forkserver: a fresh interpreter (never a fork of pytest) that forks each child after the imports.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    d_ok, p_ok = ctx.Pipe()
    d_die, p_die = ctx.Pipe()
    status = {name: ctx.Pipe(duplex=False) for name in ("prefill-ok", "prefill-die", "decode")}
    procs = {
        "prefill-ok": ctx.Process(
            target=_prefill_main, args=(p_ok, status["prefill-ok"][1], lib_dir, "p-ok")
        ),
        "prefill-die": ctx.Process(
            target=_prefill_main, args=(p_die, status["prefill-die"][1], lib_dir, "p-die")
        ),
        "decode": ctx.Process(
            target=_decode_main,
            args=(d_ok, d_die, status["decode"][1], lib_dir, mode == "direct_to_host"),
        ),
    }
    t0 = time.monotonic()
    for p in procs.values():
        p.daemon = True
        p.start()
    # Only the children hold these ends: a dead sender then reads as EOF on the decode side.
    for c in [d_ok, p_ok, d_die, p_die] + [w for _, w in status.values()]:
        c.close()
    readers = {r: name for name, (r, _) in status.items()}
    results, killed_after, errors = None, None, []
    try:
        deadline = t0 + RUN_TIMEOUT_S
        while results is None and "decode" in readers.values():
            left = deadline - time.monotonic()
            if left <= 0:
                pytest.fail(f"PD run did not finish within {RUN_TIMEOUT_S:.0f}s", pytrace=False)
            for r in mp.connection.wait(list(readers), timeout=left):
                try:
                    kind, who, payload = r.recv()
                except EOFError:
                    del readers[r]  # that child is gone
                    continue
                if kind == "progress":
                    killed_after = payload
                    procs[
                        "prefill-die"
                    ].kill()  # mid-transfer: some pages of the long prompt are out
                elif kind == "error":
                    errors.append(f"{who}:\n{payload}")
                else:
                    results = payload
            if errors:
                break
    finally:
        for p in procs.values():
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if errors:
        pytest.fail("child process failed:\n" + "\n".join(errors), pytrace=False)
    if results is None:
        pytest.fail(
            f"the decode process exited (code {procs['decode'].exitcode}) without a result",
            pytrace=False,
        )
    results["killed_after"] = killed_after
    results["exitcodes"] = {name: p.exitcode for name, p in procs.items()}
    results["elapsed_s"] = time.monotonic() - t0
    results["mode"] = mode
    return results


@pytest.fixture(scope="module")
def pd_run_gpu_pages():
    return _pd_run("gpu_pages")


@pytest.fixture(scope="module")
def pd_run_direct_to_host():
    return _pd_run("direct_to_host")


@pytest.fixture(params=MODES)
def pd_run(request):
    return request.getfixturevalue(f"pd_run_{request.param}")


def _assert_clean(res):
    assert res["error"] is None, res["error"]
    assert res["free_counts"] == res["start_counts"], (res["free_counts"], res["start_counts"])
    assert res["requests_left"] == []


def test_prompts_arrive_byte_exact_then_offload(pd_run):
    """KV in physical rows (or host pages) and index in logical pages, byte exact; then offloaded."""
    res = pd_run["ok"]
    _assert_clean(res)
    assert not res["aborted"]
    assert set(res["admitted"]) == {f"ok-{i}" for i in range(len(OK_PROMPTS))}
    for i, n in enumerate(OK_PROMPTS):
        assert res["admitted"][f"ok-{i}"] == {"host_tokens": n // P * P, "gpu_tail": n % P}
        kv, state = res["dst"][f"ok-{i}"]
        assert len(kv) == len(state) == -(-n // P)
    # Physical (or host) and logical page spaces really differ (the patch is not a no-op here).
    assert any(kv != st for kv, st in res["dst"].values())
    assert pd_run["exitcodes"]["prefill-ok"] == 0 and pd_run["exitcodes"]["decode"] == 0


def test_gpu_staging_and_backups_only_without_direct_to_host(pd_run):
    """Direct to host: the transfer takes no physical page and no prompt page is backed up."""
    res = pd_run["ok"]
    _assert_clean(res)
    pages = sum(-(-n // P) for n in OK_PROMPTS)
    full_pages = sum(n // P for n in OK_PROMPTS)
    if pd_run["mode"] == "direct_to_host":
        assert res["physical_for_transfer"] == 0
        assert res["prompt_backup_tokens"] == 0
    else:
        assert res["physical_for_transfer"] == pages * P
        assert res["prompt_backup_tokens"] == full_pages * P
    # After admission both modes hold the same GPU rows: sparse slots + the ragged tails' pages.
    assert res["physical_held"] == res["physical_expected"] > 0


def test_every_allocator_back_at_its_start_after_all_rounds(pd_run):
    final = pd_run["final"]
    assert final["free_counts"] == final["start_counts"]
    assert set(final["start_counts"]) == {"logical", "physical", "host"}


def test_short_sender_is_caught_by_the_page_count_check(pd_run):
    res = pd_run["short"]
    _assert_clean(res)
    assert set(res["aborted"]) == {"short-0"}
    assert "page count mismatch: expected 3 KV / 3 index pages, prefill sent 2 / 2" in (
        res["aborted"]["short-0"]
    )
    assert set(res["admitted"]) == {"short-1"}


def test_prefill_killed_mid_transfer_aborts_and_frees(pd_run):
    res = pd_run["killed"]
    _assert_clean(res)
    assert pd_run["killed_after"] == DIE_AFTER_PAGES
    assert pd_run["exitcodes"]["prefill-die"] == -9
    assert set(res["aborted"]) == {"killed-0", "killed-1"}
    for msg in res["aborted"].values():
        assert "Decode transfer failed" in msg and "prefill connection lost" in msg, msg
    assert res["wait_s"] < DONE_TIMEOUT_S
    assert not res["admitted"]
