#!/usr/bin/env python3
"""A PD pair on the tiny model: real prefill + decode servers and SGLang's mini load balancer.

``make serve-tiny-pd [ARGS="..."] [DECODE_ARGS="..."]`` (this script) starts, on CPU by default:

* a prefill server: ``python -m sglang.launch_server --disaggregation-mode prefill`` on the tiny
  DeepSeek-V3.2 of ``scripts/tiny_server.py`` (same defaults), ``--disaggregation-transfer-backend
  mooncake``;
* a decode server: the same with ``--disaggregation-mode decode`` plus ``DECODE_ARGS`` (e.g.
  ``--enable-kv-offload --kv-offload-config '{"pd_direct_to_host": true}'``);
* the mini load balancer of the ``sglang-router`` wheel (``python -m sglang_router.launch_router
  --pd-disaggregation --mini-lb``) on ``--port``,

and serves until interrupted (Ctrl-C stops all three). ``ARGS`` go to both servers.

Mooncake on a machine without RDMA needs libibverbs/libnl (``scripts/env/fetch_debian_libs.sh``,
run by ``make build``; put on ``LD_LIBRARY_PATH`` here), ``MC_FORCE_TCP=1`` (sglang initialises the
engine with protocol "rdma"; Mooncake's TCP transport replaces it) and ``SGLANG_HOST_IP=127.0.0.1``
(the engine's address: loopback instead of the first NIC's). Mooncake picks its own RPC/TCP ports;
``MC_MIN_RPC_PORT``/``MC_MAX_RPC_PORT`` keep them in a range the harness never hands out
(``tiny_server_proc.MOONCAKE_RPC_PORTS``). Nothing else: SGLang's PD path runs on CPU unchanged.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import tiny_server
from tiny_server_proc import (
    MOONCAKE_RPC_PORTS,
    START_TIMEOUT_S,
    TinyServer,
    free_port,
    release_port,
    stop_process_group,
    wait_healthy,
)

LIBS = ("libnl-3.so.200", "libnl-route-3.so.200", "libibverbs.so.1")


def debian_lib_dir() -> str:
    """Where ``scripts/env/fetch_debian_libs.sh`` put the native libraries Mooncake loads."""
    candidates = [os.environ.get("KV_OFFLOAD_DEBIAN_LIBS")]
    pointer = Path(sys.prefix) / "kv-offload-debian-libs"
    if pointer.exists():
        candidates.append(pointer.read_text().strip())
    cache = os.environ.get("KV_OFFLOAD_CACHE", str(Path.home() / ".cache" / "kv-offload"))
    candidates.append(os.path.join(cache, "debroot", "lib"))
    for d in candidates:
        if d and all(os.path.exists(os.path.join(d, so)) for so in LIBS):
            return d
    raise SystemExit(
        "libibverbs/libnl not found: run scripts/env/fetch_debian_libs.sh (make build)"
    )


def pd_env() -> Dict[str, str]:
    """The environment both PD servers need for Mooncake over TCP on loopback."""
    ld = os.environ.get("LD_LIBRARY_PATH")
    return {
        "LD_LIBRARY_PATH": debian_lib_dir() + (os.pathsep + ld if ld else ""),
        "MC_FORCE_TCP": "1",
        "SGLANG_HOST_IP": "127.0.0.1",
        "MC_MIN_RPC_PORT": str(MOONCAKE_RPC_PORTS.start),
        "MC_MAX_RPC_PORT": str(MOONCAKE_RPC_PORTS.stop - 1),
    }


class MiniLB:
    """``sglang_router``'s mini load balancer in front of one prefill and one decode server."""

    def __init__(
        self, prefill: TinyServer, bootstrap_port: int, decode: TinyServer, log: Path, port=None
    ):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation", "--mini-lb",
            "--prefill", prefill.url, str(bootstrap_port), "--decode", decode.url,
            "--host", "127.0.0.1", "--port", str(self.port),
        ]  # fmt: skip
        self._log = open(log, "wb")
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> "MiniLB":
        # It imports sglang (tracing): seconds on an idle machine, minutes on two cores beside
        # idle servers whose event loops poll.
        wait_healthy(self.url, self.proc, timeout, lambda: "mini load balancer")
        return self

    def stop(self) -> None:
        stop_process_group(self.proc)
        self._log.close()
        release_port(self.port)


def prefill_args(args: Sequence[str], bootstrap_port: int) -> List[str]:
    extra = [
        "--disaggregation-mode", "prefill",
        "--disaggregation-transfer-backend", "mooncake",
        "--disaggregation-bootstrap-port", str(bootstrap_port),
    ]  # fmt: skip
    if not tiny_server._has_cuda():
        # SGLang 0.5.23's prefill event loop records CUDA events on its forward stream under the
        # overlap scheduler (the early send of a chunked prompt's cached pages); a CPU prefill
        # server runs without it. The decode server, where kv offload runs, keeps it.
        extra.append("--disable-overlap-schedule")
    return list(args) + extra


def decode_args(args: Sequence[str], extra: Sequence[str]) -> List[str]:
    return list(args) + [
        "--disaggregation-mode", "decode",
        "--disaggregation-transfer-backend", "mooncake",
    ] + list(extra)  # fmt: skip


class PDPair:
    """A prefill server, a decode server and a mini load balancer, started side by side."""

    def __init__(
        self,
        args: Sequence[str],
        decode_extra: Sequence[str],
        log_dir: Path,
        decode_env: Optional[Dict[str, str]] = None,
        lb_port: Optional[int] = None,
        prefill_extra: Sequence[str] = (),
    ):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = pd_env()
        self.bootstrap_port = free_port()
        self.prefill = TinyServer(
            prefill_args(list(args) + list(prefill_extra), self.bootstrap_port),
            self.log_dir / "prefill.log",
            env,
        )
        self.decode = TinyServer(
            decode_args(args, decode_extra),
            self.log_dir / "decode.log",
            {**env, **(decode_env or {})},
        )
        # Started with the servers (it probes neither until a request comes), so its start-up
        # overlaps theirs.
        self.lb = MiniLB(
            self.prefill, self.bootstrap_port, self.decode, self.log_dir / "lb.log", lb_port
        )

    def wait_ready(self) -> "PDPair":
        self.prefill.wait_ready()
        self.decode.wait_ready()
        self.lb.wait_ready()
        return self

    @property
    def url(self) -> str:
        return self.lb.url

    def stop(self) -> None:
        self.lb.stop()
        self.decode.stop()
        self.prefill.stop()
        release_port(self.bootstrap_port)


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=30000, help="the load balancer's port")
    ap.add_argument(
        "--args",
        default=os.environ.get("TINY_PD_ARGS", ""),
        help="launch_server args for both servers, one shell-quoted string (make: ARGS)",
    )
    ap.add_argument(
        "--decode-args",
        default=os.environ.get("TINY_PD_DECODE_ARGS", ""),
        help="more decode server args, one shell-quoted string (make: DECODE_ARGS)",
    )
    ap.add_argument("--log-dir", default="/tmp/tiny_pd_logs")
    a = ap.parse_args(argv)
    pair = PDPair(shlex.split(a.args), shlex.split(a.decode_args), Path(a.log_dir), lb_port=a.port)
    try:
        pair.wait_ready()
        print(
            f"[tiny_pd] serving on {pair.url} (prefill {pair.prefill.url}, decode "
            f"{pair.decode.url}); logs in {a.log_dir}; Ctrl-C stops",
            flush=True,
        )
        while pair.prefill.alive() and pair.decode.alive():
            time.sleep(2)
        print("[tiny_pd] a server exited; see the logs", flush=True)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        pair.stop()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
