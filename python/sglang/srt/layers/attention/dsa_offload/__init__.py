"""DSA attention backend adapter for ``--enable-kv-offload``: :class:`adapter.DSAOffloadAdapter`."""
