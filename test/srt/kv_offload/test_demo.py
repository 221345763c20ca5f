"""``make demo`` (scripts/demo.py) end to end: two real servers, its report, and no litter."""

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[3]


def test_demo_reports_savings_and_leaves_nothing_behind():
    tmp = Path(tempfile.mkdtemp(prefix="kvd-"))  # short: the servers' ZMQ ipc paths live under it
    env = dict(os.environ, TMPDIR=str(tmp))
    res = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "demo.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    out = res.stdout
    assert res.returncode == 0, out[-3000:] + res.stderr[-3000:]
    assert "[3/3] results" in out and out.rstrip().endswith("done")
    assert "greedy tokens equal: 4/4 requests" in out
    # The index keys of the flag-off budget's bytes (the arena's structure costs at most 20 %).
    budget = re.search(r"of 4096 tokens: (\d+) with the flag \(\+(\d+) %\)", out)
    assert budget, out[-3000:]
    on_budget, gain = int(budget.group(1)), int(budget.group(2))
    assert gain == round(100 * (on_budget / 4096 - 1))
    assert on_budget >= 0.8 * 4096 * (1152 + 132) / (132 + 16 / 2), on_budget
    assert re.search(r"280 B with it \(-(\d+) %", out)
    # The dtype it prints is the one the server ran, and the bytes it quotes are that dtype's.
    assert "KV cache dtype bfloat16" in out and "bfloat16 KV): 2568 B" in out
    left = sorted(p.name for p in tmp.iterdir())
    shutil.rmtree(tmp)
    assert not left, f"left in TMPDIR: {left}"
