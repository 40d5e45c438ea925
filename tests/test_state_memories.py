"""pyllamacpp.state on dumps of synthetic models (pyllamacpp.testing.make_model) made by the real
library: every memory layout llama.cpp writes (iSWA, recurrent, hybrid, hybrid iSWA),
metadata-only dumps (StateFlags.ON_DEVICE), recurrent PLE rows, and the model's layer numbers.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import state_helpers as sh
from state_helpers import (
    N_HEAD_KV,
    N_LAYER,
    N_THREADS,
    PROMPT_TOKENS,
    _synthetic,
    _with_ple,
    check_layout,
)

from pyllamacpp import state
from pyllamacpp.state import DumpKind, StateFormatError

# the module-scoped fixtures these tests share (state_helpers.py); pytest finds a fixture by its
# own name wherever a module holds it
model, runs, pl_model = sh.model, sh.runs, sh.pl_model


def _synthetic_dump(tmp_path, arch, **kw):
    d = _synthetic(tmp_path, arch, **kw)
    return d["one"], d["two"], d["whole"], d["n_head_kv"]


def test_iswa_dump_parses_base_then_swa(tmp_path):
    one, two, whole, n_kv = _synthetic_dump(
        tmp_path, "gemma2", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_swa=4
    )
    st = state.parse(one, n_head_kv=n_kv)
    assert [p.name for p in st.parts] == ["base", "swa"]
    base, swa = st.part("base").streams[0], st.part("swa").streams[0]
    assert base.cell_count == 10 and 0 < swa.cell_count < 10  # the window keeps only recent cells
    assert st.to_bytes() == one.tobytes()
    lay = st.layout()
    assert lay.metadata_bytes + lay.payload_bytes == one.size
    np.testing.assert_array_equal(
        st.part("base").streams[0].records[0].rows[0],
        state.parse(two, n_head_kv=n_kv).part("base").streams[0].records[0].rows[0],
    )
    w = state.parse(whole, n_head_kv=n_kv)
    assert w.kind == state.DumpKind.CONTEXT and [p.name for p in w.parts] == ["base", "swa"]


def test_recurrent_dump_parses(tmp_path):
    one, two, whole, _ = _synthetic_dump(tmp_path, "mamba", n_layer=2, n_embd=32)
    st = state.parse(one)
    assert [p.kind for p in st.parts] == ["recurrent"]
    kinds = {r.kind for r in st.parts[0].streams[0].records}
    assert kinds == {"R", "S"}
    assert st.to_bytes() == one.tobytes()
    lay = st.layout()
    assert lay.metadata_bytes + lay.payload_bytes == one.size
    assert state.parse(whole).kind == state.DumpKind.CONTEXT


# -- metadata-only dumps (StateFlags.ON_DEVICE) ---------------------------------------------------
def _same_headers(meta, full) -> None:
    """A metadata-only dump is the full dump without its rows: same cells, same record headers."""
    assert meta.metadata_only and not full.metadata_only
    assert [p.name for p in meta.parts] == [p.name for p in full.parts]
    for mp, fp in zip(meta.parts, full.parts):
        for ms, fs in zip(mp.streams, fp.streams):
            assert ms.cell_count == fs.cell_count and (ms.v_trans, ms.n_layer) == (fs.v_trans, fs.n_layer)
            assert ms.cells[["pos", "n_seq_id"]].tolist() == fs.cells[["pos", "n_seq_id"]].tolist()
            assert [(r.kind, r.type.id, r.row_size, r.n_embd, r.transposed, r.header_size) for r in ms.records] == [
                (r.kind, r.type.id, r.row_size, r.n_embd, r.transposed, r.header_size) for r in fs.records
            ]
            for mr, fr in zip(ms.records, fs.records):
                assert (
                    meta.buffer[mr.header_offset : mr.data_offset].tobytes()
                    == full.buffer[fr.header_offset : fr.data_offset].tobytes()
                )
    lay = meta.layout()
    assert lay.payload_bytes == 0 and lay.metadata_only and meta.nbytes == full.nbytes - full.layout().payload_bytes
    check_layout(meta)
    assert "metadata only (ON_DEVICE)" in meta.describe() and "metadata only (ON_DEVICE)" in lay.table()


@pytest.mark.parametrize("flash_attn", ["on", "off"])
def test_on_device_dump_is_metadata_only(pl_model, flash_attn):
    import pyllamacpp as pl

    with pl_model.context(n_ctx=256, n_threads=N_THREADS, n_threads_batch=N_THREADS, flash_attn=flash_attn) as ctx:
        ctx.prefill(PROMPT_TOKENS)
        full, dev = ctx.seq_state(0), ctx.seq_state(0, pl.StateFlags.ON_DEVICE)
        # 7 cells x 12 bytes, 60 record headers of 12 bytes: what LLAMA_CPP_FACTS's 828-byte metadata is
        assert len(dev) == 828 == 108 + 60 * 12
        meta = state.parse(dev.data, n_head_kv=N_HEAD_KV)
        _same_headers(meta, state.parse(full.data, n_head_kv=N_HEAD_KV))
        assert meta.to_bytes() == dev.data.tobytes() and meta.stream().v_trans == (flash_attn == "off")
        for get in (
            lambda: meta.k[0],
            lambda: meta.v[29],
            lambda: meta.record("K", 3).rows,
            lambda: meta.address("K", 0, cell=1),
            lambda: meta.record("V", 0).dequantize(),
        ):
            with pytest.raises(state.MetadataOnlyError, match="metadata-only dump .*ON_DEVICE.* 2,688 bytes"):
                get()
        # where the value lives in llama.cpp's tensor needs no rows
        assert meta.tensor_offset("K", 0, cell=3, head=1, element=5, kv_size=256) == 3 * 384 + 69 * 2
        with pytest.raises(ValueError, match="no rows to select"):
            meta.select_cells([0, 1])
        # pinned readings: each refuses the other kind of dump
        with pytest.raises(StateFormatError):
            state.parse(dev.data, metadata_only=False)
        with pytest.raises(StateFormatError):
            state.parse(full.data, metadata_only=True)
        assert state.parse(dev.data, metadata_only=True).metadata_only
        # llama.cpp reads the same bytes back with ON_DEVICE (the rows from its own copy)
        ctx.memory.clear()
        assert ctx.set_seq_state(0, dev, flags=pl.StateFlags.ON_DEVICE) == 828
        assert ctx.memory.seq_pos_max(0) == 6


def test_on_device_dump_with_several_streams(pl_model):
    import pyllamacpp as pl

    with pl_model.context(
        n_ctx=256, n_seq_max=4, kv_unified=False, n_threads=N_THREADS, n_threads_batch=N_THREADS
    ) as ctx:
        b = pl.Batch(64, n_seq_max=4, model=pl_model)
        b.add_sequence(PROMPT_TOKENS, 0)
        b.add_sequence(PROMPT_TOKENS[:3], 2)
        ctx.decode(b)
        dumps = {s: (ctx.seq_state(s), ctx.seq_state(s, pl.StateFlags.ON_DEVICE)) for s in (0, 2)}
        empty = ctx.seq_state(1, pl.StateFlags.ON_DEVICE)
    for s, (full, dev) in dumps.items():
        meta = state.parse(dev.data, n_head_kv=N_HEAD_KV)
        assert meta.part().n_stream == 4 and meta.stream().index == s
        _same_headers(meta, state.parse(full.data, n_head_kv=N_HEAD_KV))
    assert len(dumps[0][1]) == 828 + 3 * 4 and len(dumps[2][1]) == 108 + 3 * 4 - 4 * 12 + 60 * 12
    e = state.parse(empty.data)  # no cells, no records: it reads the same either way
    assert len(empty) == 8 + 4 + 4 * 4 and not e.metadata_only


def test_metadata_only_cli(pl_model, tmp_path, capsys):
    import pyllamacpp as pl
    from pyllamacpp.cli import main

    f = tmp_path / "dev.bin"
    with pl_model.context(n_ctx=256, n_threads=N_THREADS, n_threads_batch=N_THREADS) as ctx:
        ctx.prefill(PROMPT_TOKENS)
        ctx.save_seq_dump(f, 0, flags=pl.StateFlags.ON_DEVICE, sidecar=False)
    assert main(["parse-state", str(f), "--heads", "3", "--cells", "2"]) == 0
    out = capsys.readouterr().out
    assert "metadata only (ON_DEVICE)" in out and "payload 0 B = 828 B" in out and "K: " not in out
    assert main(["parse-state", str(f), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["metadata_only"] and data["payload_bytes"] == 0 and "metadata only (ON_DEVICE)" in data["kind_text"]


def test_synthetic_on_device_dumps(tmp_path):
    for arch, kw in (
        ("gemma2", dict(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_swa=4)),
        ("mamba", dict(n_layer=2, n_embd=32)),
        ("lfm2", dict(n_layer=4, n_embd=64, n_head=4, n_head_kv=2)),
    ):
        d = _synthetic(tmp_path, arch, **kw)
        meta, full = state.parse(d["dev"], model=d["path"]), state.parse(d["one"], model=d["path"])
        _same_headers(meta, full)
        assert meta.to_bytes() == d["dev"].tobytes() and meta.options["memory"] == full.options["memory"]
        assert meta.layers == full.layers is not None


# -- recurrent PLE rows (crafted from a real mamba dump: state_helpers._with_ple) ------------------
def test_recurrent_ple_rows(tmp_path):
    d = _synthetic(tmp_path, "mamba", n_layer=3, n_embd=32)
    st = state.parse(d["one"])
    for ple_layers in ([0, 1, 2], [1], [0, 2]):
        blob = _with_ple(st, ple_layers)
        ple = state.parse(blob, layers={"recurrent": [0, 1, 2]})
        s = ple.stream()
        assert [(r.kind, r.layer) for r in s.records] == [
            x for il in range(3) for x in [("R", il)] + ([("P", il)] if il in ple_layers else [])
        ] + [("S", il) for il in range(3)]
        assert s.p.layers == tuple(ple_layers) and [r.il for r in s.records if r.kind == "P"] == ple_layers
        p = s.p.record(ple_layers[0])
        assert (p.type.name, p.row_size, p.n_embd, p.header_size) == ("f32", 96, 24, 8)
        np.testing.assert_array_equal(s.p[ple_layers[0]], np.arange(24, dtype=np.float32)[None])
        for kind in "RS":
            for il in range(3):
                np.testing.assert_array_equal(getattr(s, kind.lower())[il], getattr(st.stream(), kind.lower())[il])
        assert ple.to_bytes() == blob
        check_layout(ple)
        assert ple.select_cells([0]).to_bytes() == blob
        assert ple.select_cells(np.zeros(1, bool)).stream().p.layers == tuple(ple_layers)
    # metadata-only: the u64 headers alone
    meta = state.parse(_with_ple(state.parse(d["dev"]), [0, 2], metadata_only=True))
    assert meta.metadata_only and [r.kind for r in meta.stream().records] == list("RPRRPSSS")
    # what state_read_data refuses is refused: PLE rows of different sizes, a truncated one
    with pytest.raises(StateFormatError):
        state.parse(_with_ple(st, [0, 1], p_size=lambda il: 96 + 4 * il))
    blob = _with_ple(st, [0])
    for cut in (1, 50, 96):
        with pytest.raises(StateFormatError):
            state.parse(blob[:-cut])
    with pytest.raises(StateFormatError):
        state.parse(_with_ple(st, [0], p_size=lambda il: 95))  # not whole f32 values


# -- a hybrid model (lfm2: attention layers in a KV cache, conv layers in recurrent memory) -------
def _next_logits(ctx, model, blob, flags=0) -> np.ndarray:
    """Load ``blob`` into sequence 0 (cleared first, unless ``flags`` loads a part over what is
    there), decode token 5 at position 10 and return its logits; position 10 is removed again."""
    import pyllamacpp as pl

    if not flags:
        ctx.memory.clear()
    # checked first (per-layer head counts from the GGUF: llama.cpp's metadata API leaves
    # arrays out), then loaded
    assert ctx.set_seq_state(0, np.frombuffer(blob, np.uint8), flags) == len(blob)
    b = pl.Batch(4, model=model)
    b.add_sequence([5], 0, 10)
    ctx.decode(b)
    logits = ctx.logits().copy()
    ctx.memory.seq_rm(0, 10, -1)
    return logits


def _edits_move_the_next_logits(ctx, model, one: bytes, *edits) -> np.ndarray:
    """The dump ``one`` of ``model`` reloads to the same next logits, bit for bit, and each edit
    (a function of a writable parse of it) moves them; returns the unedited logits."""
    base = _next_logits(ctx, model, one)
    np.testing.assert_array_equal(_next_logits(ctx, model, one), base)
    for edit in edits:
        w = state.parse(one, model=model.path, writable=True)
        edit(w)
        # tiny random weights (std 0.02) move logits by ~1e-4; the unedited reload moves them by 0
        assert np.abs(_next_logits(ctx, model, w.to_bytes()) - base).max() > 1e-5
    return base


def test_hybrid_dump(tmp_path):
    import pyllamacpp as pl

    kw = dict(n_layer=4, n_embd=64, n_head=4, n_head_kv=2)
    d = _synthetic(tmp_path, "lfm2", **kw)
    one = d["one"].tobytes()
    st = state.parse(one, model=d["path"])
    assert st.options["memory"] == "hybrid" and [p.name for p in st.parts] == ["kv", "recurrent"]
    assert st.layers == {"kv": [1, 3], "recurrent": [0, 2]}  # head_count_kv [0, 2, 0, 2]
    kv, rec = st.stream("kv"), st.stream("recurrent")
    assert kv.cell_count == 10 and rec.cell_count == 1 and rec.n_layer == 4 and kv.n_layer == 2
    assert [r.il for r in kv.k_records] == [1, 3] and st.k.layers == (1, 3)
    assert st.k[3].shape == (10, 2, 16) and np.shares_memory(st.k[3], st.buffer)
    with pytest.raises(IndexError, match=r"model layers \(il\) \[1, 3\]"):
        st.k[0]  # layer 0 is a convolution layer
    assert st.to_bytes() == one
    check_layout(st)
    # sizes, to the byte: header, KV part, recurrent part (R: (l_cache - 1) x n_embd f32; S: 0 values)
    kv_row = 2 * 16 * 2
    assert st.nbytes == 8 + (4 + 4 + 10 * 12 + 8 + 4 * (12 + 10 * kv_row)) + (
        4 + 8 + 8 + 2 * (12 + 2 * 64 * 4) + 2 * 12
    )
    assert [r.row_size for r in rec.records] == [512, 512, 0, 0]
    two = state.parse(d["two"], model=d["path"])
    assert two.record("K", 1).rows[0].tobytes() == st.record("K", 1).rows[0].tobytes()
    np.testing.assert_array_equal(two.stream("recurrent").r[0], rec.r[0])
    whole = state.parse(d["whole"], model=d["path"])
    assert whole.kind is DumpKind.CONTEXT and whole.options["memory"] == "hybrid"
    # edits load back and change the next logits: one KV head, then the conv state
    with pl.Model(d["path"]) as model, model.context(n_ctx=64, n_threads=1, n_threads_batch=1) as ctx:
        _edits_move_the_next_logits(
            ctx,
            model,
            one,
            lambda s: s.k[1].__setitem__((slice(None), 0), 0),
            lambda s: s.stream("recurrent").r[2].__setitem__(slice(None), 0),
        )
    # fuzz: only StateFormatError
    rng = np.random.default_rng(7)
    arr = np.frombuffer(one, np.uint8)
    meta = np.concatenate([np.arange(s.offset, s.offset + s.nbytes) for s in st.layout().segments if not s.payload])
    errors = 0
    for i in range(600):
        if i % 3 == 0:
            blob = one[: int(rng.integers(0, len(one)))]
        else:
            m = arr.copy()
            m[rng.choice(meta, 2)] ^= (1 << rng.integers(0, 8, 2)).astype(np.uint8)
            blob = m.tobytes()
        try:
            got = state.parse(blob)
        except StateFormatError:
            errors += 1
            continue
        assert got.to_bytes() == blob and got.layout().total_bytes == len(blob)
    assert errors > 300


def test_hybrid_iswa_dump(tmp_path):
    # lfm2 with a sliding window: every attention layer slides (models/lfm2.cpp), so llama.cpp
    # builds llama_memory_hybrid_iswa: an iSWA cache (base: no layers, swa: 1 and 3), then the
    # recurrent state of the conv layers (0 and 2)
    import pyllamacpp as pl

    kw = dict(n_layer=4, n_embd=64, n_head=4, n_head_kv=2, n_swa=4)
    d = _synthetic(tmp_path, "lfm2", **kw)
    one = d["one"].tobytes()
    st = state.parse(one, model=d["path"])
    assert st.options["memory"] == "hybrid-iswa" and [p.name for p in st.parts] == ["base", "swa", "recurrent"]
    assert st.layers == {"base": [], "swa": [1, 3], "recurrent": [0, 2]}
    base, swa, rec = st.stream("base"), st.stream("swa"), st.stream("recurrent")
    assert base.n_layer == 0 and not base.records and swa.n_layer == 2 and rec.n_layer == 4
    assert 0 < swa.cell_count < 10 and rec.cell_count == 1  # the window keeps only recent cells
    assert swa.cells["pos"].max() == 9 and [r.il for r in swa.k_records] == [1, 3]
    assert st.k[3].shape == (swa.cell_count, 2, 16) and np.shares_memory(st.k[3], st.buffer)
    assert st.to_bytes() == one and st.layout().total_bytes == len(one)
    check_layout(st)
    # the same bytes read as plain hybrid fail somewhere: without a hint the parts are found
    assert state.parse(one).options["memory"] == "hybrid-iswa"
    two = state.parse(d["two"], model=d["path"])
    assert two.record("K", 1, part="swa").rows[0].tobytes() == st.record("K", 1, part="swa").rows[0].tobytes()
    whole = state.parse(d["whole"], model=d["path"])
    assert whole.kind is DumpKind.CONTEXT and whole.options["memory"] == "hybrid-iswa"
    meta = state.parse(d["dev"], model=d["path"])
    assert meta.metadata_only and meta.options["memory"] == "hybrid-iswa"
    _same_headers(meta, st)
    with pl.Model(d["path"]) as model, model.context(n_ctx=64, n_threads=1, n_threads_batch=1) as ctx:
        base_logits = _edits_move_the_next_logits(
            ctx,
            model,
            one,
            lambda s: s.k[3].__setitem__((slice(None), 1), 0),
            lambda s: s.stream("recurrent").r[0].__setitem__(slice(None), 0),
        )
        # PARTIAL_ONLY: the swa part and the recurrent state (llama_memory_hybrid_iswa::state_write)
        P = int(pl.StateFlags.PARTIAL_ONLY)
        ctx.memory.clear()
        ctx.set_seq_state(0, one)
        part = ctx.seq_state(0, P)
        p = state.parse(part.data, flags=P, model=d["path"])
        assert p.partial and [x.name for x in p.parts] == ["swa", "recurrent"]
        np.testing.assert_array_equal(p.k[3], st.k[3])
        np.testing.assert_array_equal(p.stream("recurrent").r[2], rec.r[2])
        assert p.to_bytes() == part.data.tobytes() and len(part) < len(one)
        # loaded over the full sequence with the flag: the same next logits
        ctx.memory.clear()
        ctx.set_seq_state(0, one)
        np.testing.assert_array_equal(_next_logits(ctx, model, part.data.tobytes(), P), base_logits)
        # and refused without it, with a reason (checked before llama.cpp sees it)
        with pytest.raises(pl.StateError, match="PARTIAL_ONLY"):
            ctx.set_seq_state(0, part.data.tobytes())


# -- layer numbers ------------------------------------------------------------------------------------
def test_iswa_layers_are_the_models(tmp_path):
    d = _synthetic(tmp_path, "gemma2", n_layer=4, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_swa=4)
    plain = state.parse(d["one"], n_head_kv=2)
    assert plain.layers is None and "record indices" in plain.layout().table()
    with pytest.raises(ValueError, match="no layer map"):
        plain.k
    assert plain.stream("base").k.layers == (0, 1)  # record indices
    st = state.parse(d["one"], model=d["path"])
    assert st.layers == {"base": [1, 3], "swa": [0, 2]}  # pattern 2: il % 2 < 1 is SWA
    assert st.k.layers == (0, 1, 2, 3) and "record indices" not in st.layout().table()
    for il in range(4):
        part = "swa" if il % 2 == 0 else "base"
        rec = st.record("K", il)
        assert rec.part == part and rec.il == il
        np.testing.assert_array_equal(st.k[il], st.stream(part).k[il])
        assert st.address("V", il, cell=0) == st.record("V", il).data_offset
    assert [r.il for r in st.layout().rows] == [1, 3, 1, 3, 0, 2, 0, 2]
    # the sidecar carries the map for a dump parsed without model=
    f = tmp_path / "d.bin"
    f.write_bytes(d["one"].tobytes())
    facts = state.model_facts(d["path"])
    assert facts["layers"] == st.layers
    state.write_sidecar(f, **facts)
    assert state.parse(f).layers == st.layers and state.parse(f).k[2].shape[1:] == (2, 32)
    # a map that does not fit the dump is an error, not a silent renumbering
    with pytest.raises(StateFormatError, match="layer map"):
        state.parse(d["one"], layers={"base": [1, 2, 3], "swa": [0]})
    # the CLI shows il, and --layer takes it
    from pyllamacpp.cli import main

    assert main(["parse-state", str(f), "--layer", "3", "--cells", "1", "--json"]) == 0


def test_layer_map_rules():
    def m(arch, n, **kv):
        return state.layer_map(
            {"general.architecture": arch, f"{arch}.block_count": n, **{f"{arch}.{k}": v for k, v in kv.items()}}
        )

    assert m("llama", 3) == {"kv": [0, 1, 2]}
    assert m("gemma2", 4) == {"base": [1, 3], "swa": [0, 2]}
    assert m("gemma3", 7, **{"attention.sliding_window": 512}) == {"base": [5], "swa": [0, 1, 2, 3, 4, 6]}
    assert m("gemma3", 3) == {"kv": [0, 1, 2]}  # no sliding window: no SWA cache
    assert m(
        "gemma3", 3, **{"attention.sliding_window": 8, "attention.sliding_window_pattern": [True, False, True]}
    ) == {"base": [1], "swa": [0, 2]}
    assert m("mamba", 2) == {"recurrent": [0, 1]}
    assert m("lfm2", 4, **{"attention.head_count_kv": [0, 2, 0, 2]}) == {"kv": [1, 3], "recurrent": [0, 2]}
    assert m("lfm2", 4, **{"attention.head_count_kv": [0, 2, 0, 2], "attention.sliding_window": 8}) == {
        "base": [],
        "swa": [1, 3],
        "recurrent": [0, 2],
    }
    assert m("falcon-h1", 2) == {"kv": [0, 1], "recurrent": [0, 1]}
    assert m("deepseek4", 2) is None and m("llama", 2, nextn_predict_layers=1) is None


def test_default_model_layers_from_model(pl_model, runs):
    st = state.parse(runs("f16-fa")["seq"], model=pl_model)  # a Model: its GGUF gives the map
    assert st.layers == {"kv": list(range(N_LAYER))} and st.n_head_kv == N_HEAD_KV
    assert st.record("K", 7).il == 7 == st.record("K", 7).layer
