"""StateFlags.PARTIAL_ONLY: a dump of only the memory's partial part (an iSWA cache's swa part, a
hybrid memory's recurrent part), how pyllamacpp.state reads it, and how a Context checks and
loads it back.
"""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest
import state_helpers as sh
from state_helpers import (
    N_THREADS,
    PROMPT_TOKENS,
    check_layout,
)

from pyllamacpp import lib, state
from pyllamacpp.state import StateFormatError

# the module-scoped fixtures these tests share (state_helpers.py); pytest finds a fixture by its
# own name wherever a module holds it
pl_model = sh.pl_model


# model, keywords, its memory, its layer map, and the part a PARTIAL_ONLY dump holds
PARTIAL_CASES = {
    "gemma2": (
        dict(n_layer=4, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_swa=4),
        "iswa",
        {"base": [1, 3], "swa": [0, 2]},
        "swa",
    ),
    # uneven parts (il % 3 < 2 is SWA): a layer count taken from the wrong part shows
    "gemma3": (
        dict(n_layer=4, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_swa=4, swa_pattern=3),
        "iswa",
        {"base": [2], "swa": [0, 1, 3]},
        "swa",
    ),
    "lfm2": (
        dict(n_layer=4, n_embd=64, n_head=4, n_head_kv=2),
        "hybrid",
        {"kv": [1, 3], "recurrent": [0, 2]},
        "recurrent",
    ),
}


@contextlib.contextmanager
def _partial_context(tmp_path, arch):
    """A synthetic model's context holding tokens 1..10 in sequence 0, with its full and its
    PARTIAL_ONLY dump (SeqState), and helpers to decode more."""
    import pyllamacpp as pl
    from pyllamacpp.testing import make_model

    kw = PARTIAL_CASES[arch][0]
    path = make_model(tmp_path / f"{arch}.gguf", arch, n_vocab=128, seed=1, **kw)
    with pl.Model(path) as model, model.context(n_ctx=64, n_threads=1, n_threads_batch=1) as ctx:

        def decode_more(tokens, pos0):
            b = pl.Batch(32, model=model)
            b.add_sequence(np.asarray(tokens), 0, pos0, logits="last")
            ctx.decode(b)
            return ctx.logits().copy()

        decode_more(np.arange(1, 11), 0)
        yield path, ctx, ctx.seq_state(0), ctx.seq_state(0, pl.StateFlags.PARTIAL_ONLY), decode_more


def test_partial_flags_match_llama_h():
    import pyllamacpp as pl

    assert state.PARTIAL_ONLY == lib.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY == lib.LLAMA_STATE_SEQ_FLAGS_SWA_ONLY
    assert state.ON_DEVICE == lib.LLAMA_STATE_SEQ_FLAGS_ON_DEVICE == pl.StateFlags.ON_DEVICE
    # what each memory's state_write writes with the flag (llama-kv-cache-iswa.cpp,
    # llama-memory-hybrid.cpp, llama-memory-hybrid-iswa.cpp; plain and recurrent ignore it)
    assert state.written_parts("iswa", True) == (("kv", "swa"),)
    assert state.written_parts("hybrid", True) == (("recurrent", "recurrent"),)
    assert state.written_parts("hybrid-iswa", True) == (("kv", "swa"), ("recurrent", "recurrent"))
    assert state.written_parts("kv", True) == state.written_parts("kv", False) == (("kv", "kv"),)
    assert state.written_parts("recurrent", True) == state.written_parts("recurrent", False)
    assert state.memory_of({"base": [1], "swa": [0]}) == "iswa" and state.memory_of(None) is None


@pytest.mark.parametrize("arch", list(PARTIAL_CASES))
def test_partial_dump_is_the_partial_part(tmp_path, arch, capsys):
    import pyllamacpp as pl
    from pyllamacpp.cli import main

    _, memory, layers, name = PARTIAL_CASES[arch]
    with _partial_context(tmp_path, arch) as (path, ctx, full, part, _):
        ctx.save_seq_dump(tmp_path / "p.bin", 0, flags=pl.StateFlags.PARTIAL_ONLY, tokens=np.arange(1, 11))
        ctx.save_seq_dump(tmp_path / "f.bin", 0)
    f = state.parse(full.data, model=path)
    assert f.options["memory"] == memory and f.partial is False and f.layers == layers
    st = state.parse(part.data, model=path)  # the layer map says which memory; the reading says partial
    assert st.options["memory"] == memory and st.partial is True
    assert [p.name for p in st.parts] == [name] and st.layers == {name: layers[name]}
    # sizes: the io header, then the full dump's part byte for byte
    fp = f.part(name)
    assert st.nbytes == 8 + fp.end - fp.offset and part.data[8:].tobytes() == full.data[fp.offset : fp.end].tobytes()
    check_layout(st)
    assert st.to_bytes() == part.data.tobytes()
    # records carry the model's layers, and hold what the full dump holds for them
    kinds = ("K", "V") if name == "swa" else ("R", "S")
    for kind in kinds:
        assert [r.il for r in st.stream().records if r.kind == kind] == layers[name]
        for il in layers[name]:
            assert st.record(kind, il).rows.tobytes() == f.record(kind, il).rows.tobytes()
        other = next(il for il in range(len(sum(layers.values(), []))) if il not in layers[name])
        with pytest.raises(IndexError, match=r"model layers \(il\)"):
            st.record(kind, other)
    if name == "swa":
        assert st.k[layers["swa"][-1]].shape == (st.stream().cell_count, 2, 32)
    text = st.describe()
    assert "partial (PARTIAL_ONLY): only the" in text and "partial (PARTIAL_ONLY)" in repr(st)
    # flags= or partial= say it without a layer map: an iSWA cache's swa part then reads as a
    # plain cache would write it
    bare = state.parse(part.data, flags=pl.StateFlags.PARTIAL_ONLY)
    assert bare.partial is True and [p.name for p in bare.parts] == ["kv" if name == "swa" else "recurrent"]
    assert "pass model= to tell" in bare.describe() and bare.layers is None
    assert state.parse(part.data, partial=True, model=path).layers == st.layers
    assert state.parse(part.data).partial is None  # nothing says: read as some full layout
    with pytest.raises(StateFormatError):
        state.parse(part.data, model=path, partial=False)
    with pytest.raises(StateFormatError):
        state.parse(full.data, model=path, partial=True)
    with pytest.raises(ValueError, match="contradicts"):
        state.parse(part.data, partial=False, flags=pl.StateFlags.PARTIAL_ONLY)
    # the sidecar carries the flags (and the map): parse needs nothing else
    assert state.read_sidecar(tmp_path / "p.bin")["flags"] == 1 and state.read_sidecar(tmp_path / "f.bin")["flags"] == 0
    side = state.parse(tmp_path / "p.bin")
    assert side.partial is True and side.layers == st.layers and side.to_bytes() == part.data.tobytes()
    assert state.parse(tmp_path / "f.bin").partial is False
    # a smaller dump of it is still partial
    keep = np.zeros(st.stream().cell_count, bool)
    keep[-1] = True
    small = st.select_cells(keep)
    assert small.partial is True and small.layers == st.layers and small.stream().cell_count == 1
    # the CLI says so
    assert main(["parse-state", str(tmp_path / "p.bin"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["partial"] is True and data["memory"] == memory and "partial (PARTIAL_ONLY)" in data["kind_text"]
    raw = tmp_path / "raw.bin"
    raw.write_bytes(part.data.tobytes())
    assert main(["parse-state", str(raw), "--partial", "--model", str(path)]) == 0
    out = capsys.readouterr().out
    assert "partial (PARTIAL_ONLY)" in out and f"{name} stream 0" in out


@pytest.mark.parametrize("arch", list(PARTIAL_CASES))
def test_partial_dump_loads_back_with_the_flag(tmp_path, arch):
    import pyllamacpp as pl

    P = pl.StateFlags.PARTIAL_ONLY
    _, memory, layers, name = PARTIAL_CASES[arch]
    other = next(n for n in layers if n != name)  # the part a PARTIAL_ONLY load leaves alone
    with _partial_context(tmp_path, arch) as (path, ctx, full, part, decode_more):
        ref = decode_more(np.arange(11, 16), 10)
        advanced = ctx.seq_state(0)

        def parts(blob):
            s = state.parse(np.asarray(blob), model=path)
            return {p.name: s.buffer[p.offset : p.end].tobytes() for p in s.parts}, s

        # the wrong flag is refused by the check, before llama.cpp; the sequence stays
        for blob, flags, why in (
            (full, P, "full dump .* loaded with PARTIAL_ONLY"),
            (part, 0, "PARTIAL_ONLY dump .* load it with flags=StateFlags.PARTIAL_ONLY"),
        ):
            for b in (blob, bytes(blob)):  # the SeqState this context made, and bytes
                with pytest.raises(pl.StateError, match=why) as e:
                    ctx.set_seq_state(0, b, flags)
                assert e.value.func == "pyllamacpp.state.parse"
                assert bytes(ctx.seq_state(0)) == bytes(advanced)
        # with it, llama.cpp reads the partial part only: the rest of the sequence stays
        assert ctx.set_seq_state(0, bytes(part), P) == len(part)
        now, _ = parts(ctx.seq_state(0).data)
        assert now[other] == parts(advanced.data)[0][other]  # 15 tokens, untouched
        assert now[name] == part.data[8:].tobytes()  # back at 10 tokens
        assert bytes(ctx.seq_state(0, P)) == bytes(part)
        # iSWA: llama_kv_cache_iswa::seq_pos_max is the swa cache's; hybrid: the min of its parts'
        assert ctx.memory.seq_pos_max(0) == 9
        # with the positions the partial part lacks removed, the sequence is the one dumped, to
        # the byte, and decodes as it did (bit-identical: the same cells)
        assert ctx.memory.seq_rm(0, 10, -1)
        assert bytes(ctx.seq_state(0)) == bytes(full)
        np.testing.assert_array_equal(decode_more(np.arange(11, 16), 10), ref)
        # into an empty sequence: the partial part alone
        ctx.memory.clear()
        assert ctx.set_seq_state(0, part, P) == len(part)  # this context's SeqState, same flags: trusted
        now, s = parts(ctx.seq_state(0).data)
        assert [x.cell_count for x in s.part(other).streams] == [0] and now[name] == part.data[8:].tobytes()
        pos = state.parse(part.data, model=path).stream().cells["pos"]
        if memory == "iswa":  # the swa window of the 10 tokens
            assert (ctx.memory.seq_pos_min(0), ctx.memory.seq_pos_max(0)) == (int(pos.min()), 9) and pos.min() > 0
        else:  # llama_memory_hybrid: max of the parts' minima, min of their maxima (attention: -1)
            assert pos.tolist() == [9] and (ctx.memory.seq_pos_min(0), ctx.memory.seq_pos_max(0)) == (9, -1)
        if memory == "iswa":
            # why the check matters: llama_context::state_seq_set_data does not ask for every
            # byte to be read, so a full dump loaded with PARTIAL_ONLY unchecked has its base
            # part read into the swa cache: refused only when their layer counts differ
            fb = state.parse(full.data, model=path).part("base")
            if len(layers["base"]) != len(layers["swa"]):
                # the check compares a partial blob with the swa part's layers, not the model's
                forged = full.data[:8].tobytes() + full.data[fb.offset : fb.end].tobytes()
                with pytest.raises(pl.StateError, match=r"1 layers in the swa part, the model's has 3"):
                    ctx.set_seq_state(0, forged, P)
            if len(layers["base"]) == len(layers["swa"]):
                assert ctx.set_seq_state(0, bytes(full), P, validate=False) == fb.end < len(full)
            else:
                with pytest.raises(pl.StateError, match="unchanged") as e:
                    ctx.set_seq_state(0, bytes(full), P, validate=False)
                assert "mismatched layer count" in e.value.reason
            # ON_DEVICE too: the device reader must see the flags of the save (else llama.cpp
            # aborts: "memory buffer mismatch")
            ctx.memory.clear()
            ctx.set_seq_state(0, full)
            dev = ctx.seq_state(0, P | pl.StateFlags.ON_DEVICE)
            meta = state.parse(dev.data, flags=int(P | pl.StateFlags.ON_DEVICE), model=path)
            assert meta.metadata_only and meta.partial and [p.name for p in meta.parts] == ["swa"]
            with pytest.raises(pl.StateError, match="saved with flags=3"):
                ctx.set_seq_state(0, dev, pl.StateFlags.ON_DEVICE)
            assert ctx.set_seq_state(0, dev, P | pl.StateFlags.ON_DEVICE) == len(dev)
            assert bytes(ctx.seq_state(0)) == bytes(full)


def test_partial_only_changes_nothing_for_plain_and_recurrent_memories(pl_model, tmp_path):
    import pyllamacpp as pl
    from pyllamacpp.testing import make_model

    P = pl.StateFlags.PARTIAL_ONLY
    mamba = make_model(tmp_path / "mamba.gguf", "mamba", n_layer=2, n_embd=32, n_vocab=128, seed=1)
    with pl.Model(mamba) as mm:
        for model, toks in ((pl_model, PROMPT_TOKENS), (mm, list(range(1, 11)))):
            with model.context(n_ctx=256, n_threads=N_THREADS, n_threads_batch=N_THREADS) as ctx:
                ctx.prefill(toks)
                full, part = ctx.seq_state(0), ctx.seq_state(0, P)
                # llama_kv_cache::state_write and llama_memory_recurrent::state_write ignore the flag
                assert bytes(full) == bytes(part)
                st = state.parse(part.data, flags=P, model=model.path)
                assert st.partial is True and [p.name for p in st.parts] == [st.options["memory"]]
                assert "writes all of itself" in st.describe()
                assert state.parse(part.data, model=model.path).partial is None  # the bytes cannot tell
                # and loads either way, checked
                for blob, flags in ((bytes(full), P), (part, 0), (full, P)):
                    ctx.memory.clear()
                    assert ctx.set_seq_state(0, blob, flags) == len(full)
                    assert ctx.memory.seq_pos_max(0) == len(toks) - 1


def test_hybrid_iswa_partial_layout(tmp_path):
    # llama_memory_hybrid_iswa passes the flag to its iSWA cache: swa part, then recurrent. That
    # is the shape of an lfm2 hybrid dump (one KV part, then recurrent): read it that way.
    with _partial_context(tmp_path, "lfm2") as (path, ctx, full, part, _):
        pass
    m = {"base": [], "swa": [1, 3], "recurrent": [0, 2]}
    st = state.parse(full.data, layers=m)
    assert st.options["memory"] == "hybrid-iswa" and st.partial is True  # the full layout does not read
    assert [p.name for p in st.parts] == ["swa", "recurrent"] and st.k.layers == (1, 3)
    assert "only the swa and recurrent parts of a hybrid iSWA memory" in st.describe()
    # a layer map of another memory is an error that says so
    with pytest.raises(StateFormatError, match="layer map is for memory 'iswa' .* reads as memory 'hybrid'"):
        state.parse(full.data, layers={"base": [1, 3], "swa": [0, 2]})
