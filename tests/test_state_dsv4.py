"""llama_kv_cache_dsv4 (DeepSeek V4): no such model can be made here, so its dumps are composed as
llama_kv_cache_dsv4::state_write concatenates them (state_helpers: _dsv4_blocks writes the blocks
after the raw cache), and pyllamacpp.state reads them: parts, views, PARTIAL_ONLY, metadata-only,
streams of a whole memory, errors, layer maps and fuzzing.
"""

from __future__ import annotations

import numpy as np
import pytest
import state_helpers as sh
from state_helpers import (
    DSV4_MAGIC,
    _dsv4_blocks,
    _u32,
    check_layout,
)

from pyllamacpp import state
from pyllamacpp.state import DumpKind, StateFormatError

# the module-scoped fixtures these tests share (state_helpers.py); pytest finds a fixture by its
# own name wherever a module holds it
composed_parts = sh.composed_parts


@pytest.fixture(scope="module")
def dsv4(composed_parts):
    c = composed_parts
    pos_max = int(state.parse(c["hdr"] + c["Bk"]).cells["pos"].max())
    n_rows = (pos_max + 1) // 4  # dsv4_state_n_used_k_rows: csa and lid; hca's is (pos_max + 1) / 128
    assert n_rows == 2
    blocks, values = _dsv4_blocks(n_rows)
    head = c["hdr"] + _u32(DSV4_MAGIC, 1, 0)
    full = head + c["Ck"] + c["Bk"] + blocks
    pblocks, pvalues = _dsv4_blocks(n_rows, partial=True)
    partial = c["hdr"] + _u32(DSV4_MAGIC, 1, 1) + c["Bk"] + pblocks
    return {
        "full": full,
        "values": values,
        "partial": partial,
        "pvalues": pvalues,
        "n_rows": n_rows,
        "raw_end": len(head) + len(c["Ck"]) + len(c["Bk"]),
        "c": c,
    }


def _dsv4_checks(st, blob, values, names):
    """Parts, bytes, layout, and every value written, through records, views, address and layout."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    assert [p.name for p in st.parts] == names and st.options["memory"] == "dsv4"
    assert st.options["has_v"] is False and st.to_bytes() == blob
    check_layout(st)
    lay = st.layout()
    rows = {(r.part, r.kind, r.il, r.stream): r for r in lay.rows if r.il is not None}
    assert lay.payload_bytes == sum(r.nbytes for r in st.records())
    blocks = [p for p in st.parts if p.kind in ("compressed", "compressor")]
    assert len(lay.rows) == sum(len(s.records) for p in st.parts for s in p.streams)
    assert [(r.part, r.kind, r.il) for r in st.records() if r.part in [b.name for b in blocks]] == [
        (name, kind, il) for name, kind, il in values for _ in range(values[name, kind, il].shape[0])
    ]
    for (name, kind, il), v in values.items():
        for s in range(v.shape[0]):
            rec = st.record(kind, il, part=name, stream=s)
            assert rec.il == il and rec.stream == s and rec.n_cells == v.shape[1] and rec.n_embd == v.shape[2]
            row = rows[name, kind, il, s]
            assert (row.header_offset, row.data_offset, row.nbytes) == (rec.header_offset, rec.data_offset, rec.nbytes)
            if rec.type.quantized:
                raw = quantize(v[s], GGMLQuantizationType(rec.type.id))
                assert rec.values.tobytes() == raw.tobytes()  # raw rows
                np.testing.assert_array_equal(rec.dequantize(), dequantize(raw, GGMLQuantizationType(rec.type.id)))
                np.testing.assert_allclose(rec.dequantize(), v[s], atol=np.abs(v).max() / 127 + 1e-3)
            else:
                assert rec.values.shape == v[s].shape
                np.testing.assert_array_equal(rec.values, v[s].astype(rec.type.dtype))
            assert rec.values.size == 0 or np.shares_memory(rec.values, st.buffer)
            # the rows as the layout places them, and one value through address()
            got = np.frombuffer(blob, np.uint8, row.nbytes, row.data_offset)
            assert got.tobytes() == rec.rows.tobytes()
            if v.shape[1] and not rec.type.quantized:
                r_, j = v.shape[1] - 1, v.shape[2] - 1
                at = st.address(kind, il, r_, 0, j, part=name, stream=s)
                assert at == rec.data_offset + r_ * rec.row_size + j * rec.type.type_size
                assert blob[at : at + rec.type.type_size] == v[s, r_, j].astype(rec.type.dtype).tobytes()
    return lay


def test_dsv4_round_trip_layout_and_views(dsv4):
    blob = dsv4["full"]
    st = state.parse(blob)
    names = ["base", "swa", "csa", "hca", "lid", "csa-state", "hca-state", "lid-state"]
    lay = _dsv4_checks(st, blob, dsv4["values"], names)
    assert st.partial is False and st.metadata_only is False
    # the raw cache is the K-only iSWA dump it was made of
    raw = state.parse(dsv4["c"]["hdr"] + dsv4["c"]["Ck"] + dsv4["c"]["Bk"], has_v=False)
    assert st.stream("swa").k[0].tobytes() == raw.stream("swa").k[0].tobytes()
    assert st.part("base").offset == 8 + 12 and st.part("csa").offset == dsv4["raw_end"]
    # blocks: headers as written
    csa, hca, lid = st.part("csa"), st.part("hca"), st.part("lid")
    assert (csa.version, csa.ratio, csa.n_rows, csa.n_stream, csa.layers) == (2, 4, 2, 1, (0, 2))
    assert (hca.ratio, hca.n_rows, hca.layers) == (128, 0, (1,)) and hca.records[0].values.shape == (0, 16)
    assert lid.records[0].type.name == "q8_0" and lid.records[0].values.shape == (2, 34)  # raw q8_0 rows
    cs = st.part("csa-state")
    assert (cs.kind, cs.ratio, cs.state_size, cs.n_embd_state, cs.layers) == ("compressor", 4, 8, 16, (0, 2))
    assert [r.kind for r in cs.records] == ["KV", "SCORE", "KV", "SCORE"]
    np.testing.assert_array_equal(st.stream("csa-state").views("score")[2], dsv4["values"]["csa-state", "SCORE", 2][0])
    assert st.stream("csa").k.layers == (0, 2) and st.stream("csa").k[2].shape == (2, 16)
    # every byte is metadata or payload; the payload is the raw K rows and the blocks' rows
    assert lay.metadata_bytes + lay.payload_bytes == len(blob)
    assert lay.payload_bytes == sum(r.nbytes for r in raw.records()) + sum(
        v[0].size * {"csa": 2, "hca": 4, "lid": 34 / 32}.get(name, 4) for (name, _, _), v in dsv4["values"].items()
    )
    segs = {s.what for s in lay.segments}
    assert {
        "dsv4: magic, version, mode",
        "csa: version, n_rows, ns, n_layer",
        "csa layer 1: il",
        "hca-state: version, ratio, state_size, n_embd_state, ns, n_layer",
    } <= segs
    # the table and the text show the blocks
    assert "csa-state" in lay.table() and "SCORE" in lay.table()
    text = st.describe()
    assert "csa (compressed K cache, 1 row per 4 positions): version 2, 2 rows (positions 0..7)" in text
    assert "hca-state (compressor state, ratio 128): 128 ring rows of 8 values" in text
    # memory="dsv4" reads the same; tensor_offset places a row in llama.cpp's [ne0, kv_size, n_stream] tensor
    assert state.parse(blob, memory="dsv4").to_bytes() == blob
    assert st.tensor_offset("K", 2, 1, 0, 3, kv_size=256, part="csa", dest_stream=1) == (256 + 1) * 32 + 3 * 2
    # edits through a writable view land in the dump, at the record's offset
    w = state.parse(bytearray(blob))
    w.record("KV", 2, part="lid-state").values[7, 5] = 42.0
    r = w.record("KV", 2, part="lid-state")
    out = w.to_bytes()
    at = r.data_offset + 7 * r.row_size + 5 * 4
    assert out[at : at + 4] == np.float32(42).tobytes() and out[:at] == blob[:at] and out[at + 4 :] == blob[at + 4 :]


def test_dsv4_partial_only(dsv4):
    blob = dsv4["partial"]
    for st in (state.parse(blob), state.parse(blob, memory="dsv4"), state.parse(blob, flags=state.PARTIAL_ONLY)):
        _dsv4_checks(st, blob, dsv4["pvalues"], ["swa", "csa-state", "hca-state", "lid-state"])
        assert st.partial is True
    assert (
        "partial (PARTIAL_ONLY): only the swa and csa-state and hca-state and lid-state parts of a DeepSeek V4"
        in state.parse(blob).describe()
    )
    assert state.written_parts("dsv4", True) == (
        ("kv", "swa"),
        ("compressor", "csa-state"),
        ("compressor", "hca-state"),
        ("compressor", "lid-state"),
    )
    assert [n for _, n in state.written_parts("dsv4", False)][:5] == ["base", "swa", "csa", "hca", "lid"]
    # state_read refuses a mode that is not the load's flag ("DSV4 state flags mismatch")
    for data, kw in ((blob, {"partial": False}), (dsv4["full"], {"partial": True}), (blob, {"flags": 0})):
        with pytest.raises(StateFormatError, match="mode") as e:
            state.parse(data, **kw)
        assert e.value.offset == 16 and e.value.what == "dsv4: mode"
    # a whole-context state is written with flags 0: mode 1 cannot be one
    ctx_head = _u32(9) + b"deepseek4"
    with pytest.raises(StateFormatError, match="mode") as e:
        state.parse(ctx_head + blob[8:])
    assert e.value.offset == len(ctx_head) + 8


def test_dsv4_metadata_only(dsv4):
    # ON_DEVICE: llama_io_write_device::write_tensor writes nothing into the blob, write() every
    # header: the dump without its payload segments
    for blob, _values, names in ((dsv4["full"], dsv4["values"], 8), (dsv4["partial"], dsv4["pvalues"], 4)):
        full = state.parse(blob)
        meta = b"".join(blob[s.offset : s.offset + s.nbytes] for s in full.layout().segments if not s.payload)
        # the blocks as the writer above writes them without rows
        blocks = _dsv4_blocks(dsv4["n_rows"], partial=names == 4, rows_out=False)[0]
        first = next(p for p in state.parse(meta).parts if p.kind in ("compressed", "compressor"))
        assert meta[first.offset :] == blocks
        for st in (
            state.parse(meta),
            state.parse(meta, flags=state.ON_DEVICE | (state.PARTIAL_ONLY if names == 4 else 0)),
        ):
            assert st.metadata_only and len(st.parts) == names and st.to_bytes() == meta
            check_layout(st)
            lay = st.layout()
            assert lay.payload_bytes == 0 and lay.total_bytes == len(meta)
            assert [(r.part, r.kind, r.il, r.type, r.row_size) for r in st.records()] == [
                (r.part, r.kind, r.il, r.type, r.row_size) for r in full.records()
            ]
            rec = st.record("KV", 0, part="csa-state")
            assert rec.data is None and rec.rows_nbytes == 8 * 16 * 4
            with pytest.raises(state.MetadataOnlyError):
                rec.values
            assert rec.tensor_offset(7, 0, 1, kv_size=8) == 7 * 64 + 4
            with pytest.raises(ValueError, match="metadata-only"):
                st.select_cells(lambda cells: cells["pos"] >= 0)


def test_dsv4_streams_of_a_whole_memory(dsv4):
    """A whole-context state (seq_id -1): every block writes ns = n_stream streams per layer
    tensor, interleaved (dsv4_state_write_tensor_streams); the raw cache's n_stream is that n."""
    c = dsv4["c"]

    def two_streams(part: bytes) -> bytes:  # a K-only part with an empty second stream
        assert part[:4] == _u32(1)
        return _u32(2) + part[4:] + _u32(0)

    blocks, values = _dsv4_blocks(256, ns=2)
    head = _u32(9) + b"deepseek4"
    blob = head + _u32(DSV4_MAGIC, 1, 0) + two_streams(c["Ck"]) + two_streams(c["Bk"]) + blocks
    st = state.parse(blob)
    assert st.kind is DumpKind.CONTEXT and st.part("csa").n_stream == 2 and st.part("swa").n_stream == 2
    _dsv4_checks(st, blob, values, ["base", "swa", "csa", "hca", "lid", "csa-state", "hca-state", "lid-state"])
    np.testing.assert_array_equal(st.stream("csa", 1).k[2], values["csa", "K", 2][1].astype(np.float16))
    with pytest.raises(ValueError, match="pass stream="):
        st.stream("csa")
    r0, r1 = st.record("K", 0, part="csa", stream=0), st.record("K", 0, part="csa", stream=1)
    assert r0.header_offset == r1.header_offset and r1.data_offset == r0.data_offset + r0.nbytes
    assert r1.header_size == 28
    # a sequence dump is of one stream (dsv4_state_dst_stream_range: ns must be 1)
    seq = c["hdr"] + blob[len(head) :]
    with pytest.raises(StateFormatError, match="streams") as e:
        state.parse(seq)
    csa_at = len(c["hdr"]) + 12 + len(two_streams(c["Ck"])) + len(two_streams(c["Bk"]))
    assert e.value.offset == csa_at + 8 and e.value.what == "csa: ns"
    # a whole state with one stream per block while the raw cache has two
    one_blocks, _ = _dsv4_blocks(256, ns=1)
    with pytest.raises(StateFormatError, match="streams") as e:
        state.parse(head + _u32(DSV4_MAGIC, 1, 0) + two_streams(c["Ck"]) + two_streams(c["Bk"]) + one_blocks)
    assert e.value.what == "csa: ns"


def _dsv4_fields(st, start: int):
    """(offset, size) of every header field of the dsv4 blocks from ``start``, and each rows chunk."""
    sizes = {"il": [4], "header": [4, 8, 8, 8]}
    out = []
    for seg in st.layout().segments:
        if seg.offset < start:
            continue
        if seg.payload:
            out.append((seg.offset, seg.nbytes))
            continue
        key = seg.what.split()[-1]
        widths = sizes.get(key, [4] * (seg.nbytes // 4))
        at = seg.offset
        for w in widths:
            out.append((at, w))
            at += w
        assert at == seg.offset + seg.nbytes, seg
    return out


def test_dsv4_errors_name_the_offset(dsv4):
    blob, c = dsv4["full"], dsv4["c"]
    st = state.parse(blob)

    def patched(at: int, value: int, size: int = 4) -> bytes:
        return blob[:at] + int(value).to_bytes(size, "little", signed=value < 0) + blob[at + size :]

    def fails(data, at, match, **kw):
        with pytest.raises(StateFormatError, match=match) as e:
            state.parse(data, **kw)
        assert e.value.offset == at, (e.value, at)
        return e.value

    csa, hca, lid = st.part("csa"), st.part("hca"), st.part("lid")
    cs, hs, ls = st.part("csa-state"), st.part("hca-state"), st.part("lid-state")
    k0 = csa.records[0]
    fails(c["hdr"] + c["Ck"] + c["Bk"], 8, "DSV4_STATE_MAGIC", memory="dsv4")
    fails(blob, 8, "not memory 'iswa'", memory="iswa")
    fails(patched(12, 2), 12, "version 2, expected 1")
    fails(patched(16, 2), 16, "mode 2")
    fails(blob, 8, "K-only", has_v=True)
    fails(patched(csa.offset, 3), csa.offset, "version 3, expected 2")
    assert state.parse(patched(csa.offset, 1)).part("csa").version == 1  # dsv4_state_read_k_cache reads 1
    fails(patched(csa.offset + 8, 2), csa.offset + 8, "2 streams, expected 1")
    fails(patched(hca.offset + 8, 0), hca.offset + 8, "0 streams")
    fails(patched(csa.offset + 4, 3), k0.header_offset + 12, "rows 2, expected the block's 3")
    fails(
        patched(k0.header_offset + 20, k0.row_size + 2, 8),
        k0.header_offset + 20,
        r"row_size 34, but ggml_row_size\(f16, 16\) is 32",
    )
    fails(patched(k0.header_offset + 4, 15, 8), k0.header_offset + 20, r"ggml_row_size\(f16, 15\) is 30")
    q0 = lid.records[0]
    fails(patched(q0.header_offset + 4, 16, 8), q0.header_offset + 4, "whole blocks of 32")
    fails(patched(k0.header_offset, 99), k0.header_offset, "unknown ggml type 99")
    fails(patched(csa.offset + 20 + 28 + k0.nbytes, 0), csa.offset + 20 + 28 + k0.nbytes, "il 0 after il 0")
    fails(patched(csa.offset + 16, 600), csa.offset + 16, "LLAMA_MAX_LAYERS")
    fails(patched(cs.offset, 2), cs.offset, "version 2, expected 1")
    fails(patched(cs.offset + 4, 8), cs.offset + 4, "8, expected 4")
    fails(patched(hs.offset + 8, 64), hs.offset + 8, "64, expected 128")
    fails(patched(ls.offset + 12, 63), ls.offset + 12, "even")
    fails(patched(cs.offset + 12, 18), cs.records[0].header_offset + 4, "ne0 16, expected n_embd_state 18")
    fails(patched(cs.records[1].header_offset, 1), cs.records[1].header_offset, "F32")
    fails(
        patched(cs.records[0].header_offset + 12, 7, 8),
        cs.records[0].header_offset + 12,
        "rows 7, expected the block's 8",
    )
    # layer sets: lid holds csa's layers, a state a prefix of its cache's, csa and hca apart
    fails(patched(lid.records[1].header_offset - 4, 3), lid.offset, r"layers \[0, 3\], but csa has \[0, 2\]")
    fails(patched(ls.records[2].header_offset - 4, 3), ls.offset, r"but csa-state has \[0, 2\]")
    fails(patched(hs.records[0].header_offset - 4, 2), hs.offset, "not the first layers of hca")
    # n_embd_state: csa-state's is 2 x hca-state's; lid's rows are half lid-state's n_embd_state
    e = fails(patched(hs.offset + 12, 4), hs.records[0].header_offset + 4, "ne0 8, expected n_embd_state 4")
    fails(
        blob[: cs.offset] + _dsv4_blocks(2, partial=True, n_embd_state={"csa-state": 24})[0],
        cs.offset + 12,
        "24, expected 2 x hca-state's 8",
    )
    fails(
        blob[: cs.offset] + _dsv4_blocks(2, partial=True, n_embd_state={"lid-state": 48})[0],
        lid.records[0].header_offset + 4,
        r"ne0 32, expected half of lid-state's n_embd_state 48",
    )
    # trailing bytes, and a dump cut anywhere after the raw cache: the offset of the field cut short
    fails(blob + b"\0", len(blob), "1 trailing bytes")
    for at, size in _dsv4_fields(st, dsv4["raw_end"]):
        for cut in {at, at + size // 2, at + size - 1}:
            e = fails(blob[:cut], at, "needs")
            assert e.needed == size and e.left == cut - at
    for cut in (8, 9, 12, 15, 16, 19):  # the dsv4 header itself
        e = fails(blob[:cut], cut - cut % 4, "needs", memory="dsv4")
        assert e.what.startswith("dsv4: ")


def test_dsv4_select_cells_is_refused(dsv4):
    st = state.parse(dsv4["full"])
    # even a mask that keeps every cell: the raw cells are not what the compressed rows index
    for mask in (lambda cells: cells["pos"] >= 8, np.ones(st.stream("swa").cell_count, bool)):
        with pytest.raises(ValueError, match="llama_kv_cache_dsv4 dump.*one row per 4 or 128 positions.*seq_rm"):
            st.select_cells(mask, part="swa")


def test_dsv4_layer_map(dsv4):
    def facts(n=4, **kv):
        return {
            "general.architecture": "deepseek4",
            "deepseek4.block_count": n,
            **{f"deepseek4.{k}": v for k, v in kv.items()},
        }

    m = state.layer_map(facts(**{"attention.compress_ratios": [4, 128, 4, 0]}))
    assert m == {
        "base": [],
        "swa": [0, 1, 2, 3],
        "csa": [0, 2],
        "hca": [1],
        "lid": [0, 2],
        "csa-state": [0, 2],
        "hca-state": [1],
        "lid-state": [0, 2],
    }
    assert state.memory_of(m) == "dsv4"
    assert state.layer_map(facts()) is None  # no ratios: no map
    assert state.layer_map(facts(**{"attention.compress_ratios": [4, 128, 4, 0], "nextn_predict_layers": 1})) is None
    # the composed raw cache is gemma2's (base il 1, swa il 0): a map of this dump
    layers = {**m, "base": [1], "swa": [0]}
    st = state.parse(dsv4["full"], layers=layers)
    assert st.layers == layers and st.layout().layers_known and "record indices" not in st.layout().table()
    assert st.k[1].tobytes() == st.stream("base").k[1].tobytes() and st.record("K", 1, part="hca").il == 1
    part = state.parse(dsv4["partial"], layers=layers)  # a partial dump, told by its mode
    assert part.partial is True and part.layers == {
        k: layers[k] for k in ("swa", "csa-state", "hca-state", "lid-state")
    }
    with pytest.raises(StateFormatError, match="a dump of another model") as e:
        state.parse(dsv4["full"], layers={**layers, "hca": [3], "hca-state": [3]})
    assert e.value.what == "hca: layers"
    # a map of a dsv4 memory, but a dump of another: named
    with pytest.raises(StateFormatError, match="memory 'dsv4'"):
        state.parse(dsv4["c"]["hdr"] + dsv4["c"]["Ck"] + dsv4["c"]["Bk"], layers=layers)


def test_dsv4_fuzz(dsv4):
    rng = np.random.default_rng(11)
    full = dsv4["full"]
    meta = b"".join(full[s.offset : s.offset + s.nbytes] for s in state.parse(full).layout().segments if not s.payload)
    outcomes = {"ok": 0, "error": 0}
    for base in (full, dsv4["partial"], meta):
        st = state.parse(base)
        start = st.part("swa").offset
        heads = np.concatenate(
            [
                np.arange(s.offset, s.offset + s.nbytes)
                for s in st.layout().segments
                if not s.payload and s.offset >= start - 12
            ]
        )
        arr = np.frombuffer(base, np.uint8)
        for i in range(150):
            if i % 3 == 0:
                blob = base[: int(rng.integers(0, len(base)))]
            else:
                mutated = arr.copy()  # headers after the raw cache, or anywhere
                where = rng.choice(heads if i % 3 == 1 else len(base), rng.integers(1, 3))
                mutated[where] ^= (1 << rng.integers(0, 8, len(where))).astype(np.uint8)
                blob = mutated.tobytes()
            try:
                got = state.parse(blob)
            except StateFormatError:
                outcomes["error"] += 1
                continue
            outcomes["ok"] += 1
            assert got.layout().total_bytes == len(blob) and got.to_bytes() == blob
            check_layout(got)
    assert outcomes["error"] > 200 and outcomes["ok"] > 50, outcomes
