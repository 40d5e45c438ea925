"""pyllamacpp.context_state: Context's state methods come from one class whose methods are
functions of three modules, and pickles made before ``SeqState`` and ``StateFlags`` moved (they
name ``pyllamacpp._state_types``) still load, as the classes of today."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from pyllamacpp.context_state import SeqState, StateFlags

OLD = "pyllamacpp._state_types"
# StateFlags.PARTIAL_ONLY as pickle.dumps(..., protocol=2) wrote it while the class lived there
OLD_FLAGS = b"\x80\x02cpyllamacpp._state_types\nStateFlags\nq\x00K\x01\x85q\x01Rq\x02."


def test_old_flags_pickle_loads():
    assert pickle.loads(OLD_FLAGS) is StateFlags.PARTIAL_ONLY


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_old_seq_state_pickle_loads(protocol, monkeypatch):
    st = SeqState(np.arange(10, dtype=np.uint8), 3, StateFlags.PARTIAL_ONLY)
    with monkeypatch.context() as m:
        # pickled as by the class before it moved (pickle checks that the old path gives the class)
        m.setattr(SeqState, "__module__", OLD)
        m.setattr(StateFlags, "__module__", OLD)
        old = pickle.dumps(st, protocol=protocol)
    assert OLD.encode() in old and SeqState.__module__.encode() not in old
    back = pickle.loads(old)
    assert type(back) is SeqState and type(back.flags) is StateFlags
    assert (back.data == st.data).all() and back.seq_id == 3 and back.flags == StateFlags.PARTIAL_ONLY
    assert back._cptr is None and len(back) == 10


# every public state method and property of Context, as before they were functions
STATE_API = {
    "seq_state", "set_seq_state", "state", "set_state", "flash_attn", "sidecar_facts", "check_state",
    "save_seq_state", "load_seq_state", "check_state_file", "save_state", "load_state", "save_seq_dump",
}  # fmt: skip


def test_context_gets_its_state_methods_from_one_class():
    from pyllamacpp._handle import Owner
    from pyllamacpp.context import Context
    from pyllamacpp.context_state import StateMethods

    assert Context.__mro__ == (Context, StateMethods, Owner, object)  # no mixin chain
    members = {
        n: v.fget if isinstance(v, property) else v for n, v in vars(StateMethods).items() if not n.startswith("__")
    }
    assert STATE_API <= set(members)
    funcs = {n: f for n, f in members.items() if callable(f)}
    assert {f.__module__ for f in funcs.values()} == {
        "pyllamacpp._context_state.data",
        "pyllamacpp._context_state.checks",
        "pyllamacpp._context_state.files",
    }
    for name in STATE_API:  # each is the context's own, bound to it
        assert getattr(Context, name) is vars(StateMethods)[name]


def test_a_dump_is_read_first_as_this_contexts_memory_writes_it(model, monkeypatch):
    """check_state parses a blob with the context's memory layout given (no layout to detect: an
    iSWA dump took 40 ms detected, 1 ms so), and detects the layout only when that fails."""
    from pyllamacpp import state

    calls = []
    parse = state.parse

    def spy(data, **kw):
        calls.append(kw.get("memory"))
        return parse(data, **kw)

    monkeypatch.setattr(state, "parse", spy)
    with model.context(n_ctx=64, n_threads=1, n_threads_batch=1) as ctx:
        ctx.prefill(model.tokenize("The cat sat on the mat"))
        blob = ctx.seq_state(0).data
        ctx.set_seq_state(0, blob)
        assert calls == ["kv"]
        calls.clear()
        with pytest.raises(Exception, match="not a valid state"):
            ctx.set_seq_state(0, b"\x00" * 7)
        assert calls == ["kv", None]  # the layout given failed: detected, and the error is the parser's
    assert ctx.closed
