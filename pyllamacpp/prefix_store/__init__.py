"""A prefix store: decoded prefixes kept across runs and processes, in llama.cpp's own state format.

A sequence's KV cells are cut into chunks of ``chunk_size`` positions; chunk *k* is stored under a
key chained along the token ids (it covers every token up to the chunk's end) and the context's
identity (the model file, the K and V types, flash attention, RoPE settings, LoRA adapters and
control vector, the llama.cpp pin), so two prompts that share their first chunks store them once and
a chunk made under other settings is never loaded. Each chunk is a valid sequence-state dump of its
cells (``pyllamacpp parse-state`` reads it). :meth:`PrefixStore.restore` joins the longest run of
stored chunks into one dump and loads it with ``llama_state_seq_set_data_ext``; the caller decodes
the rest. A sliding-window model (an iSWA cache) keeps beside a chunk the window of its
sliding-window cells at the chunk's end (:func:`window_key`), stored when a sequence ends there
(:meth:`PrefixStore.prefill` stops at each chunk's end); recurrent and hybrid memories are refused.

Two backends: a local directory (:class:`DirectoryBackend`, the default) and a Redis server
(:class:`RedisBackend`, a ``redis://`` URL; it needs the ``redis`` package, the ``store`` extra).
"""

from ._directory import ChunkCorrupt, ChunkFile, DirectoryBackend, StoreError
from ._redis import RedisBackend, RedisChunk
from ._store import PrefixStore, PrefixStoreWarning, context_identity, open_backend, window_key

__all__ = [
    "PrefixStore",
    "PrefixStoreWarning",
    "DirectoryBackend",
    "RedisBackend",
    "open_backend",
    "ChunkFile",
    "RedisChunk",
    "ChunkCorrupt",
    "StoreError",
    "context_identity",
    "window_key",
]
