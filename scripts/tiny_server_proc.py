"""The tiny real server (``scripts/tiny_server.py``) as a subprocess: ports, start, health, stop.

What the demo, the PD pair (``scripts/tiny_pd.py``), the benchmarks and the real-server suites start
servers with. Everything they learn about a server comes through its HTTP API (``/generate``,
``/abort_request``, ``/server_info``, whose ``internal_states[0]["kv_offload"]`` is the documented
offload state) or its log lines; nothing reaches into its memory.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import psutil
import requests
import tiny_server

START_TIMEOUT_S = 300
REQUEST_TIMEOUT_S = 600
IDLE_TIMEOUT_S = 60

# Ports the harness hands out (servers, NCCL/gloo, PD bootstrap, load balancer): below Mooncake's
# RPC ports (MOONCAKE_RPC_PORTS, set by tiny_pd.pd_env), upstream's own picks below the ephemeral
# range (``get_free_port_below_ephemeral``: 22000-29999) and the kernel's ephemeral range (bind(0),
# ZMQ's random ports), so no port another component picks can be one of ours.
HARNESS_PORTS = range(10000, 15000)
MOONCAKE_RPC_PORTS = range(15000, 18000)
# Ports upstream derives from a server's --port under attention DP (its ZMQ sockets go over TCP
# then): the DP controller's handshake (+13, DP_ATTENTION_HANDSHAKE_PORT_DELTA) and the dist-init
# port with the six ZMQ sockets after it (+233..+239, ZMQ_TCP_PORT_DELTA). Every server's port is
# reserved with them (DP or not: cheap, and no argument parsing); otherwise another harness port
# can be one of them, and whichever process binds it second dies (seen in CI: a prefill server
# whose HTTP port was a DP decode server's ZMQ socket exited with uvicorn's code 3).
SERVER_PORT_OFFSETS = (0, 13, *range(233, 240))
# One lock file per port: a port is reserved while some process holds an flock on its file (the
# kernel drops it when that process dies, kill -9 included), so harness processes started side
# by side (pytest sessions, benchmarks, soak runs) never hand out the same port. flock conflicts
# between two opens of one file in one process too, so this process never hands it out twice.
PORT_LOCK_DIR = Path("/tmp/kv-offload-ports")
_RESERVED: Dict[int, List[int]] = {}  # port -> fds of its block's locked files, until release_port


def free_port(candidates: Sequence[int] = HARNESS_PORTS, offsets: Sequence[int] = (0,)) -> int:
    """A TCP port ``p`` reserved, with ``p + o`` for each of ``offsets``, for this process until
    :func:`release_port` (or its exit).

    Reserved, not guessed: every port of the block is among ``candidates`` and bindable now, and
    no harness process (this one or another) hands one out again while the reservation lasts, so
    the server given them can bind them however late it starts. Raises RuntimeError if no
    candidate's block is free.
    """
    PORT_LOCK_DIR.mkdir(exist_ok=True)
    allowed = set(candidates)
    for port in random.Random().sample(sorted(allowed), len(allowed)):
        block = [port + o for o in offsets]
        if all(p in allowed for p in block):
            fds = _lock_all(block)
            if fds is not None:
                _RESERVED[port] = fds
                return port
    raise RuntimeError(
        f"no free TCP port (with offsets {list(offsets)}) among {len(allowed)} candidates: all "
        f"bound or reserved by other harness processes (locks in {PORT_LOCK_DIR}); stop stray "
        "servers and retry"
    )


def release_port(port: int) -> None:
    """End the reservation of ``port`` and its block (once the process that bound them exited)."""
    for fd in _RESERVED.pop(port, ()):
        os.close(fd)


def _lock_all(ports: Sequence[int]) -> Optional[List[int]]:
    """The fds of ``ports``' lock files, all locked, or None (and none kept) if some port is
    reserved by a harness process or not bindable."""
    fds: List[int] = []
    for port in ports:
        fd = os.open(PORT_LOCK_DIR / f"{port}.lock", os.O_CREAT | os.O_RDWR, 0o666)
        fds.append(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            break
        if not _bindable(port):  # in use by a process outside the harness: leave it
            break
    else:
        return fds
    for fd in fds:
        os.close(fd)
    return None


def _bindable(port: int) -> bool:
    """True if nothing is bound to ``port`` on any IPv4 address (as the servers bind it)."""
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def http(method: str, url: str, body: Optional[dict] = None, timeout: float = 600.0) -> Any:
    """One JSON request (standard library only): the answer parsed, or its text if it is not
    JSON. Raises ``urllib.error.URLError`` (``HTTPError`` for an error status)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        text = resp.read().decode()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def wait_until(
    condition: Callable[[], bool], what: str, timeout: float = 300, poll_s: float = 0.1
) -> None:
    """Poll ``condition`` until it holds; raise AssertionError(``what``) after ``timeout`` s."""
    deadline = time.time() + timeout
    while not condition():
        if time.time() > deadline:
            raise AssertionError(what)
        time.sleep(poll_s)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, describe) -> None:
    """Poll ``url/health`` until it answers 200; raise RuntimeError (``proc`` exited) or
    TimeoutError (``timeout`` passed), with ``describe()``."""
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


def _group_alive(pgid: int) -> bool:
    """True while a process of group ``pgid`` runs (a zombie, exited but unreaped, does not)."""
    for p in psutil.process_iter(["status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except ProcessLookupError:
            continue
    return False


def _end_group(proc: subprocess.Popen, sig: int, grace_s: float) -> bool:
    """Send ``sig`` to the process group ``proc`` leads; True once no process of it runs, False
    if one still does after ``grace_s``."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    deadline = time.time() + grace_s
    while _group_alive(proc.pid):
        if time.time() > deadline:
            return False
        proc.poll()
        time.sleep(0.2)
    return True


def stop_process_group(proc: subprocess.Popen, grace_s: float = 30) -> None:
    """SIGTERM the process group ``proc`` leads (started with ``start_new_session``), SIGKILL it
    if a process of it still runs after ``grace_s``; returns once ``proc`` is reaped and (within
    another ``grace_s``) no process of the group runs, so its ports and memory are free."""
    if not _end_group(proc, signal.SIGTERM, grace_s):
        _end_group(proc, signal.SIGKILL, grace_s)
    proc.wait()


class TinyServer:
    """One ``python -m sglang.launch_server`` process tree on the tiny model
    (``tiny_server.build_command`` with ``args`` and ``kernels``), started at construction in its
    own process group, its output in ``log_path``; ``env`` goes over its environment last.

    Its ``--port`` (with :data:`SERVER_PORT_OFFSETS`) and ``--nccl-port`` are reserved
    (:func:`free_port`) until :meth:`stop`. With :attr:`side_by_side` (this class) it runs as the
    suites, the demo and the soak run several servers on a few cores; :class:`BenchServer` runs
    alone.
    """

    side_by_side = True

    def __init__(
        self,
        args: Sequence[str],
        log_path: Path,
        env: Optional[Dict[str, str]] = None,
        kernels: Optional[str] = None,
    ):
        self.port = free_port(offsets=SERVER_PORT_OFFSETS)
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = list(args)
        self.log_path = Path(log_path)
        # The dist (NCCL/gloo) port too: upstream would pick one itself, unreserved.
        self.nccl_port = free_port()
        extra = ["--port", str(self.port), "--nccl-port", str(self.nccl_port)]
        self.tmp_dir: Optional[Path] = None
        if self.side_by_side:
            # An idle scheduler waits on its sockets (1 s at most) instead of spinning a core: the
            # suites run several servers side by side on a 2-core machine. Only when fully idle,
            # so batches and pending PD transfers run as without it.
            extra.append("--sleep-on-idle")
        self.cmd, self._env = tiny_server.build_command(self.args + extra, kernels=kernels)
        if self.side_by_side:
            # One intra-op thread: the suite runs twin servers side by side on a 2-core machine.
            self._env.setdefault("OMP_NUM_THREADS", "1")
            # ``/health`` answers without running a one-token generation: a poll that times out
            # on a slow start would otherwise leave an extra forward in one twin, and upstream's
            # test retraction schedule counts forwards (an extra one shifts every retraction, so
            # the twins' batches, and with them their CPU tokens, differ: seen in CI as request 4
            # diverging).
            self._env.setdefault("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "0")
            # The host pools are a few MB, but the servers side by side can leave less than
            # upstream's 10 GiB host reserve available on a 24 GiB machine.
            self._env.setdefault("KV_OFFLOAD_TEST_HOST_RESERVE_GB", "2")
            # Upstream leaves temporary files behind (ZMQ socket names, a config copy per
            # process): give the server its own TMPDIR, removed by stop(). Short: ZMQ ipc paths
            # must fit in 107 characters.
            self.tmp_dir = Path(tempfile.mkdtemp(prefix="kvo-"))
            self._env["TMPDIR"] = str(self.tmp_dir)
        else:
            self._env["PYTHONUNBUFFERED"] = "1"
            # Each stand-in logs its first call ("[standin] pid N first call: NAME"), so a
            # production-kernel run shows the sgl_kernel stand-ins that remain.
            self._env["KV_OFFLOAD_STANDINS_TRACE"] = "1"
        self._env.update(env or {})
        self._log = open(self.log_path, "wb")
        self._log.write(f"[tiny_server] {shlex.join(self.cmd)}\n".encode())
        self._log.flush()
        self._start()

    # ------------------------------------------------------------------ life cycle
    def _start(self) -> None:
        self.proc = subprocess.Popen(
            self.cmd,
            env=self._env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> float:
        """Wait until ``/health`` answers; the seconds waited. Raises RuntimeError (the server
        exited) or TimeoutError, with the log's tail."""
        t0 = time.time()
        wait_healthy(self.url, self.proc, timeout, self.log_tail)
        return time.time() - t0

    def kill(self) -> None:
        """SIGKILL the whole process tree (a crash); its ports stay reserved for :meth:`restart`."""
        _end_group(self.proc, signal.SIGKILL, 30)
        self.proc.wait()

    def restart(self) -> "TinyServer":
        """Start the server again (same ports, arguments and log) after :meth:`kill`."""
        self.kill()
        self._start()
        return self

    def stop(self) -> None:
        """End the process tree (:func:`stop_process_group`), then free its ports and files."""
        stop_process_group(self.proc)
        self._log.close()
        if self.tmp_dir is not None:
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
        release_port(self.port)
        release_port(self.nccl_port)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, n: int = 60) -> str:
        """The log's last ``n`` lines, after its earlier lines at level ERROR (a cause can be far
        up: uvicorn's bind error, say, is followed by a long warm-up traceback)."""
        lines = self.log_text().splitlines()
        errors = [line for line in lines[:-n] if "ERROR" in line]
        head = ["ERROR lines before the tail:", *errors, "tail:"] if errors else []
        return "\n".join(head + lines[-n:])

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
        return self._wait_states(
            lambda s: s["requests"] == 0 and s["free"] == s["initial_free"],
            "kv offload free counts not back at start",
            timeout,
        )

    def wait_settled(self, timeout: float = IDLE_TIMEOUT_S, strict: bool = True) -> Optional[Dict]:
        """Wait until every scheduler has no live request and no backup in flight, and return the
        first one's offload state: its free counts then stay as they are until the next request
        (the state is a pure read, and the scheduler loop completes backups in its next iteration).
        With the radix cache the tree keeps pages, so they need not be back at start. None
        without the flag; after ``timeout`` s an AssertionError, or with ``strict`` off the last
        state read (a benchmark records it rather than stopping)."""
        if "kv_offload" not in self.server_info()["internal_states"][0]:
            return None
        try:
            return self._wait_states(
                lambda s: s["requests"] == 0 and s["backups_in_flight"] == 0,
                "kv offload requests or backups still live",
                timeout,
            )
        except AssertionError:
            if strict:
                raise
            return self.offload_state()

    def _wait_states(self, done: Callable[[Dict], bool], what: str, timeout: float) -> Dict:
        deadline = time.time() + timeout
        while True:
            states = self.offload_states()
            if all(done(s) for s in states):
                return states[0]
            if time.time() > deadline:
                raise AssertionError(f"{what}: {states}")
            time.sleep(0.2)

    def max_running_seen(self) -> int:
        found = re.findall(r"Decode batch, #running-req: (\d+)", self.log_text())
        return max((int(x) for x in found), default=0)


class BenchServer(TinyServer):
    """A benchmark's server, alone on its machine: upstream's idle loop, threads, ``/health`` and
    temporary directory (torch.compile's cache outlives the server), output unbuffered, and each
    stand-in logging its first call (``tiny_server_gpu.parse_log`` reports which ran)."""

    side_by_side = False
