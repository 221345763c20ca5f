"""NSA attention backend adapter for ``--enable-kv-offload`` (intentionally empty at 0.5.10.post1).

No backend subclass is needed on this base: kv offload implements the coordinator protocol that
``NativeSparseAttnBackend`` already calls for HiSparse (``swap_in_selected_pages`` in
``forward_decode``, logical->physical translation in ``forward_extend``; see docs/kv_offload.md,
"Decode integration"). A subclass goes here only if a rebase onto the DSA backend of later SGLang
releases loses that protocol.
"""
