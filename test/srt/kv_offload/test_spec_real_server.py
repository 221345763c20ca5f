"""End to end: speculative decoding (NEXTN = EAGLE on the model's MTP layer) on the tiny real server.

Flag off, and with ``--enable-kv-offload``: target verify then plans each request's draft tokens'
top-k as one row (their union's misses loaded once), the draft positions' KV sits in GPU tail rows
until committed, and the MTP layer keeps its own dense KV. The tiny DeepSeek-V3.2 gets one MTP layer
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
from _real_server import started
from tiny_server import FP8_KV
from tiny_server_proc import TinyServer

pytestmark = pytest.mark.slow

TOPK = 64
STEPS = 3  # draft chain length (--speculative-num-steps)
DRAFT_TOKENS = STEPS + 1  # the bonus token and STEPS drafts are verified together
NEW_TOKENS = 24
MODEL = FP8_KV + [  # fp8 KV (656 B rows), the MTP layer's own pool too
    "--json-model-override-args",
    json.dumps({"index_topk": TOPK, "num_nextn_predict_layers": 1}),
]
SPEC = [
    "--speculative-algorithm", "NEXTN",
    "--speculative-num-steps", str(STEPS),
    "--speculative-eagle-topk", "1",
    "--speculative-num-draft-tokens", str(DRAFT_TOKENS),
]  # fmt: skip
PROMPT_LENS = (40, 100, 300, 700)  # below and above the index top-k (sparse from 65 tokens)
# Slots for the union of a verify step's DRAFT_TOKENS top-k sets (the least kv offload accepts):
# the 300- and 700-token requests outgrow them and load from the host.
OFFLOAD = [
    "--enable-kv-offload",
    "--kv-offload-config",
    json.dumps({"sparse_slots_per_req": DRAFT_TOKENS * TOPK}),
]


def prompt(n: int, seed: int) -> List[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 500) for _ in range(n)]


def serve(args: List[str], log_path, prompts: List[List[int]], offload_state=None) -> List[dict]:
    server = TinyServer(MODEL + args, log_path)
    with started(server):
        outs = [server.generate(p, NEW_TOKENS) for p in prompts]
        if offload_state is not None:
            offload_state.update(server.wait_no_leak())
        return outs


PROMPTS = [prompt(n, seed) for seed, n in enumerate(PROMPT_LENS)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> List[dict]:
    """The flag-off server without speculative decoding (one server at a time: the machine is
    shared)."""
    return serve([], tmp_path_factory.mktemp("spec") / "off.log", PROMPTS)


@pytest.mark.parametrize("offload", [False, True], ids=["flag-off", "kv-offload"])
def test_mtp_greedy_tokens_equal_no_spec_server(tmp_path, reference, offload):
    prompts = PROMPTS
    state = {} if offload else None
    spec = serve(SPEC + (OFFLOAD if offload else []), tmp_path / "spec.log", prompts, state)
    if offload:
        # Verify steps loaded the union of the draft tokens' top-k misses from the host (the
        # longest prompt outgrows its slots), with no plan error; wait_no_leak: every free count
        # back at start.
        assert state["loaded"] > 0 and state["error_flags"] == 0
        assert state["admitted"] == state["released"] == len(prompts)
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
