"""Whether loading a state into a sequence can fail on room, and the copy of the sequence kept
aside when it can: llama.cpp clears a sequence whose load fails. ``StateRoom`` is a base of
``StateMethods`` (context_state.py)."""

from __future__ import annotations

import numpy as np

from ._lib import ffi, lib
from ._state_types import SeqState, _StateBase

# a failed load whose backup did not load back: the sequence shared its cells with another one
# (seq_cp in a unified cache), which a state load cannot do again, so they are not free for it
_NOT_BACK = "now empty: the copy kept aside did not fit back (cells it shared with another sequence stay taken)"


class StateRoom(_StateBase):
    """Room for a load, and the backup of the sequence it replaces (see the module docstring)."""

    def _occupied(self, seq_id: int) -> bool:
        # a hybrid memory whose attention part is empty has seq_pos_max -1 (the min of its
        # parts' maxima, llama_memory_hybrid::seq_pos_max) but seq_pos_min >= 0
        return self.memory.seq_pos_max(seq_id) >= 0 or self.memory.seq_pos_min(seq_id) >= 0

    def _load_fits(self, seq_id: int, buf: np.ndarray) -> bool:
        """True when loading this checked sequence blob into ``seq_id`` cannot fail, so the
        sequence needs no backup. Checked, the blob can still fail on room alone:
        llama_kv_cache::state_read_meta removes ``seq_id``'s cells, then ``find_slot`` needs
        ``cell_count`` usable cells of its stream, any of them (not contiguous). So it fits when
        ``cell_count <= n_ctx_seq - (cells the other sequences of that stream hold)``.
        Plain KV caches only (iSWA, recurrent and hybrid memories restore more than one part:
        they get the backup)."""
        if not self._plain_kv:
            return False
        if self._own_stream_fits():
            return True
        if buf.size < 12 or not buf.flags.c_contiguous:
            return False
        n_stream = int(buf[8:12].view("<u4")[0])
        if not 1 <= n_stream <= 256 or buf.size < 12 + 4 * n_stream:
            return False
        # u32 cell_count of stream 0, then its cells...: only a leading run of empty streams
        # reads as counts, and a checked sequence blob has cells in one stream
        counts = buf[12 : 12 + 4 * n_stream].view("<u4")
        nz = np.flatnonzero(counts)
        return self._room_for(seq_id, int(counts[nz[0]]) if nz.size else 0)

    def _room_for(self, seq_id: int, cell_count: int) -> bool:
        """True when ``cell_count`` cells loaded into ``seq_id`` cannot fail on room (see
        _load_fits): always with a stream of its own, else when the cells the other sequences
        of the one stream hold leave that many (plain KV caches only)."""
        if not self._plain_kv:
            return False
        if self._own_stream_fits():
            return True
        room = self.n_ctx_seq  # of the one stream the other sequences share
        for s in range(self.n_seq_max):
            if s != seq_id and self.memory.seq_pos_max(s) >= 0:
                c = self._cells_held(s)
                if c is None:
                    return False
                room -= c
        return cell_count <= room

    def _own_stream_fits(self) -> bool:
        """A plain KV cache whose every sequence has a stream of its own: a checked blob (or one
        this context made) has cell_count <= n_ctx_seq, so it always fits (see _load_fits)."""
        return self._plain_kv and not (self.params.kv_unified and self.n_seq_max > 1)

    def _cells_held(self, s: int) -> int | None:
        """Cells sequence ``s`` holds in a one-stream plain KV cache, from two sizes llama.cpp
        counts without copying anything (llama_io_write_dummy): with and without
        ``ON_DEVICE`` (headers only). Their difference is cells x the K+V row bytes of a token;
        the headers-only size is 16 + cells x (12 or 24 with llama_kv_cell_ext) + 8 + 12 per
        K/V record. Both must agree, else None (the caller then keeps a backup)."""
        ptr = self.ptr
        meta = int(lib.llama_state_seq_get_size_ext(ptr, s, lib.LLAMA_STATE_SEQ_FLAGS_ON_DEVICE))
        full = int(lib.llama_state_seq_get_size_ext(ptr, s, 0))
        if self._kv_row_bytes is None:
            m = self.model
            n_kv_layers = sum(1 for n in m.kv_head_counts() if n > 0)
            self._kv_row_bytes = (m.kv_bytes_per_token(self.params.type_k, self.params.type_v), n_kv_layers)
        row_bytes, n_layers = self._kv_row_bytes
        cells, rest = divmod(full - meta, row_bytes)
        if rest or meta - 16 - 8 - 24 * n_layers not in (12 * cells, 24 * cells):
            return None
        return cells

    def _put_back(self, seq_id: int, backup: SeqState) -> bool:
        """Load the copy of ``seq_id`` kept aside before a load that failed; False (the sequence
        left empty) when it does not fit back either."""
        if lib.pyl_state_seq_set(self.ptr, ffi.from_buffer(backup.data), len(backup), seq_id, 0):
            return True
        self.memory.seq_rm(seq_id)
        return False
