"""The patch series and the kv offload interface agree.

* Every call a patch makes on ``...kv_offload`` is a method of :class:`KVOffloadHooks`, with the
  number of arguments the method takes, and every method of the interface is called by some patch
  or by the allocator upstream calls (``translate_kv_indices_for_transfer``).
* ``KVOffloadRuntime`` implements the interface with the interface's signatures.
* The model-runner patch calls the three entry points of ``runtime`` with their arity.
* Everything upstream's model side (DSA backend, model runner, CUDA-graph runner) uses on the
  sparse-KV coordinator slot (``sparse_kv_coordinator``, patch 0005) is a member of
  ``hooks.SparseKVCoordinator``, which both ``DSAOffloadAdapter`` and upstream's
  ``HiSparseCoordinator`` satisfy; the DSA backend reads no other slot.
* The real ``DeepseekSparseAttnBackend``, built on CPU over real kv offload pools, takes its
  offload branch with the adapter in the slot (unfused top-k; decode attention reads the rows the
  adapter's ``swap_in_selected_pages`` returned, which hold the selected tokens' KV) and not
  without it; HiSparse's set-up fills the slot with HiSparse's coordinator, as before.
"""

import ast
import inspect
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import sglang
import torch
from sglang.srt.layers.attention.dsa_offload.adapter import DSAOffloadAdapter
from sglang.srt.mem_cache.sparsity.kv_offload import device_pool, runtime
from sglang.srt.mem_cache.sparsity.kv_offload.hooks import KVOffloadHooks, SparseKVCoordinator
from test_coordinator import LAYERS, TOPK, Harness

ROOT = Path(__file__).resolve().parents[3]
PATCHES = sorted((ROOT / "patches").glob("*.patch"))
UPSTREAM = Path(sglang.__file__).resolve().parent / "srt"
MODEL_SIDE = (
    "layers/attention/dsa_backend.py",
    "model_executor/model_runner.py",
    "model_executor/runner/decode_cuda_graph_runner.py",
)


def added_code(patch: Path) -> str:
    """The added lines of a patch, dedented per hunk into parseable statements."""
    return "\n".join(line[1:] for line in patch.read_text().splitlines() if line.startswith("+ "))


def calls_on(name: str, text: str):
    """``(method, n_args)`` of every ``<...>.name.method(args)`` / ``name.method(args)`` call."""
    found = []
    for m in re.finditer(rf"\b{name}\.(\w+)\(", text):
        depth, i, args, start = 1, m.end(), [], m.end()
        while depth:
            c = text[i]
            if c in "([{":
                depth += 1
            elif c in ")]}":
                depth -= 1
            elif c == "," and depth == 1:
                args.append(text[start:i])
                start = i + 1
            i += 1
        args.append(text[start : i - 1])
        found.append((m.group(1), len([a for a in args if a.strip()])))
    return found


def interface_methods():
    return {
        name: inspect.signature(fn)
        for name, fn in vars(KVOffloadHooks).items()
        if getattr(fn, "__isabstractmethod__", False)
    }


def test_every_hook_call_is_an_interface_method_with_its_arity():
    methods = interface_methods()
    called = set()
    for patch in PATCHES:
        for method, n_args in calls_on("kv_offload", added_code(patch)):
            assert (
                method in methods
            ), f"{patch.name} calls kv_offload.{method}, not in KVOffloadHooks"
            expected = len(methods[method].parameters) - 1  # self
            assert n_args == expected, (
                f"{patch.name}: kv_offload.{method} called with {n_args} argument(s), "
                f"KVOffloadHooks.{method} takes {expected}"
            )
            called.add(method)
    # The allocator (an upstream class) also calls the interface where upstream calls it.
    for method, n_args in calls_on("kv_offload", inspect.getsource(device_pool)):
        assert method in methods and n_args == len(methods[method].parameters) - 1, method
        called.add(method)
    assert called == set(methods), f"interface methods nothing calls: {set(methods) - called}"


def test_runtime_implements_the_interface_with_its_signatures():
    assert issubclass(runtime.KVOffloadRuntime, KVOffloadHooks)
    assert not getattr(runtime.KVOffloadRuntime, "__abstractmethods__", None)
    for name, sig in interface_methods().items():
        impl = inspect.signature(getattr(runtime.KVOffloadRuntime, name))
        assert list(impl.parameters) == list(sig.parameters), name


def test_model_runner_patch_calls_the_factories_with_their_arity():
    (patch,) = [p for p in PATCHES if "model-runner" in p.name]
    calls = calls_on("runtime", added_code(patch))
    assert sorted(calls) == [
        ("build_allocator", 2),
        ("device_pool_factory", 2),
        ("init_offload", 1),
    ]
    for name, n_args in calls:
        assert len(inspect.signature(getattr(runtime, name)).parameters) == n_args


def test_model_side_uses_only_what_the_adapter_provides():
    used = set()
    for rel in MODEL_SIDE:
        tree = ast.parse((UPSTREAM / rel).read_text())
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Attribute)
                and node.value.attr == "sparse_kv_coordinator"
            ):
                used.add(node.attr)
    members = {"num_real_reqs", "swap_in_selected_pages", "wait_for_pending_backup"}
    assert (
        set(SparseKVCoordinator.__annotations__)
        | {n for n in vars(SparseKVCoordinator) if not n.startswith("_")}
        >= members
    )
    assert used == members, used
    assert isinstance(Harness().adapter, SparseKVCoordinator)
    # HiSparse's own slot is no longer read on the DSA model side.
    assert "hisparse_coordinator" not in (UPSTREAM / MODEL_SIDE[0]).read_text()


@pytest.mark.parametrize("impl", ["kv_offload", "hisparse"])
def test_both_coordinators_satisfy_the_protocol(impl):
    """Upstream calls the slot positionally; each method takes the protocol's arguments."""
    if impl == "kv_offload":
        cls = DSAOffloadAdapter
    else:
        from sglang.srt.managers.hisparse_coordinator import HiSparseCoordinator as cls
    # num_real_reqs is an instance attribute, made in __init__.
    assert "self.num_real_reqs = " in inspect.getsource(cls.__init__)
    for name in ("swap_in_selected_pages", "wait_for_pending_backup"):
        want = inspect.signature(getattr(SparseKVCoordinator, name)).parameters
        got = inspect.signature(getattr(cls, name)).parameters
        assert len(got) == len(want), (impl, name, list(got))
        assert all(p.kind == p.POSITIONAL_OR_KEYWORD for p in got.values()), (impl, name)


@pytest.mark.parametrize("text, expected", [("x.kv_offload.a(b, c(d, e))", [("a", 2)])])
def test_call_parser(text, expected):
    assert calls_on("kv_offload", text) == expected


def _dsa_backend(monkeypatch, coordinator, harness):
    """The real ``DeepseekSparseAttnBackend`` on CPU over the harness's pools, built from a model
    runner whose sparse-KV coordinator slot holds ``coordinator`` (the deployments' fp8 decode
    backend; SM90 reported, as the CPU server's stand-ins do)."""
    from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    reset_context()
    publish(
        ServerArgs(
            model_path="dummy",
            device="cpu",
            kv_cache_dtype="fp8_e4m3",
            dsa_decode_backend="flashmla_kv",
            dsa_prefill_backend="flashmla_kv",
        ),
        role="test",
        ranks=SpawnRanks(world_rank=0, dp_rank=None),
    )
    config = json.loads(
        (ROOT / "test/srt/kv_offload/fixtures/tiny-deepseek-v32/config.json").read_text()
    )
    hf_config = SimpleNamespace(**config)
    model_config = SimpleNamespace(
        hf_config=hf_config,
        hf_text_config=hf_config,
        context_len=harness.r2t.req_to_token.shape[1],
        num_attention_heads=config["num_attention_heads"],
        qk_nope_head_dim=config["qk_nope_head_dim"],
        kv_lora_rank=config["kv_lora_rank"],
        qk_rope_head_dim=config["qk_rope_head_dim"],
    )
    runner = SimpleNamespace(
        device="cpu",
        page_size=harness.pool.page_size,
        model_config=model_config,
        token_to_kv_pool=harness.pool,
        req_to_token_pool=harness.r2t,
        is_draft_worker=False,
        kv_cache_dtype=torch.float8_e4m3fn,
        sparse_kv_coordinator=coordinator,
    )
    backend = DeepseekSparseAttnBackend(runner)
    assert backend.sparse_kv_coordinator is coordinator
    return backend, config


def _decode_layer(backend, config, harness, layer_id, reqs, topk):
    """One decode layer's ``forward_decode`` (no KV write) with the indexer's ``topk``; returns
    the page table the sparse attention kernel was handed and the KV buffer it reads them from."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    seen = {}

    def attend(**kwargs):  # the FlashMLA kernel: the rows of its page table are what it reads
        seen.update(table=kwargs["page_table_1"], cache=kwargs["kv_cache"])
        return kwargs["q_all"]

    backend._forward_flashmla_kv = attend
    rpi = torch.tensor(reqs)
    seq_lens = torch.tensor([harness.seq_len(r) for r in reqs])
    backend.forward_metadata = SimpleNamespace(
        dsa_cache_seqlens_int32=seq_lens.int(),
        page_table_1=harness.r2t.req_to_token[rpi],
        paged_mqa_schedule_metadata=None,
        paged_mqa_ctx_lens_2d=None,
    )
    batch = SimpleNamespace(
        forward_mode=ForwardMode.DECODE, req_pool_indices=rpi, seq_lens=seq_lens
    )
    heads, head_dim = (
        config["num_attention_heads"],
        config["kv_lora_rank"] + config["qk_rope_head_dim"],
    )
    layer = SimpleNamespace(
        is_cross_attention=False,
        layer_id=layer_id,
        tp_q_head_num=heads,
        head_dim=head_dim,
        v_head_dim=config["kv_lora_rank"],
        scaling=1.0,
    )
    q = torch.zeros(len(reqs), heads * head_dim, dtype=torch.bfloat16)
    force_unfused = backend.get_indexer_metadata(layer_id, batch).force_unfused_topk
    backend.forward_decode(q, None, None, layer, batch, topk_indices=topk)
    return force_unfused, seen["table"], seen["cache"]


def _spy_swap_in(monkeypatch, adapter):
    calls = []
    swap_in = adapter.swap_in_selected_pages

    def recorded(*args):
        calls.append((args, swap_in(*args)))
        return calls[-1][1]

    monkeypatch.setattr(adapter, "swap_in_selected_pages", recorded)
    return calls


def test_dsa_backend_decode_attends_the_rows_the_adapter_swapped_in(monkeypatch):
    """With the adapter in the slot, the real backend asks for unfused top-k (token positions),
    hands each layer's top-k to ``swap_in_selected_pages`` and its attention reads exactly the rows
    returned: the selected tokens' KV, some loaded from the host."""
    h = Harness(physical_pages=16)
    assert h.admit(300) and h.admit(90)  # sparse (past its 64 slots) and resident
    reqs = sorted(h.kv)
    lens = [h.seq_len(r) for r in reqs]
    h.coord.before_decode_step(reqs, lens, [n - 1 for n in lens])
    h.coord.poll()  # the sparse request's complete pages now live on the host only
    on_host = 0
    h.adapter.num_real_reqs.fill_(len(reqs))  # ModelRunner.forward does this before a decode
    backend, config = _dsa_backend(monkeypatch, h.adapter, h)
    calls = _spy_swap_in(monkeypatch, h.adapter)
    gen = torch.Generator().manual_seed(3)
    for layer in range(LAYERS):
        topk = torch.full((len(reqs), TOPK), -1, dtype=torch.int32)
        picks = [torch.randperm(n, generator=gen)[: TOPK - 2] for n in lens]
        for b, pos in enumerate(picks):
            topk[b, : len(pos)] = pos.to(torch.int32)
        before = topk.clone()
        locs = h.r2t.req_to_token[torch.tensor(reqs)[:, None], topk.clamp_min(0).long()]
        on_host += int((h.alloc.full_to_hisparse_device_index_mapping[locs] == 0).sum())
        force_unfused, table, cache = _decode_layer(backend, config, h, layer, reqs, topk)
        gathered = cache.view(cache.shape[0], -1).view(torch.uint8)[table.long()]
        assert force_unfused, "the indexer must hand the adapter token positions"
        args, rows = calls[-1]
        assert args[2] is topk and args[3] == layer and torch.equal(topk, before)
        assert table is rows, "attention reads the adapter's rows, not the indexer's top-k"
        for b, pos in enumerate(picks):
            assert torch.equal(gathered[b, : len(pos)], h.kv[reqs[b]][layer][pos.long()])
            assert bool((table[b, len(pos) :] == -1).all())
    assert len(calls) == LAYERS and on_host > 0
    h.finish_all()


def test_dsa_backend_without_the_flag_takes_no_offload_branch(monkeypatch):
    """With the slot empty (the flag off, HiSparse off), the same backend keeps upstream's fused
    top-k and its attention reads the indexer's table itself; the adapter is never called."""
    h = Harness()
    assert h.admit(100)
    reqs = sorted(h.kv)
    calls = _spy_swap_in(monkeypatch, h.adapter)
    backend, config = _dsa_backend(monkeypatch, None, h)
    topk = h.r2t.req_to_token[reqs[0], :TOPK].view(1, -1).clone()  # fused top-k: locs
    force_unfused, table, _ = _decode_layer(backend, config, h, 0, reqs, topk)
    assert not force_unfused and table is topk and not calls
    h.finish_all()


def test_hisparse_fills_the_sparse_kv_coordinator_slot(monkeypatch):
    """HiSparse's set-up puts its coordinator in the slot the DSA backend reads, as before the
    slot had its own name (``ModelRunner.maybe_init_hisparse_coordinator``)."""
    from sglang.srt.managers import hisparse_coordinator
    from sglang.srt.mem_cache import sparsity
    from sglang.srt.model_executor import model_runner

    monkeypatch.setattr(hisparse_coordinator, "HiSparseCoordinator", SimpleNamespace)
    monkeypatch.setattr(hisparse_coordinator, "resolve_shared_index_layers", lambda **_: None)
    monkeypatch.setattr(
        sparsity,
        "parse_hisparse_config",
        lambda: SimpleNamespace(
            top_k=2048, device_buffer_size=4096, host_to_device_ratio=2, swap_in_block_size=1
        ),
    )
    monkeypatch.setattr(model_runner, "get_dp_tp_group", lambda: SimpleNamespace(cpu_group=None))
    runner = SimpleNamespace(
        enable_hisparse=True,
        model_config=SimpleNamespace(hf_text_config=SimpleNamespace(index_topk=2048)),
        req_to_token_pool=None,
        token_to_kv_pool_allocator=None,
        device="cpu",
        spec_algorithm=SimpleNamespace(is_none=lambda: True),
    )
    model_runner.ModelRunner.maybe_init_hisparse_coordinator(runner)
    assert runner.sparse_kv_coordinator is runner.hisparse_coordinator is not None
