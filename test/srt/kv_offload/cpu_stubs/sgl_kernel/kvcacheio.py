"""CPU stand-in for sgl_kernel.kvcacheio: memory_pool_host imports it at module level."""

import torch


def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
    src_indices = src_indices.to(torch.long)
    dst_indices = dst_indices.to(torch.long)
    for src, dst in zip(src_layers, dst_layers):
        dst[dst_indices.to(dst.device)] = src[src_indices.to(src.device)].to(dst.device)


def _unavailable(name):
    def fn(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.kvcacheio.{name} is not available on CPU")

    fn.__name__ = name
    return fn


for _name in (
    "transfer_kv_all_layer transfer_kv_all_layer_direct_lf_pf transfer_kv_all_layer_lf_pf "
    "transfer_kv_all_layer_lf_ph transfer_kv_all_layer_mla transfer_kv_all_layer_mla_lf_pf "
    "transfer_kv_per_layer transfer_kv_per_layer_direct_pf_lf transfer_kv_per_layer_mla "
    "transfer_kv_per_layer_mla_pf_lf transfer_kv_per_layer_pf_lf transfer_kv_per_layer_ph_lf"
).split():
    globals()[_name] = _unavailable(_name)
