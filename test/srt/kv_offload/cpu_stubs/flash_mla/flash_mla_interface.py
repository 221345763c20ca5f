"""CPU stand-in: ``flash_mla_interface`` imports ``FlashMLASchedMeta`` from here at module level."""


class FlashMLASchedMeta:  # placeholder type; the sparse prefill/decode path never builds one
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("flash_mla.FlashMLASchedMeta is not available (flash_mla stub)")
