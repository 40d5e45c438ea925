"""Read and write llama.cpp state dumps with numpy, without the compiled extension.

``parse()`` takes what llama_state_seq_get_data(_ext), llama_state_get_data,
llama_state_seq_save_file or llama_state_save_file produced (bytes, a uint8 array or a path),
and returns a KVState: header, cells, and per layer zero-copy views of K and V.

The layout (llama-context.cpp, llama-kv-cache.cpp, llama-memory-recurrent.cpp at the pin):
- sequence dump:  u32 0xaf143cd8, i32 seq_id, memory
- seq file:       u32 'ggsq', u32 version 3, u32 n_token, i32 tokens[n], memory (no 0xaf143cd8)
- context state:  u32 len, arch name, memory
- session file:   u32 'ggsn', u32 version 10, u32 n_token, i32 tokens[n], context state
- memory:         the memory module's state; a KV cache writes u32 n_stream, then per stream
  u32 cell_count, cells (i32 pos, u32 n_seq_id, [12-byte llama_kv_cell_ext], i32 seq_id...),
  u32 v_trans, u32 n_layer, K records (i32 type, u64 row_size, rows), V records (the same, or
  with v_trans=1: i32 type, u32 element size, u32 n_embd_v_gqa, values value-major).
  iSWA caches write base then swa; hybrid memory the KV cache then the recurrent state;
  dsa (mla, lid), msa (base, idx), dsa-iswa (mla, lid, swa), hybrid-idx (kv, recurrent, idx);
  llama_kv_cache_dsv4 (DeepSeek V4): u32 'DSV4', u32 version, u32 mode, its K-only iSWA raw cache
  (base, swa), then compressed K caches (csa, hca, lid) and compressor states (csa-state,
  hca-state, lid-state): Dsv4Block parts, see _dsv4.
- StateFlags.ON_DEVICE dumps hold the same headers without any rows (metadata only).
- StateFlags.PARTIAL_ONLY dumps hold only the memory's partial part: an iSWA cache's swa part, a
  hybrid memory's recurrent part (``partial=``/``flags=``, a sidecar's ``flags``, or a layer map).
- Records carry the model's layer (``il``) when the layer map is known (model=, sidecar).
"""

from ._buffer import StateFormatError
from ._layers import arch_keys, layer_map, rule_keys
from ._memory import ON_DEVICE, PARTIAL_ONLY, memory_of, written_parts
from ._parse import IO_MAGIC, SEQ_FILE_MAGIC, SEQ_FILE_VERSION, SESSION_MAGIC, SESSION_VERSION
from ._records import (
    Dsv4Block,
    DumpKind,
    Header,
    LayerViews,
    Layout,
    LayoutRow,
    MemoryPart,
    MetadataOnlyError,
    Segment,
    Stream,
    TensorRecord,
)
from ._sidecar import SIDECAR_FIELDS, gguf_field, model_facts, read_sidecar, sidecar_path, write_sidecar
from ._state import KVState, parse
from ._types import GGMLType, hadamard
from ._write import join_cells, join_cells_data, select_cells

__all__ = [
    "parse",
    "KVState",
    "select_cells",
    "join_cells",
    "join_cells_data",
    "StateFormatError",
    "DumpKind",
    "Header",
    "MemoryPart",
    "Dsv4Block",
    "Stream",
    "TensorRecord",
    "LayerViews",
    "MetadataOnlyError",
    "layer_map",
    "Layout",
    "LayoutRow",
    "Segment",
    "GGMLType",
    "hadamard",
    "write_sidecar",
    "read_sidecar",
    "sidecar_path",
    "model_facts",
    "SIDECAR_FIELDS",
    "IO_MAGIC",
    "SEQ_FILE_MAGIC",
    "SESSION_MAGIC",
    "SEQ_FILE_VERSION",
    "SESSION_VERSION",
    "PARTIAL_ONLY",
    "ON_DEVICE",
    "memory_of",
    "written_parts",
]
# the package's internal API, outside __all__: what Model and the context's state checks read from
# a GGUF (llama.cpp's metadata leaves arrays out) and which keys a layer rule reads
_INTERNAL = (gguf_field, arch_keys, rule_keys)
