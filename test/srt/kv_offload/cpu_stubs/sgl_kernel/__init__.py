"""CPU import-time stand-in for sgl_kernel (see ../README.md)."""

import os

__version__ = "0.0.0+cpustub"


_TOPK_STANDINS = ("fast_topk_v2", "fast_topk_transform_fused", "fast_topk_transform_ragged_fused")
_SPEC_STANDINS = (  # S17: speculative decoding's CPU-engine ops
    "assign_req_to_token_pool_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "fill_bonus_tokens_cpu",
    "fill_accept_out_cache_loc_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
)


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """0.5.23 ``kernels/ops/kvcache/cache_move.py`` imports this CPU op at module level when
    ``SGLANG_USE_CPU_ENGINE=1``: for every buffer ``i`` (base address ``data_ptrs[i]``, row stride
    ``strides[i]`` bytes) copy row ``src_loc[j]`` to row ``tgt_loc[j]`` (same maths, by memmove)."""
    import ctypes

    ptrs, row_bytes = data_ptrs.tolist(), strides.tolist()
    pairs = list(zip(tgt_loc.tolist(), src_loc.tolist()))
    for base, stride in zip(ptrs, row_bytes):
        for tgt, src in pairs:
            if tgt != src:
                ctypes.memmove(base + tgt * stride, base + src * stride, stride)


def _cpu_op_placeholder(name):
    def fn(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} (CPU-engine op) is not available here")

    fn.__name__ = name
    return fn


def __getattr__(name):
    # S5: NSA's three top-k kernels, as the torch references of the tiny real server's stand-ins.
    if name in _TOPK_STANDINS:
        import kv_offload_standins

        return getattr(kv_offload_standins, name)
    # S17: speculative decoding's CPU-engine ops, as torch twins of upstream's Triton kernels.
    if name in _SPEC_STANDINS:
        import kv_offload_standins

        return getattr(kv_offload_standins, name)
    # 0.5.23: modules import sgl_kernel's CPU-engine ops (``*_cpu``: speculative decoding, request
    # slot assignment for spec decode, ...) at module level when SGLANG_USE_CPU_ENGINE=1. Import
    # placeholders that raise when called; none other is on the tiny server's path.
    if name.endswith("_cpu"):
        return _cpu_op_placeholder(name)
    raise AttributeError(name)


if os.environ.get("KV_OFFLOAD_STUB_ALL_SGL_KERNEL_NAMES") == "1":
    # Only on a CUDA machine without sgl_kernel (the lent GPU box): upstream modules import many op
    # names and submodules at module level because torch reports CUDA. Hand out placeholders that
    # fail when called, so those modules import; nothing kv_offload runs goes through them.
    import importlib.abc
    import importlib.machinery
    import sys
    import types

    class _Unavailable:
        def __init__(self, name):
            self._name = name

        def __call__(self, *args, **kwargs):
            raise NotImplementedError(f"{self._name} is not available on this machine")

        def __getattr__(self, attr):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return _Unavailable(f"{self._name}.{attr}")

    def _module_getattr(prefix):
        def __getattr__(name):
            if name.startswith("__"):
                raise AttributeError(name)
            return _Unavailable(f"{prefix}.{name}")

        return __getattr__

    _placeholder = _module_getattr(__name__)

    def __getattr__(name):  # noqa: F811
        if name in _TOPK_STANDINS:
            import kv_offload_standins

            return getattr(kv_offload_standins, name)
        return _placeholder(name)

    class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, fullname, path, target=None):
            if fullname.startswith(__name__ + ".") and fullname not in sys.modules:
                if importlib.machinery.PathFinder.find_spec(fullname, path) is None:
                    return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
            return None

        def create_module(self, spec):
            module = types.ModuleType(spec.name)
            module.__path__ = []
            module.__getattr__ = _module_getattr(spec.name)
            return module

        def exec_module(self, module):
            pass

    sys.meta_path.append(_SubmoduleFinder())
