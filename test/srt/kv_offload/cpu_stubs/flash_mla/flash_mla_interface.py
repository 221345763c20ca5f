"""CPU stand-in: ``flash_mla_interface`` imports ``FlashMLASchedMeta`` from here at module level."""

from dataclasses import dataclass
from typing import Any


@dataclass
class FlashMLASchedMeta:
    """The wheel's schedule holder: ``kernels.ops.attention.flash_mla_interface`` wraps the legacy
    schedule tensors of ``get_mla_decoding_metadata`` in one before the sparse fp8 decode (S20);
    the reference reads neither."""

    tile_scheduler_metadata: Any = None
    num_splits: Any = None
