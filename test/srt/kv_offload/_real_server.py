"""Start the tiny real server (``scripts/tiny_server.py``) as a subprocess and talk HTTP to it.

Everything the end-to-end tests learn about the server comes through its HTTP API (``/generate``,
``/abort_request``, ``/server_info``, whose ``internal_states[0]["kv_offload"]`` is the documented
offload state) or its log lines; nothing reaches into its memory.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence

import requests

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "scripts"))
import tiny_server  # noqa: E402

START_TIMEOUT_S = 300
REQUEST_TIMEOUT_S = 600
IDLE_TIMEOUT_S = 60


def _ephemeral_port_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


# Ports this test process has handed out: never handed out twice.
_HANDED_OUT: set = set()


def free_port() -> int:
    """A free TCP port below the kernel's ephemeral range, not handed out before by this process.

    Upstream picks its own ports (e.g. the NCCL/dist port when ``--nccl-port`` is not given) by
    binding port 0, which takes them from the ephemeral range: servers started side by side could
    be handed the same one (seen once in CI: ``EADDRINUSE`` on the dist port). Ports from below that
    range never collide with those, and ours never collide with each other.
    """
    stop = _ephemeral_port_start()
    for port in random.Random().sample(range(max(1024, stop - 12000), stop), 2000):
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free TCP port found below {stop}")


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, describe) -> None:
    """Poll ``url/health`` until it answers 200; raise (with ``describe()``) if ``proc`` exits
    or ``timeout`` passes."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode}:\n{describe()}")
        try:
            if requests.get(url + "/health", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(1)
    raise TimeoutError(f"not ready after {timeout} s:\n{describe()}")


def stop_process_group(proc: subprocess.Popen, grace_s: float = 30) -> None:
    """SIGTERM the process group ``proc`` leads (started with ``start_new_session``), SIGKILL it
    if it has not exited after ``grace_s``."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextlib.contextmanager
def started(*servers) -> Iterator[None]:
    """Servers (anything with ``wait_ready`` and ``stop``) ready, and stopped afterwards."""
    try:
        for server in servers:
            server.wait_ready()
        yield
    finally:
        for server in servers:
            server.stop()


def wait_until(condition, what: str, timeout: float = 300, poll_s: float = 0.1) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, what
        time.sleep(poll_s)


class TinyServer:
    """One ``python -m sglang.launch_server`` process tree on the tiny model."""

    def __init__(self, args: Sequence[str], log_path: Path, env: Optional[Dict[str, str]] = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = list(args)
        self.log_path = log_path
        # The dist (NCCL/gloo) port too: upstream would take it from the ephemeral range.
        ports = ["--port", str(self.port), "--nccl-port", str(free_port())]
        cmd, server_env = tiny_server.build_command(self.args + ports)
        # One intra-op thread: the suite runs twin servers side by side on a 2-core machine.
        server_env.setdefault("OMP_NUM_THREADS", "1")
        # ``/health`` answers without running a one-token generation: a poll that times out on a
        # slow start would otherwise leave an extra forward in one twin, and upstream's test
        # retraction schedule counts forwards (an extra one shifts every retraction, so the twins'
        # batches, and with them their CPU tokens, differ: seen in CI as request 4 diverging).
        server_env.setdefault("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "0")
        # Upstream leaves temporary files behind (ZMQ socket names, a config copy per process):
        # give the server its own TMPDIR, removed by stop(). Short: ZMQ ipc paths must fit in
        # 107 characters.
        self.tmp_dir = Path(tempfile.mkdtemp(prefix="kvo-"))
        server_env["TMPDIR"] = str(self.tmp_dir)
        server_env.update(env or {})
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            cmd, env=server_env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    # ------------------------------------------------------------------ life cycle
    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> "TinyServer":
        wait_healthy(self.url, self.proc, timeout, self.log_tail)
        return self

    def stop(self) -> None:
        stop_process_group(self.proc)
        self._log.close()
        shutil.rmtree(self.tmp_dir, ignore_errors=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-n:])

    # ------------------------------------------------------------------ requests
    def generate(self, input_ids: List, max_new_tokens: int, rid: Optional[str] = None):
        body = {
            "input_ids": input_ids,
            "sampling_params": {
                "max_new_tokens": max_new_tokens,
                "temperature": 0,
                "ignore_eos": True,
            },
        }
        if rid is not None:
            body["rid"] = rid
        r = requests.post(self.url + "/generate", json=body, timeout=REQUEST_TIMEOUT_S)
        return r.json()

    def generate_stream(self, input_ids: List[int], max_new_tokens: int) -> Dict:
        """Streaming ``/generate``; returns the last chunk (its ``output_ids`` are all tokens)."""
        body = {
            "input_ids": input_ids,
            "stream": True,
            "sampling_params": {
                "max_new_tokens": max_new_tokens,
                "temperature": 0,
                "ignore_eos": True,
            },
        }
        last, chunks = None, 0
        with requests.post(
            self.url + "/generate", json=body, stream=True, timeout=REQUEST_TIMEOUT_S
        ) as r:
            for line in r.iter_lines():
                if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                    continue
                last = json.loads(line[5:])
                chunks += 1
        last["chunks"] = chunks
        return last

    def generate_batch(self, prompts: List[List[int]], max_new_tokens: int) -> List[Dict]:
        """One ``/generate`` call with a list of prompts: the scheduler receives them in one
        message, so two servers given the same call schedule them into the same batches (as long
        as their admission decisions agree)."""
        return self.generate(prompts, max_new_tokens)

    def abort(self, rid: str) -> None:
        requests.post(self.url + "/abort_request", json={"rid": rid}, timeout=30)

    def server_info(self) -> Dict:
        return requests.get(self.url + "/server_info", timeout=60).json()

    def offload_state(self) -> Dict:
        return self.offload_states()[0]

    def offload_states(self) -> List[Dict]:
        """One offload state per scheduler that answers ``/server_info`` (one per attention-DP
        rank, in no set order; the first TP rank's otherwise)."""
        return [state["kv_offload"] for state in self.server_info()["internal_states"]]

    def wait_no_leak(self, timeout: float = IDLE_TIMEOUT_S) -> Dict:
        """Wait until every scheduler is idle and every free count is back at its start value.

        Returns the first scheduler's last offload state; raises AssertionError naming what did
        not come back.
        """
        deadline = time.time() + timeout
        while True:
            states = self.offload_states()
            if all(s["requests"] == 0 and s["free"] == s["initial_free"] for s in states):
                return states[0]
            if time.time() > deadline:
                raise AssertionError(f"kv offload free counts not back at start: {states}")
            time.sleep(1)

    def max_running_seen(self) -> int:
        found = re.findall(r"Decode batch, #running-req: (\d+)", self.log())
        return max((int(x) for x in found), default=0)
