"""Composed layouts this llama.cpp writes for archs make_model cannot make: dsa, msa, dsa-iswa,
hybrid-idx. Crafted from real parts of real dumps, as their state_write concatenates them
(state_helpers.composed_parts); a K-only part is a real KV part with its V records dropped
(llama_kv_cache::state_write_data writes no V record for a layer without a V tensor, and nothing
else changes). Then the layer maps of the archs whose rule reads keys llama.cpp defaults, and the
checks a Context makes (context_state.StateMethods) for those memories.
"""

from __future__ import annotations

import numpy as np
import pytest
import state_helpers as sh
from state_helpers import (
    DSV4_MAGIC,
    _dsv4_blocks,
    _metadata_gguf,
    _u32,
    _with_ple,
    check_layout,
)

from pyllamacpp import state
from pyllamacpp.state import StateFormatError

# the module-scoped fixtures these tests share (state_helpers.py); pytest finds a fixture by its
# own name wherever a module holds it
composed_parts = sh.composed_parts


def _check_composed(st, blob, names, *, memory, has_v):
    assert [p.name for p in st.parts] == names and st.options["memory"] == memory
    assert st.options["has_v"] == has_v
    assert st.to_bytes() == blob and st.layout().total_bytes == len(blob)
    check_layout(st)
    for p in st.parts:
        for r in p.streams[0].records:
            assert r.rows is None or not r.nbytes or np.shares_memory(r.rows, st.buffer)


def test_composed_dsa_msa_look_like_iswa(composed_parts):
    c = composed_parts
    dsa = c["hdr"] + c["Ak"] + c["Bk"]  # llama_kv_cache_dsa: kv_mla, kv_lid (MLA: no V)
    msa = c["hdr"] + c["A"] + c["B"]  # llama_kv_cache_msa: kv_base, kv_idx
    # no hint: today's reading, an iSWA cache
    _check_composed(state.parse(dsa), dsa, ["base", "swa"], memory="iswa", has_v=False)
    _check_composed(state.parse(msa), msa, ["base", "swa"], memory="iswa", has_v=True)
    st = state.parse(dsa, memory="dsa")
    _check_composed(st, dsa, ["mla", "lid"], memory="dsa", has_v=False)
    assert st.part("lid").offset == 8 + len(c["Ak"])
    assert {r.kind for r in st.records()} == {"K"}
    assert st.stream("lid").k[0].tobytes() == state.parse(c["hdr"] + c["Bk"]).k[0].tobytes()
    st = state.parse(msa, memory="msa")
    _check_composed(st, msa, ["base", "idx"], memory="msa", has_v=True)
    # the flag changes nothing in what dsa and msa write: partial reads the same
    assert [p.name for p in state.parse(msa, memory="msa", partial=True).parts] == ["base", "idx"]
    assert state.written_parts("dsa", True) == state.written_parts("dsa", False) == (("kv", "mla"), ("kv", "lid"))
    # select_cells keeps the layout and its names
    small = st.select_cells(lambda cells: cells["pos"] >= 8)
    assert small.options["memory"] == "msa" and [p.name for p in small.parts] == ["base", "idx"]
    assert small.stream("idx").cells["pos"].tolist() == [8, 9]
    assert small.stream("idx").k[0].tobytes() == st.stream("idx").k[0][-2:].tobytes()
    # a dsa dump is not an msa dump with V
    with pytest.raises(StateFormatError):
        state.parse(dsa, memory="msa", has_v=True)


def test_composed_dsa_iswa(composed_parts, tmp_path):
    c = composed_parts
    full = c["hdr"] + c["Ak"] + c["Ck"] + c["Bk"]  # llama_kv_cache_dsa_iswa: mla, lid, then swa
    _check_composed(state.parse(full), full, ["mla", "lid", "swa"], memory="dsa-iswa", has_v=False)
    part = c["hdr"] + c["Bk"]  # PARTIAL_ONLY: kv_swa only
    st = state.parse(part, memory="dsa-iswa")
    _check_composed(st, part, ["swa"], memory="dsa-iswa", has_v=False)
    assert st.partial is True and "partial part" not in st.describe()
    assert state.parse(part, flags=state.PARTIAL_ONLY, memory="dsa-iswa").parts[0].name == "swa"
    assert state.parse(full, memory="dsa-iswa").partial is False
    assert state.written_parts("dsa-iswa", True) == (("kv", "swa"),)
    # a sidecar's "memory" names the parts of a dump with no layer map (dsa: two KV caches)
    f = tmp_path / "dsa.bin"
    f.write_bytes(c["hdr"] + c["Ak"] + c["Bk"])
    state.write_sidecar(f, memory="dsa")
    assert [p.name for p in state.parse(f).parts] == ["mla", "lid"] and state.parse(f).layers is None


def test_composed_hybrid_idx(composed_parts):
    c = composed_parts
    blob = c["lfm2"] + c["Ak"]  # llama_memory_hybrid_idx: the hybrid state, then mem_idx (no V)
    for st in (state.parse(blob), state.parse(blob, memory="hybrid-idx")):
        _check_composed(st, blob, ["kv", "recurrent", "idx"], memory="hybrid-idx", has_v=True)
        rec = st.stream("recurrent")
        assert [r.kind for r in rec.records] == ["R", "R", "S", "S"] and rec.n_layer == 4
        assert st.part("idx").offset == len(c["lfm2"]) == st.part("recurrent").end
        assert [r.kind for r in st.part("idx").streams[0].records] == ["K", "K"]
    hybrid = state.parse(c["lfm2"])
    np.testing.assert_array_equal(st.stream("recurrent").r[1], hybrid.stream("recurrent").r[1])
    with pytest.raises(StateFormatError, match="recurrent"):  # the indexer's bytes are no R/S records
        state.parse(blob, memory="hybrid")
    with pytest.raises(StateFormatError):
        state.parse(c["lfm2"], memory="hybrid-idx", partial=False)  # no indexer part
    # the indexer part with V: not what mem_idx writes
    with pytest.raises(StateFormatError):
        state.parse(c["lfm2"] + c["A"], memory="hybrid-idx")
    # PARTIAL_ONLY: the recurrent part only (llama_memory_hybrid::state_write skips mem_attn,
    # llama_memory_hybrid_idx::state_write mem_idx)
    part = c["hdr"] + c["rec"]
    st = state.parse(part, memory="hybrid-idx")
    assert [p.name for p in st.parts] == ["recurrent"] and st.partial is True and st.to_bytes() == part
    assert state.written_parts("hybrid-idx", True) == (("recurrent", "recurrent"),)
    # select_cells on the indexer part
    st = state.parse(blob)
    small = st.select_cells([0, 5], part="idx")
    assert [p.name for p in small.parts] == ["kv", "recurrent", "idx"]
    assert small.stream("idx").k[1].tobytes() == st.stream("idx").k[1][[0, 5]].tobytes()
    assert small.stream("kv").cell_count == 10


def test_composed_hybrid_idx_with_ple(composed_parts, tmp_path):
    # qwen4exp's memory at this pin: llama_memory_hybrid_idx, its recurrent part with PLE conv rows
    # (llama_memory_recurrent::state_write_data: u64 p_size_row and the rows right after the R
    # record of a layer with p_l[il], no type field), then the K-only indexer cache. The recurrent
    # part's end is not written: it is where the idx part then reads every byte.
    c = composed_parts
    lfm2 = state.parse(c["lfm2"])  # kv il 1, 3; recurrent il 0, 2 (R rows 512 bytes, S rows 0)
    rec = lfm2.stream("recurrent")
    idx_only = state.parse(c["hdr"] + c["Ak"])
    # qwen4exp's rule gives this dump's layers: full_attention_interval 2 over 4 layers
    q = _metadata_gguf(tmp_path / "qwen4exp.gguf", "qwen4exp", block_count=4, full_attention_interval=2)
    layers = {"kv": [1, 3], "recurrent": [0, 2], "idx": [1, 3]}
    assert state.model_facts(q)["layers"] == layers
    for ple_layers in ([0], [1], [0, 1]):
        hybrid = _with_ple(lfm2, ple_layers, part="recurrent")
        added = len(ple_layers) * (8 + 96)  # one cell: u64 row size, 24 f32 values
        assert len(hybrid) == len(c["lfm2"]) + added
        blob = hybrid + c["Ak"]
        for st in (state.parse(blob), state.parse(blob, memory="hybrid-idx"), state.parse(blob, model=q)):
            _check_composed(st, blob, ["kv", "recurrent", "idx"], memory="hybrid-idx", has_v=True)
            # the parts tile the dump: kv as in the hybrid dump, the recurrent part longer by its
            # P records, the indexer right after it
            assert st.header.nbytes + sum(p.end - p.offset for p in st.parts) == len(blob)
            assert st.part("kv").end == st.part("recurrent").offset == lfm2.part("recurrent").offset
            assert st.part("recurrent").end == st.part("idx").offset == len(c["lfm2"]) + added
            r = st.stream("recurrent")
            assert [(x.kind, x.layer) for x in r.records] == [
                x for i in range(2) for x in [("R", i)] + ([("P", i)] if i in ple_layers else [])
            ] + [("S", 0), ("S", 1)]
            for prev, x in zip(r.records, r.records[1:]):
                if x.kind == "P":  # right after its layer's R rows, an 8-byte header, f32 rows
                    assert prev.kind == "R" and prev.layer == x.layer and x.il == prev.il
                    assert x.header_offset == prev.data_offset + prev.nbytes and x.data_offset == x.header_offset + 8
                    assert (x.type.name, x.row_size, x.n_embd, x.n_cells) == ("f32", 96, 24, 1)
                    np.testing.assert_array_equal(x.values, np.arange(24, dtype=np.float32)[None])
            # R and S rows are the hybrid dump's, the indexer's K rows the K-only part's
            for kind in "RS":
                got = [x for x in r.records if x.kind == kind]
                want = [x for x in rec.records if x.kind == kind]
                assert [x.rows.tobytes() for x in got] == [x.rows.tobytes() for x in want]
            assert [x.rows.tobytes() for x in st.stream("idx").k_records] == [
                x.rows.tobytes() for x in idx_only.stream().k_records
            ]
        assert st.layers == layers and st.stream("recurrent").p.layers == tuple([0, 2][i] for i in ple_layers)
        assert st.record("K", 3, part="idx").il == 3
        # the indexer's cells can be selected; the recurrent part, PLE rows included, stays as it was
        small = st.select_cells([0, 5], part="idx")
        assert small.stream("recurrent").p.layers == st.stream("recurrent").p.layers
        assert small.to_bytes()[: st.part("idx").offset] == blob[: st.part("idx").offset]
        # truncated: no reading accounts for every byte
        for cut in (1, len(c["Ak"]), len(c["Ak"]) + 50):
            with pytest.raises(StateFormatError):
                state.parse(blob[:-cut], memory="hybrid-idx")
    # PARTIAL_ONLY: the recurrent part alone, PLE rows and all
    part = c["hdr"] + hybrid[lfm2.part("recurrent").offset :]
    st = state.parse(part, model=q)
    assert [p.name for p in st.parts] == ["recurrent"] and st.partial is True and st.to_bytes() == part
    assert [x.kind for x in st.stream().records] == ["R", "P", "R", "P", "S", "S"]
    assert st.layers == {"recurrent": [0, 2]} and st.stream().p.layers == (0, 2)


def test_composed_layouts_fuzz(composed_parts):
    c = composed_parts
    rng = np.random.default_rng(7)
    bases = [
        (c["lfm2"] + c["Ak"], None),
        (c["hdr"] + c["Ak"] + c["Ck"] + c["Bk"], None),
        (c["hdr"] + c["Ak"] + c["Bk"], "dsa"),
        (c["lfm2"] + c["Ak"], "hybrid-idx"),
    ]
    outcomes = {"ok": 0, "error": 0}
    for base, memory in bases:
        meta = np.concatenate(
            [
                np.arange(s.offset, s.offset + s.nbytes)
                for s in state.parse(base, memory=memory).layout().segments
                if not s.payload
            ]
        )
        arr = np.frombuffer(base, np.uint8)
        for i in range(100):
            if i % 3 == 0:
                blob = base[: int(rng.integers(0, len(base)))]
            else:
                mutated = arr.copy()
                where = rng.choice(meta, rng.integers(1, 3))
                mutated[where] ^= (1 << rng.integers(0, 8, len(where))).astype(np.uint8)
                blob = mutated.tobytes()
            try:
                st = state.parse(blob, memory=memory)
            except StateFormatError:
                outcomes["error"] += 1
                continue
            outcomes["ok"] += 1
            assert st.layout().total_bytes == len(blob) and st.to_bytes() == blob
    assert outcomes["error"] > 100 and outcomes["ok"] > 10, outcomes


def test_composed_memory_rules():
    def facts(arch, n=4, **kv):
        return {"general.architecture": arch, f"{arch}.block_count": n, **{f"{arch}.{k}": v for k, v in kv.items()}}

    assert state.layer_map(facts("deepseek32")) == {"mla": [0, 1, 2, 3], "lid": [0, 1, 2, 3]}
    assert state.memory_of(state.layer_map(facts("deepseek32"))) == "dsa"
    assert state.layer_map(facts("minimax-m3", leading_dense_block_count=1)) == {"base": [0, 1, 2, 3], "idx": [1, 2, 3]}
    assert state.memory_of({"base": [0], "idx": [0]}) == "msa"
    from pyllamacpp.state._layers import memory_for

    assert memory_for(facts("glm5-next")) == memory_for(facts("qwen4exp")) == "hybrid-idx"
    assert memory_for(facts("dots3note")) == "dsa-iswa" and memory_for(facts("glm-dsa")) == "dsa"
    assert memory_for(facts("hy_v4", **{"attention.indexer.top_k": 64})) == "dsa"
    assert memory_for(facts("hy_v4")) is None and memory_for(facts("deepseek4")) == "dsv4"
    assert memory_for(facts("glm-dsa", nextn_predict_layers=1)) is None
    # qwen4exp's MTP context builds the same llama_memory_hybrid_idx (create_memory's default branch)
    assert memory_for(facts("qwen4exp", nextn_predict_layers=1)) == "hybrid-idx"
    # a key these rules default when absent, but that the caller did not read: no map (below)
    assert state.layer_map(facts("glm5-next")) is None


# -- layer maps of the archs whose rule reads keys llama.cpp defaults (_layers.KEYED_RULES): every
# key is passed, None where the GGUF lacks it, as model_facts reads a GGUF
def _arch_facts(arch, n, **kv):
    from pyllamacpp.state._layers import KEYED_RULES

    keys = ("nextn_predict_layers",) + KEYED_RULES[arch]
    return {
        "general.architecture": arch,
        f"{arch}.block_count": n,
        **{f"{arch}.{k}": None for k in keys},
        **{f"{arch}.{k}": v for k, v in kv.items()},
    }


def _arch_map(arch, n, **kv):
    return state.layer_map(_arch_facts(arch, n, **kv))


def test_glm_dsa_layer_map():
    # llama_kv_cache_dsa: kv_mla every layer, kv_lid is_indexer_full(il) (create_memory, LLM_ARCH_GLM_DSA)
    m = _arch_map("glm-dsa", 4, context_length=202752)  # GLM 5 / 5.1 (< 1M context): every layer full
    assert m == {"mla": [0, 1, 2, 3], "lid": [0, 1, 2, 3]} and state.memory_of(m) == "dsa"
    # GLM 5.2 (1M context) without indexer.types: GLM_5_2_DEFAULT_INDEXER_TYPES, 0 past its 78 entries
    m = _arch_map("glm-dsa", 80, context_length=1048576)
    assert m["mla"] == list(range(80)) and m["lid"] == [0, 1] + list(range(2, 78, 4))
    assert _arch_map("glm-dsa", 4, **{"context_length": 1048576, "attention.indexer.types": [1, 0, 1, 0]}) == {
        "mla": [0, 1, 2, 3],
        "lid": [0, 2],
    }  # the key wins over the default
    assert _arch_map("glm-dsa", 3, **{"context_length": 4096, "attention.indexer.types": 0})["lid"] == []
    assert _arch_map("glm-dsa", 4, **{"context_length": 4096, "attention.indexer.types": [1, 0, 1]}) is None
    assert _arch_map("glm-dsa", 4) is None  # no context_length: no model loads
    # nextn layers: a main context's cache leaves them out, an MTP context's holds only them
    assert _arch_map("glm-dsa", 5, context_length=4096, nextn_predict_layers=1) is None
    # a caller that did not read indexer.types (context_state reads no array): no map
    assert (
        state.layer_map(
            {"general.architecture": "glm-dsa", "glm-dsa.block_count": 4, "glm-dsa.context_length": 1048576}
        )
        is None
    )


def test_hy_v4_layer_map():
    # indexer_top_k 0 (absent): a plain llama_kv_cache over every layer, MTP ones too (filter nullptr)
    assert _arch_map("hy_v4", 4) == {"kv": [0, 1, 2, 3]} and state.memory_of(_arch_map("hy_v4", 4)) == "kv"
    assert _arch_map("hy_v4", 5, nextn_predict_layers=1) == {"kv": [0, 1, 2, 3, 4]}
    m = _arch_map("hy_v4", 4, **{"attention.indexer.top_k": 64, "attention.indexer.types": [1, 0, 0, 1]})
    assert m == {"mla": [0, 1, 2, 3], "lid": [0, 3]} and state.memory_of(m) == "dsa"
    assert _arch_map("hy_v4", 3, **{"attention.indexer.top_k": 64, "attention.indexer.types": 1})["lid"] == [0, 1, 2]
    # load_arch_hparams throws unless layer 0 owns an indexer (absent types: none does)
    assert _arch_map("hy_v4", 4, **{"attention.indexer.top_k": 64, "attention.indexer.types": [0, 1, 1, 1]}) is None
    assert _arch_map("hy_v4", 4, **{"attention.indexer.top_k": 64}) is None
    # with nextn layers filter_lid asks is_indexer_full(il >= n_layer()): GGML_ABORT, no memory
    assert (
        _arch_map(
            "hy_v4", 5, **{"attention.indexer.top_k": 64, "attention.indexer.types": 1, "nextn_predict_layers": 1}
        )
        is None
    )


def test_dots3note_layer_map():
    # llama_kv_cache_dsa_iswa: mla the non-SWA layers, lid is_indexer_full(il), swa the SWA layers
    m = _arch_map(
        "dots3note",
        6,
        **{
            "attention.sliding_window_pattern": [False, True, True, False, True, True],
            "attention.indexer.types": [1, 0, 0, 1, 0, 0],
        },
    )
    assert m == {"mla": [0, 3], "lid": [0, 3], "swa": [1, 2, 4, 5]} and state.memory_of(m) == "dsa-iswa"
    # get_arr takes shorter arrays (later layers stay 0: not SWA, no indexer), and filter_lid is not
    # chained with !is_swa: an indexer flag on a SWA layer puts it in lid as well as in swa
    m = _arch_map(
        "dots3note", 6, **{"attention.sliding_window_pattern": [True, True, False], "attention.indexer.types": [0, 1]}
    )
    assert m == {"mla": [2, 3, 4, 5], "lid": [1], "swa": [0, 1]}
    # both are required arrays: a scalar or an absent key loads no model
    assert (
        _arch_map("dots3note", 2, **{"attention.sliding_window_pattern": 2, "attention.indexer.types": [1, 0]}) is None
    )
    assert _arch_map("dots3note", 2, **{"attention.sliding_window_pattern": [False, True]}) is None
    assert (
        _arch_map(
            "dots3note",
            3,
            **{
                "attention.sliding_window_pattern": [False, True],
                "attention.indexer.types": [1, 0],
                "nextn_predict_layers": 1,
            },
        )
        is None
    )


def test_glm5_next_layer_map():
    # llama_memory_hybrid_idx: KDA layers (head_count_kv 0) recurrent, the others in kv; idx those
    # of them with is_indexer_full (every layer when indexer.types is absent)
    m = _arch_map("glm5-next", 6, **{"attention.head_count_kv": [0, 0, 4, 0, 0, 4]})
    assert m == {"kv": [2, 5], "recurrent": [0, 1, 3, 4], "idx": [2, 5]} and state.memory_of(m) == "hybrid-idx"
    m = _arch_map("glm5-next", 4, **{"attention.head_count_kv": [4, 0, 0, 4], "attention.indexer.types": [0, 1, 1, 1]})
    assert m == {"kv": [0, 3], "recurrent": [1, 2], "idx": [3]}  # starts with attention; layer 0 shares
    assert _arch_map("glm5-next", 2, **{"attention.head_count_kv": 4}) == {"kv": [0, 1], "recurrent": [], "idx": [0, 1]}
    assert (
        _arch_map("glm5-next", 4, **{"attention.head_count_kv": [4, 0, 0, 4], "attention.indexer.types": [1, 1, 1]})
        is None
    )
    assert _arch_map("glm5-next", 4) is None  # no head counts: which layers are KDA is unknown
    assert _arch_map("glm5-next", 5, **{"attention.head_count_kv": [4, 0, 0, 4, 4], "nextn_predict_layers": 1}) is None


def test_qwen4exp_layer_map():
    # llama_memory_hybrid_idx: linear attention except every full_attention_interval-th layer
    # (default 4); idx holds the attention layers
    m = _arch_map("qwen4exp", 8)
    assert m == {"kv": [3, 7], "recurrent": [0, 1, 2, 4, 5, 6], "idx": [3, 7]} and state.memory_of(m) == "hybrid-idx"
    assert _arch_map("qwen4exp", 4, full_attention_interval=2) == {"kv": [1, 3], "recurrent": [0, 2], "idx": [1, 3]}
    # an MTP layer is in no part (filters il < n_layer()), and either context type builds the same memory
    assert _arch_map("qwen4exp", 9, nextn_predict_layers=1) == m
    # attention.recurrent_layers wins over the interval; here the pattern starts with attention,
    # and the MTP layer's 0 does not make it an attention layer of the trunk
    assert _arch_map(
        "qwen4exp",
        5,
        full_attention_interval=2,
        nextn_predict_layers=1,
        **{"attention.recurrent_layers": [0, 1, 1, 0, 0]},
    ) == {"kv": [0, 3], "recurrent": [1, 2], "idx": [0, 3]}
    assert _arch_map("qwen4exp", 4, **{"attention.recurrent_layers": [0, 1, 1]}) is None  # not n_layer_all entries
    assert _arch_map("qwen4exp", 4, full_attention_interval=0) is None  # load_arch_hparams refuses 0
    # not read by the caller: the default interval may not be the GGUF's
    assert state.layer_map({"general.architecture": "qwen4exp", "qwen4exp.block_count": 8}) is None


def test_keyed_layer_maps_from_a_gguf(tmp_path):
    # model_facts reads every key these rules need (arrays too), absent ones as None
    q = _metadata_gguf(tmp_path / "q.gguf", "qwen4exp", block_count=4, full_attention_interval=2)
    assert state.model_facts(q)["layers"] == {"kv": [1, 3], "recurrent": [0, 2], "idx": [1, 3]}
    d = _metadata_gguf(
        tmp_path / "d.gguf",
        "dots3note",
        block_count=4,
        **{
            "attention.sliding_window_pattern": [False, True, True, False],
            "attention.indexer.types": [True, False, False, True],
        },
    )
    assert state.model_facts(d)["layers"] == {"mla": [0, 3], "lid": [0, 3], "swa": [1, 2]}
    g = _metadata_gguf(tmp_path / "g.gguf", "glm-dsa", block_count=4, context_length=1048576)
    assert state.model_facts(g)["layers"] == {"mla": [0, 1, 2, 3], "lid": [0, 1, 2]}
    # nextn layers: no map, and the memory only where it does not depend on the context type
    g = _metadata_gguf(tmp_path / "g1.gguf", "glm-dsa", block_count=5, context_length=4096, nextn_predict_layers=1)
    facts = state.model_facts(g)
    assert facts["layers"] is None and "memory" not in facts

    # what a Context asks for its own model (context_state._model_memory): scalars through
    # llama.cpp's metadata (llama_model_meta_val_str), arrays from the GGUF; here an object with
    # the Model attributes it reads, as no such model can be loaded
    from types import SimpleNamespace

    from pyllamacpp.context_state import _model_memory

    scalars = {"qwen4exp.block_count": "4", "qwen4exp.full_attention_interval": "2"}
    fake = SimpleNamespace(arch="qwen4exp", path=str(q), meta=scalars.get, kv_head_counts=lambda: [2, 2, 2, 2])
    assert _model_memory(fake) == ("hybrid-idx", {"kv": [1, 3], "recurrent": [0, 2], "idx": [1, 3]})
    fake = SimpleNamespace(
        arch="dots3note", path=str(d), meta={"dots3note.block_count": "4"}.get, kv_head_counts=lambda: [2, 2, 2, 2]
    )
    assert _model_memory(fake) == ("dsa-iswa", {"mla": [0, 3], "lid": [0, 3], "swa": [1, 2]})


def _fake_context(model, memory_layers, params, *, n_seq_max=1, plain_kv=False):
    """What check_state / _partial_differs read of a Context, for archs no model of which can be
    loaded here; ``model`` has what they read of a Model."""
    from types import SimpleNamespace

    return SimpleNamespace(
        _memory_layers=lambda: memory_layers,
        model=model,
        params=params,
        n_seq_max=n_seq_max,
        n_ctx_seq=256,
        flash_attn=True,
        _plain_kv=plain_kv,
    )


def test_context_checks_of_composed_memories(tmp_path, composed_parts):
    """check_state and _partial_differs for the memories of archs make_model cannot make."""
    from types import SimpleNamespace

    import pyllamacpp as pl
    from pyllamacpp.context_state import StateMethods, _model_memory
    from pyllamacpp.testing import make_model

    # PARTIAL_ONLY changes what dsa-iswa, hybrid-idx and dsv4 write (and so which device chunks an
    # ON_DEVICE load takes); dsa and msa write all of themselves either way
    for arch, meta, heads, want in (
        ("qwen4exp", {"qwen4exp.block_count": "4", "qwen4exp.full_attention_interval": "2"}, [2] * 4, True),
        ("glm5-next", {"glm5-next.block_count": "4"}, [2, 0, 2, 0], True),
        ("glm-dsa", {"glm-dsa.block_count": "2", "glm-dsa.context_length": "4096"}, [2, 2], False),
    ):
        fake = SimpleNamespace(arch=arch, path=None, meta=meta.get, kv_head_counts=lambda h=heads: h)
        mem = _model_memory(fake)
        assert StateMethods._partial_differs(_fake_context(fake, mem, None)) is want, arch
    # a glm-dsa context checks a dsa dump whose indexer rows (lid: one head of 16 values) are
    # not key_length x head_count_kv wide, as its MLA rows need not be either
    dumps = {}
    for n_kv in (2, 1):
        path = make_model(
            tmp_path / f"l{n_kv}.gguf", "llama", n_layer=2, n_embd=64, n_head=4, n_head_kv=n_kv, n_vocab=128
        )
        with pl.Model(path) as m, m.context(n_ctx=256, flash_attn="on", n_threads=1, n_threads_batch=1) as c:
            c.prefill(np.arange(1, 8))
            dumps[n_kv], params = c.seq_state(0).data.tobytes(), c.params

    def k_part(blob):
        part = state.parse(blob).part("kv")
        return blob[part.offset : next(r for r in part.streams[0].records if r.kind == "V").header_offset]

    dsa = dumps[2][:8] + k_part(dumps[2]) + k_part(dumps[1])
    meta = {
        "glm-dsa.block_count": "2",
        "glm-dsa.context_length": "4096",
        "glm-dsa.attention.indexer.types": "1",
        "glm-dsa.attention.key_length": "16",
        "glm-dsa.attention.value_length": "16",
    }
    with pl.Model(tmp_path / "l2.gguf") as m2:
        glm = SimpleNamespace(
            arch="glm-dsa",
            path=None,
            meta=meta.get,
            kv_head_counts=lambda: [2, 2],
            ptr=m2.ptr,
            kv_head_sizes=lambda: (16, 16),
            n_layer=2,
        )
        mem = _model_memory(glm)
        assert mem == ("dsa", {"mla": [0, 1], "lid": [0, 1]})
        StateMethods.check_state(_fake_context(glm, mem, params), dsa)  # no width complaint
        # the same check still refuses what does not fit: a K type other than the context's
        bad = bytearray(dsa)
        bad[state.parse(dsa, memory="dsa").record("K", 0, part="lid").header_offset] = 0  # F32
        with pytest.raises(pl.StateError, match=r"K\[0\] is f32"):
            StateMethods.check_state(_fake_context(glm, mem, params), bytes(bad))
    # a deepseek4 context expects n_seq_max streams even with kv_unified=True: llama_kv_cache_dsv4
    # builds its caches non-unified (unified_raw)
    c = composed_parts
    two = lambda part: _u32(2) + part[4:] + _u32(0)  # noqa: E731  (a second, empty stream)
    blocks, _ = _dsv4_blocks(2)
    seq = c["hdr"] + _u32(DSV4_MAGIC, 1, 0) + two(c["Ck"]) + two(c["Bk"]) + blocks
    ds = SimpleNamespace(
        arch="deepseek4",
        path=None,
        meta={"deepseek4.block_count": "2"}.get,
        kv_head_counts=lambda: [2, 2],
        ptr=None,
        kv_head_sizes=lambda: (32, 32),
        n_layer=2,
    )
    unified = SimpleNamespace(**{**vars(params), "kv_unified": True}) if hasattr(params, "__dict__") else params
    with pl.Model(tmp_path / "l2.gguf") as m2:
        ds.ptr = m2.ptr
        ctx2 = _fake_context(ds, (None, None), unified, n_seq_max=2)
        try:
            StateMethods.check_state(ctx2, seq)
        except pl.StateError as e:  # whatever else it finds, not the stream count
            assert "stream(s)" not in str(e), e
        ctx1 = _fake_context(ds, (None, None), unified, n_seq_max=1)
        with pytest.raises(pl.StateError, match=r"2 KV stream\(s\), this context has 1"):
            StateMethods.check_state(ctx1, seq)
