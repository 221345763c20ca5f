"""The patch series and the kv offload interface agree.

* Every call a patch makes on ``...kv_offload`` is a method of :class:`KVOffloadHooks`, with the
  number of arguments the method takes, and every method of the interface is called by some patch
  or by the allocator upstream calls (``translate_kv_indices_for_transfer``).
* ``KVOffloadRuntime`` implements the interface with the interface's signatures.
* The model-runner patch calls the three entry points of ``runtime`` with their arity.
* Everything upstream's model side (DSA backend, model runner, CUDA-graph runner) uses on the
  sparse-attention coordinator slot is a member of ``hooks.SparseKVCoordinator``, which both
  ``DSAOffloadAdapter`` and upstream's ``HiSparseCoordinator`` satisfy.
"""

import ast
import inspect
import re
from pathlib import Path

import pytest
import sglang
from sglang.srt.layers.attention.dsa_offload.adapter import DSAOffloadAdapter
from sglang.srt.mem_cache.sparsity.kv_offload import device_pool, runtime
from sglang.srt.mem_cache.sparsity.kv_offload.hooks import KVOffloadHooks, SparseKVCoordinator
from test_coordinator import Harness

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
                and node.value.attr == "hisparse_coordinator"
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
