"""End to end: speculative decoding (NEXTN = EAGLE on the model's MTP layer) on the tiny real server.

The groundwork of issue #40, flag off only: ``--enable-kv-offload`` still rejects
``--speculative-algorithm`` (``kv_offload/config.py``). The tiny DeepSeek-V3.2 gets one MTP layer
(``num_nextn_predict_layers: 1``, dummy weights: upstream builds ``DeepseekV3ForCausalLMNextN`` as
the draft model and shares the target's embedding and LM head with it), and the server runs
upstream's speculative path on the CPU as DeepSeek-V3.2 is served: ``--speculative-eagle-topk 1``,
a draft chain of ``STEPS`` tokens, target verify and draft extend through the DSA backend. The
CUDA-only calls on that path run as the S16-S18 stand-ins of ``standins/kv_offload_standins.py``.

What it shows: the greedy tokens equal those of the same server without speculative decoding,
request by request (each request alone: on the CPU a request's tokens depend on what it is batched
with, see ``test_real_server.py``; spec decoding changes batch shapes as requests accept drafts at
different steps), and the draft ran at every step. The MTP layer's weights are random, so its
drafts are almost never accepted: ``spec_accept_length`` is about 1 (one token per verify), which
these settings cannot raise; the accounting identity below still checks every verify step.
"""

from __future__ import annotations

import json
import random
from typing import List

import pytest
from _real_server import TinyServer, started

pytestmark = pytest.mark.slow

TOPK = 64
STEPS = 3  # draft chain length (--speculative-num-steps)
DRAFT_TOKENS = STEPS + 1  # the bonus token and STEPS drafts are verified together
NEW_TOKENS = 24
MODEL = [
    "--json-model-override-args",
    json.dumps({"index_topk": TOPK, "num_nextn_predict_layers": 1}),
]
SPEC = [
    "--speculative-algorithm", "NEXTN",
    "--speculative-num-steps", str(STEPS),
    "--speculative-eagle-topk", "1",
    "--speculative-num-draft-tokens", str(DRAFT_TOKENS),
]  # fmt: skip
PROMPT_LENS = (40, 100, 300)  # below and above the index top-k (sparse attention from 65 tokens)


def prompt(n: int, seed: int) -> List[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 500) for _ in range(n)]


def serve(args: List[str], log_path, prompts: List[List[int]]) -> List[dict]:
    server = TinyServer(MODEL + args, log_path)
    with started(server):
        return [server.generate(p, NEW_TOKENS) for p in prompts]


def test_mtp_greedy_tokens_equal_no_spec_server(tmp_path):
    prompts = [prompt(n, seed) for seed, n in enumerate(PROMPT_LENS)]
    # One server at a time (the machine is shared); the reference first.
    reference = serve([], tmp_path / "off.log", prompts)
    spec = serve(SPEC, tmp_path / "spec.log", prompts)
    for i, (want, got) in enumerate(zip(reference, spec)):
        assert got["output_ids"] == want["output_ids"], f"request {i} (prompt {PROMPT_LENS[i]})"
        meta = got["meta_info"]
        assert "spec_verify_ct" not in want["meta_info"] or not want["meta_info"]["spec_verify_ct"]
        verify_steps = meta["spec_verify_ct"]
        correct = meta["spec_num_correct_drafts"]
        # The draft ran before every verify step and proposed a full chain each time.
        assert verify_steps >= 1
        assert meta["spec_num_proposed_drafts"] == verify_steps * STEPS
        # The first token comes from the prefill; each verify step commits one token plus the
        # drafts it accepted.
        assert meta["completion_tokens"] == NEW_TOKENS == 1 + verify_steps + correct
        # Upstream's accept length: tokens per verify step, the prefill's token counted.
        assert meta["spec_accept_length"] == pytest.approx(NEW_TOKENS / verify_steps)
        assert sum(meta["spec_correct_drafts_histogram"]) == verify_steps
