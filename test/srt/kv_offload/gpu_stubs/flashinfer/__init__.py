"""Import-time stand-in for flashinfer on a CUDA machine without it (the lent GPU box).

Upstream modules import flashinfer names at module level once torch reports CUDA (``deepseek_v2``:
``flashinfer.gemm.mm_M1_16_K7168_N256``; ``sampler``: ``flashinfer.sampling``). Every name and
submodule here is a placeholder that raises when called. The tiny real server runs with
``SGLANG_IS_FLASHINFER_AVAILABLE=0`` so upstream picks its non-flashinfer paths, and the stand-ins
switch off the one optional import that would otherwise be used (G4: ``fused_topk_deepseek``); see
``test/srt/kv_offload/standins/kv_offload_standins.py``. Put on the path by ``scripts/tiny_server.py``
on CUDA machines only.
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+gpustub"


class _Unavailable:
    def __init__(self, name):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(
            f"{self._name} is not available on this machine (flashinfer stub)"
        )

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


__getattr__ = _module_getattr(__name__)


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith(__name__ + ".") and fullname not in sys.modules:
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
