"""End to end on the CPU: attention DP with ``--enable-kv-offload`` (real servers, flag off vs on).

Co-located ``--tp 2 --attn-dp-size 2`` servers and a PD pair whose decode server runs attention
DP 2. A module of its own: its servers start after the other real-server modules have stopped
theirs (each rank's host pool is refused when the host's free memory, less upstream's 10 GiB
margin, cannot hold it). Helpers and settings come from ``test_real_server`` and
``test_pd_real_server``.
"""

from __future__ import annotations

import re

import pytest
import test_pd_real_server as pd
import test_real_server as rs
from _real_server import started

pytestmark = pytest.mark.slow

DP = rs.TP + ["--attn-dp-size", "2"]


class TestAttentionDP:
    """Attention DP 2 (TP 2) on the CPU: each attention-DP rank serves its own requests with its
    own host pool (its attention-TP group is one rank), against the same DP server without the
    flag; contexts >= 8x top-k evict and reload on both ranks.

    Retraction runs on a third server (upstream's test schedule) and is checked for completion
    and free counts, not tokens: under attention DP the ranks' batches meet in every MLP, so a
    request's CPU tokens depend on which step the other rank re-prefills in, and two flag-off
    servers with the same retraction schedule already part ways (seen: after 20 and 41 tokens).
    """

    PROMPTS = [rs.prompt(n, 900 + i) for i, n in enumerate((640, 300, 900, 520))]
    NEW_TOKENS = 24

    @pytest.fixture(scope="class")
    def dp_servers(self, tmp_path_factory):
        logs = tmp_path_factory.mktemp("dp")
        retract = {**rs.TP_ENV, "SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "20"}
        # GPU rows for every prompt at once: the staging gate must not delay a prefill that the
        # flag-off twin runs, or their ranks' batches fall out of step.
        on = rs.COMMON + rs.context(rs.CONTEXT) + rs.LARGE_GPU + rs.offload() + DP
        specs = (
            (rs.OFF_LARGE + DP, logs / "dp2_off.log", rs.TP_ENV),
            (on, logs / "dp2_on.log", rs.TP_ENV),
            (on, logs / "dp2_on_retract.log", retract),
        )
        with rs.running(*specs) as servers:
            yield servers

    def test_tokens_equal_with_requests_on_both_ranks(self, dp_servers):
        off, on, _ = dp_servers
        starts = on.offload_states()
        assert len(starts) == 2, "one offload state per attention-DP rank"
        rs.assert_same_batch(off, on, self.PROMPTS, self.NEW_TOKENS)
        on.wait_no_leak()
        for rank, (start, end) in enumerate(zip(starts, on.offload_states())):
            # Every rank decoded its own requests, evicting and reloading from its own host pool.
            loaded, selected = end["loaded"] - start["loaded"], end["selected"] - start["selected"]
            assert loaded > 0.3 * selected > 0, (rank, loaded, selected)
            assert end["host_pool"]["shared_by_ranks"] == 1, end["host_pool"]
            assert end["error_flags"] == 0 and end["free"] == end["initial_free"], (rank, end)

    def test_retraction_on_both_ranks_completes_and_frees_everything(self, dp_servers):
        _, _, on = dp_servers
        for _ in range(pd.RETRACTION_ROUNDS):  # until both ranks retracted
            outs = rs.tokens(on.generate_batch(self.PROMPTS, self.NEW_TOKENS))
            assert [len(o) for o in outs] == [self.NEW_TOKENS] * len(self.PROMPTS)
            on.wait_no_leak()
            retracted = re.findall(
                r"DP(\d) TP\d\] Testing retraction. #retracted_reqs: (\d+)", on.log_text()
            )
            ranks = {rank for rank, n in retracted if int(n) > 0}
            if ranks == {"0", "1"}:
                break
        assert ranks == {"0", "1"}, retracted
        assert all(s["error_flags"] == 0 for s in on.offload_states())


# Attention DP 2 on the decode server (one rank per attention-TP group), as in the published PD
# recipes; on the CPU without upstream's TP LM-head all-to-all, a CUDA-only collective that PD
# decode nodes with pure attention DP turn on by default (the all-gather path computes the same).
DP_DECODE = ["--tp", "2", "--attn-dp-size", "2", "--no-enable-tp-lm-head-all-to-all"]
DP_ENV = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}


class TestAttentionDPDecode:
    """A PD pair whose decode server runs attention DP 2 with ``pd_direct_to_host`` (each rank's
    prompts land in its own host pool), against the same pair without the flag: TP 2 and TP 1
    reduce in different orders, so the reference is a DP 2 decode server too."""

    @pytest.fixture(scope="class")
    def dp_pairs(self, tmp_path_factory):
        logs = tmp_path_factory.mktemp("pd_dp")
        pairs = (
            pd.PDPair(pd.COMMON, DP_DECODE, logs / "off", decode_env=DP_ENV),
            pd.PDPair(
                pd.COMMON, pd.offload(pd_direct_to_host=True) + DP_DECODE, logs / "on", DP_ENV
            ),
        )
        with started(*pairs):
            yield pairs

    def test_tokens_equal_on_both_ranks_from_their_host_pools(self, dp_pairs):
        off, on = dp_pairs
        ranks = []
        for n, ids in zip(pd.PROMPT_LENS, pd.PROMPTS):
            want = pd.generate(off.url, ids, pd.NEW_TOKENS)["output_ids"]
            got = pd.generate(on.url, ids, pd.NEW_TOKENS)
            assert got["output_ids"] == want, f"the {n}-token prompt differs: {got} vs {want}"
            ranks.append(got["meta_info"]["dp_rank"])
        assert set(ranks) == {0, 1}, ranks
        on.decode.wait_no_leak()
        states = on.decode.offload_states()  # one per rank, in no set order
        assert sorted(s["admitted"] for s in states) == sorted(map(ranks.count, (0, 1))), states
        for state in states:
            assert state["admitted_from_host"] == state["admitted"], state
            assert state["loaded"] > 0 and state["error_flags"] == 0, state

    def test_concurrent_requests_complete_and_leak_nothing(self, dp_pairs):
        _, on = dp_pairs
        prompts = [pd.prompt(n, 70 + n) for n in (120, 300, 500, 700, 260)]
        outs = pd.generate(on.url, prompts, 24)
        assert [len(o["output_ids"]) for o in outs] == [24] * len(prompts), outs
        assert {o["meta_info"]["dp_rank"] for o in outs} == {0, 1}
        on.decode.wait_no_leak()


class TestAttentionDPDecodeRetraction:
    """The DP 2 decode server of :class:`TestAttentionDPDecode` (flag on, prompts staged in GPU
    pages) retracting on upstream's test schedule: each rank saves a retracted request's KV
    (``Req.offload_kv_cache``) and resumes it from its own rank (0.5.23 routes the re-bootstrap by
    the request's DP rank, sglang #40730). Checked for completion, retractions on both ranks and
    free counts; not tokens (see :class:`TestAttentionDP`)."""

    @pytest.fixture(scope="class")
    def pair(self, tmp_path_factory):
        logs = tmp_path_factory.mktemp("pd_dp_retract")
        env = {**DP_ENV, "SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "5"}
        pair = pd.PDPair(pd.COMMON, pd.offload() + DP_DECODE, logs / "on", env)
        with started(pair):
            yield pair

    def test_retraction_on_both_ranks_completes_and_leaks_nothing(self, pair):
        prompts = [pd.prompt(n, 90 + n) for n in (120, 300, 500, 700, 260, 410)]
        retracted, seen = set(), []
        for _ in range(pd.RETRACTION_ROUNDS):  # until both ranks retracted
            outs = pd.generate(pair.url, prompts, 40)
            assert [len(o["output_ids"]) for o in outs] == [40] * len(prompts), outs
            assert {o["meta_info"]["dp_rank"] for o in outs} == {0, 1}
            metas = [o["meta_info"] for o in outs]
            seen += metas
            retracted |= {m["dp_rank"] for m in metas if m["num_retractions"] > 0}
            if retracted == {0, 1}:
                break
        assert retracted == {0, 1}, seen
        pair.decode.wait_no_leak()
        states = pair.decode.offload_states()
        assert len(states) == 2 and all(s["error_flags"] == 0 for s in states), states
        assert sum(s["backup_tokens"] for s in states) > 0
