"""KV offload for DSA (DeepSeek-V3.2 sparse attention) decode.

The full latent KV lives in a pinned host pool; the GPU keeps the indexer keys for the whole context
and a bounded sparse KV buffer managed by a GPU LRU. Enabled by ``--enable-kv-offload``.

Nothing here is imported unless the flag is on.
"""
