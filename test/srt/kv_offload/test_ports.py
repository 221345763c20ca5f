"""The harness's ports (``tiny_server_proc.free_port``): reserved across processes, never guessed.

Servers, their NCCL/gloo ports, the PD bootstrap port and the load balancer's all come from
``free_port``; a server's port comes with the ports upstream derives from it under attention DP.
A port stays reserved (an flock on its file) until ``release_port`` or the exit of the process that
reserved it, and the harness's range is disjoint from every range another component picks ports
from on its own.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tiny_server_proc import (
    HARNESS_PORTS,
    MOONCAKE_RPC_PORTS,
    SERVER_PORT_OFFSETS,
    free_port,
    release_port,
    stop_process_group,
)

HERE = Path(__file__).resolve().parent
SCRIPTS = HERE.parents[2] / "scripts"


def reserve_in_child(candidates, hold: bool = False) -> subprocess.Popen:
    """Another harness process calling ``free_port(candidates)``; prints the port or the error.
    With ``hold`` it keeps the reservation until its stdin closes."""
    code = textwrap.dedent(f"""
        import sys
        from tiny_server_proc import free_port
        try:
            print(free_port({list(candidates)!r}), flush=True)
        except RuntimeError as exc:
            print("refused:", exc, flush=True)
        if {hold!r}:
            sys.stdin.read()
        """)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SCRIPTS), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.Popen(
        [sys.executable, "-c", code],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def test_a_reserved_port_is_refused_to_another_process_until_released():
    port = free_port()
    try:
        child = reserve_in_child([port])
        out, _ = child.communicate(timeout=60)
        assert out.startswith("refused:") and "reserved by other harness processes" in out, out
    finally:
        release_port(port)
    child = reserve_in_child([port])
    out, _ = child.communicate(timeout=60)
    assert out.strip() == str(port)


def test_a_reservation_ends_with_its_process_even_on_kill():
    holder = reserve_in_child(HARNESS_PORTS, hold=True)
    port = int(holder.stdout.readline())
    with pytest.raises(RuntimeError):
        free_port([port])
    holder.kill()
    holder.wait()
    assert free_port([port]) == port
    release_port(port)


def test_ports_handed_out_side_by_side_are_distinct_and_bindable():
    children = [reserve_in_child(range(HARNESS_PORTS.start, HARNESS_PORTS.start + 40), True)]
    children += [reserve_in_child(range(HARNESS_PORTS.start, HARNESS_PORTS.start + 40), True)]
    ports = [int(c.stdout.readline()) for c in children]
    ours = [free_port(range(HARNESS_PORTS.start, HARNESS_PORTS.start + 40)) for _ in range(5)]
    try:
        assert len(set(ports + ours)) == len(ports + ours)
        for port in ours:  # reserved, not bound: the server given it can bind it
            with socket.socket() as s:
                s.bind(("0.0.0.0", port))
    finally:
        for child in children:
            child.communicate(timeout=60)
        for port in ours:
            release_port(port)


def test_a_port_bound_outside_the_harness_is_skipped():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        with pytest.raises(RuntimeError, match="no free TCP port"):
            free_port([busy])


def test_a_servers_derived_ports_are_reserved_with_it():
    port = free_port(offsets=SERVER_PORT_OFFSETS)
    try:
        assert all(port + o in HARNESS_PORTS for o in SERVER_PORT_OFFSETS)
        for offset in SERVER_PORT_OFFSETS:
            out, _ = reserve_in_child([port + offset]).communicate(timeout=60)
            assert out.startswith("refused:"), (offset, out)
    finally:
        release_port(port)
    out, _ = reserve_in_child([port + SERVER_PORT_OFFSETS[-1]]).communicate(timeout=60)
    assert out.strip() == str(port + SERVER_PORT_OFFSETS[-1])


def test_a_block_with_one_port_taken_is_skipped_and_leaves_nothing_locked():
    start = HARNESS_PORTS.start + 100
    holder = reserve_in_child([start + 13], hold=True)
    assert int(holder.stdout.readline()) == start + 13
    try:
        with pytest.raises(RuntimeError, match="no free TCP port"):
            free_port(range(start, start + 14), offsets=(0, 13))
        assert free_port([start]) == start  # the failed block released its first lock
        release_port(start)
    finally:
        holder.communicate(timeout=60)


def test_the_offsets_cover_every_port_upstream_derives_under_attention_dp():
    """Upstream's TCP ZMQ ports of an attention-DP server (its ``PortArgs``), its dist-init port
    and its DP controller's handshake port all lie in the block reserved with ``--port``."""
    from sglang.srt.server_args import (
        DP_ATTENTION_HANDSHAKE_PORT_DELTA,
        ZMQ_TCP_PORT_DELTA,
        PortArgs,
        prepare_server_args,
    )

    port, nccl_port = free_port(offsets=SERVER_PORT_OFFSETS), free_port()
    try:
        model = HERE / "fixtures" / "tiny-deepseek-v32"
        args = prepare_server_args(
            ["--model-path", str(model), "--device", "cpu", "--tp", "2", "--attn-dp-size", "2"]
            + ["--port", str(port), "--nccl-port", str(nccl_port)]
        )
        port_args = PortArgs.init_new(args)
    finally:
        release_port(port)
        release_port(nccl_port)
    derived = {int(m) for m in re.findall(r"tcp://127\.0\.0\.1:(\d+)", repr(port_args))}
    derived |= {port + ZMQ_TCP_PORT_DELTA, port + DP_ATTENTION_HANDSHAKE_PORT_DELTA}
    assert derived <= {port + o for o in SERVER_PORT_OFFSETS}, (port, sorted(derived))
    assert len(derived) == len(SERVER_PORT_OFFSETS) - 1, derived  # the 6 ZMQ ports, 2 more


def test_the_range_is_disjoint_from_every_other_port_picker(monkeypatch):
    """Upstream's own pick below the ephemeral range, the kernel's ephemeral range (bind(0), ZMQ's
    random ports) and Mooncake's RPC ports (pinned by tiny_pd.pd_env) never reach ours."""
    import tiny_pd
    from sglang.srt.utils.network import get_free_port_below_ephemeral

    defaults = inspect.signature(get_free_port_below_ephemeral).parameters
    upstream = range(defaults["low"].default, defaults["high"].default + 1)
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for other in (upstream, MOONCAKE_RPC_PORTS, range(ephemeral_low, 65536)):
        assert not set(HARNESS_PORTS) & set(other), other
    monkeypatch.setattr(tiny_pd, "debian_lib_dir", lambda: "/libs")
    env = tiny_pd.pd_env()
    assert range(int(env["MC_MIN_RPC_PORT"]), int(env["MC_MAX_RPC_PORT"]) + 1) == MOONCAKE_RPC_PORTS


def test_a_stopped_servers_ports_are_free_once_its_whole_process_group_is_gone():
    """A process of the server's group that ignores SIGTERM and outlives the group's leader (as a
    scheduler subprocess can) still holds a port: ``stop_process_group`` kills it after the grace
    time and returns only once it is gone, so the port can be handed out again."""
    port = free_port()
    release_port(port)  # as the server given it: bound by a process of the group
    holder = (
        "import signal, socket, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        f"s = socket.socket(); s.bind(('0.0.0.0', {port})); s.listen(); print(flush=True); "
        "time.sleep(300)"
    )
    leader = subprocess.Popen(
        ["bash", "-c", f"{shlex.quote(sys.executable)} -c {shlex.quote(holder)} & read -r _"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        leader.stdout.readline()  # the holder has bound the port
        leader.stdin.close()  # the leader exits; the holder lives on in its group
        leader.wait(60)
        with pytest.raises(RuntimeError, match="no free TCP port"):
            free_port([port])
        stop_process_group(leader, grace_s=1)
        assert free_port([port]) == port
        release_port(port)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(leader.pid, signal.SIGKILL)
