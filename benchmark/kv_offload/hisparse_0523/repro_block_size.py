"""Minimal reproduction: 0.5.23's HiSparse swap-in kernel at several block sizes (GPU; UNTESTED here).

One child process per block size (a sticky CUDA error poisons its context), each with
CUDA_LAUNCH_BLOCKING=1: ``bs`` requests of ``ctx`` > ``hot`` tokens (so the kernel takes its long
path: hash, two block-level prefix scans, LRU writeback, miss copy), ``steps`` decode steps of random
unique top-k, then checks (a) no CUDA error, (b) every top-k token's device row equals its host row,
(c) each request's LRU row is still a permutation of 0..hot-1, (d) the misses the kernel copied.

    source scripts/gpu_env.sh            # puts apache-tvm-ffi (from .whl) on PYTHONPATH
    python benchmark/kv_offload/hisparse_0523/repro_block_size.py --src .gpu/sglang-0.5.23 \
        --blocks 256 512 960 1024 [--sanitizer]

Expected from reading hisparse.cuh (see README.md): 256 (and every block size < 512) fails -- a CUDA
error or wrong rows / broken LRU permutation -- while 512..1024 pass. ``--sanitizer`` runs each child
under ``compute-sanitizer --tool memcheck`` (works on the Firecracker machines, not on gVisor).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent


def child(a) -> dict:
    import torch

    sys.path.insert(0, str(HERE))
    import loader

    dev = torch.device("cuda")
    R, S, K, ctx, row, page = a.bs, a.hot, a.topk, a.ctx, a.row, 64
    ops = loader.load_ops(a.src, verbose=False)
    g = torch.Generator(device="cpu").manual_seed(a.seed)
    # host pool (pinned), one region per request; coordinator.req_to_host_pool[rid, tok] -> host loc
    host = torch.randint(0, 256, (R * ctx, row), dtype=torch.uint8, generator=g).pin_memory()
    host_cache = host.view(R * ctx, 1, row)
    req_to_host_pool = torch.full((R, ctx + page), -1, dtype=torch.int64, device=dev)
    req_to_host_pool[:, :ctx] = torch.arange(R * ctx, device=dev).view(R, ctx)
    # device buffer: S LRU slots + one page (slot S holds the newest token), as alloc_device_buffer
    n_dev = R * (S + page) + page
    device_kv = torch.zeros((n_dev, 1, row), dtype=torch.uint8, device=dev)
    locs = (torch.arange(R * (S + page), dtype=torch.int32, device=dev) + page).view(R, S + page)
    toks = torch.full((R, S + page), -1, dtype=torch.int32, device=dev)
    lru = torch.arange(S, dtype=torch.int16, device=dev).repeat(R, 1).contiguous()
    out_buf = torch.full((R, K), -1, dtype=torch.int32, device=dev)
    rpi = torch.arange(R, dtype=torch.int64, device=dev)
    seq = torch.full((R,), ctx, dtype=torch.int64, device=dev)
    n = torch.tensor([R], dtype=torch.int32, device=dev)
    # the newest token (ctx - 1) lives in slot S of the device buffer (decode wrote it there)
    for b in range(R):
        device_kv[locs[b, S].long(), 0] = host[b * ctx + ctx - 1].to(dev)
    res = {"block": a.block, "ok": True, "steps": []}
    for step in range(a.steps):
        topk = torch.stack([torch.randperm(ctx, generator=g)[:K] for _ in range(R)]).to(torch.int32)
        topk = topk.to(dev)
        before = toks[:, :S].clone()
        out = loader.coordinator_swap_in(
            ops,
            top_k_result=topk,
            req_device_buffer_tokens_layer=toks,
            req_to_host_pool=req_to_host_pool,
            req_device_buffer_token_locs_layer=locs,
            host_kv_buffer_layer=host_cache,
            device_kv_buffer_layer=device_kv,
            top_k_device_locs_buffer=out_buf,
            req_pool_indices=rpi,
            seq_lens=seq,
            lru_slots_layer=lru,
            num_real_reqs=n,
            item_size_bytes=row,
            top_k=K,
            device_buffer_size=S,
            swap_in_block_size=a.block,
        )
        torch.cuda.synchronize()
        rows_ok = True
        for b in range(R):
            o = out[b].long()
            if bool((o < 0).any()):
                rows_ok = False
                break
            got = device_kv[o, 0].cpu()
            want = host[(b * ctx + topk[b].long()).cpu()]
            rows_ok &= torch.equal(got, want)
        perm_ok = bool((lru.long().sort(dim=1).values == torch.arange(S, device=dev)).all())
        cached = torch.zeros((R, ctx + 1), dtype=torch.bool, device=dev)
        cached.scatter_(1, torch.where(before >= 0, before, ctx).long(), True)
        cached[:, ctx - 1] = True
        misses = int((~cached.gather(1, topk.long())).sum())
        res["steps"].append({"step": step, "rows_ok": bool(rows_ok), "lru_perm_ok": perm_ok,
                             "misses": misses})  # fmt: skip
        res["ok"] &= bool(rows_ok) and perm_ok
    return res


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--src", default=os.environ.get("HISPARSE_0523_SRC"), required=False)
    p.add_argument("--blocks", type=int, nargs="*", default=[256, 512, 960, 1024])
    p.add_argument("--block", type=int, default=960, help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--bs", type=int, default=4)
    p.add_argument("--ctx", type=int, default=8192)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--hot", type=int, default=4096)
    p.add_argument("--row", type=int, default=656)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sanitizer", action="store_true")
    p.add_argument("--timeout", type=int, default=300)
    a = p.parse_args()
    if not a.src:
        p.error("--src or HISPARSE_0523_SRC is required")
    if a.child:
        print("RESULT " + json.dumps(child(a)), flush=True)
        return 0
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1", PYTHONUNBUFFERED="1")
    results = []
    for b in a.blocks:
        cmd = [sys.executable, __file__, "--child", "--block", str(b), "--src", a.src, "--bs", str(a.bs),
               "--ctx", str(a.ctx), "--topk", str(a.topk), "--hot", str(a.hot), "--row", str(a.row),
               "--steps", str(a.steps), "--seed", str(a.seed)]  # fmt: skip
        if a.sanitizer:
            cmd = ["compute-sanitizer", "--tool", "memcheck", "--show-backtrace", "no"] + cmd
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
            lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
            if lines and done.returncode == 0:
                r = json.loads(lines[-1][7:])
            else:
                tail = (done.stdout + done.stderr).strip().splitlines()[-12:]
                r = {"block": b, "ok": False, "rc": done.returncode, "error": "\n".join(tail)}
            if a.sanitizer:
                r["sanitizer"] = [ln for ln in (done.stdout + done.stderr).splitlines()
                                  if "Invalid" in ln or "ERROR SUMMARY" in ln][:8]  # fmt: skip
        except subprocess.TimeoutExpired:
            r = {"block": b, "ok": False, "error": f"timeout {a.timeout}s (hang?)"}
        results.append(r)
        print(json.dumps(r), flush=True)
    out = os.environ.get("OUT")
    if out:
        pathlib.Path(out, "repro_block_size.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
