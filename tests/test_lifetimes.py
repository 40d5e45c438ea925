"""C objects that free or invalidate each other (pyllamacpp/_handle.py), in every order Python's
collector may finalize them.

The pairs: a model and its LoRA adapters (``llama_model::~llama_model`` deletes every adapter
still attached), a model and its contexts, an adapter and the contexts that apply it, a model and
a sampler whose grammar keeps the model's vocab. For each, parent and child go into one reference
cycle and are collected, in both creation orders of the cycle; and the handles' finalizers are
run by hand in both orders, which is what the collector may do inside one cycle (CPython runs
the finalizers of a garbage cycle in no fixed order), so the test does not depend on where the
allocator or the collector happen to put things.

To see a fault on any CPU, each case runs in a child process with glibc's malloc perturbation
(``MALLOC_PERTURB_``: freed memory is overwritten at once, so a freed adapter or model read
again crashes instead of reading stale but plausible bytes) and its tcache double-free check;
a signal fails that case, not the run. With the fix removed (``_Node.release`` not freeing its
dependents first), the parent-first cases end in SIGSEGV or SIGABRT.
"""

from __future__ import annotations

import textwrap

import pytest
from conftest import run_child

_SETUP = """
import gc, os, sys, tempfile
import pyllamacpp as pl
from pyllamacpp.testing import make_lora

base = pl.Model().path
lora = make_lora(os.path.join(tempfile.mkdtemp(), "a.gguf"), base, ["blk.0.attn_q.weight"])

def objects(kind):
    '''(parent, child, keep): the child depends on the parent; keep holds what must stay.'''
    m = pl.Model(base)
    if kind == "model-adapter":
        return m, pl.LoraAdapter(m, lora), ()
    if kind == "model-context":
        return m, m.context(n_ctx=64, n_threads=1), ()
    if kind == "adapter-context":
        ad = pl.LoraAdapter(m, lora)
        ctx = m.context(n_ctx=64, n_threads=1)
        ctx.set_lora(ad, 0.5)
        ctx.prefill(m.tokenize("The cat"))
        return ad, ctx, (m,)
    if kind == "model-sampler":
        return m, pl.Sampler(m).grammar(m, 'root ::= "yes" | "no"'), ()
    raise ValueError(kind)
"""

_CYCLE = (
    _SETUP
    + """
kind, order = sys.argv[1], sys.argv[2]
gc.disable()  # the one collection below, not one chosen by allocation counts
parent, child, keep = objects(kind)
junk = {"parent": parent, "child": child} if order == "parent-first" else {"child": child, "parent": parent}
junk["self"] = junk
junk["keep"] = keep
parent.cycle = junk  # the objects themselves are in the cycle, not only held by it
child.cycle = junk
del parent, child, keep, junk
print("collected", gc.collect() > 0, flush=True)
m = pl.Model(base)  # the allocator reuses what was freed: a stale free shows here
print(m.complete("The cat", n_predict=2) is not None)
print("ok")
"""
)

_FORCED = (
    _SETUP
    + """
kind, order = sys.argv[1], sys.argv[2]
parent, child, keep = objects(kind)
ph, chh = parent._h, child._h
# what the collector does inside a cycle: run each handle's finalizer, in an order of its own
for h in ((ph, chh) if order == "parent-first" else (chh, ph)):
    h.__del__()
parent._h = child._h = None  # closed as far as Python is concerned: nothing may touch them now
del parent, child, keep, ph, chh
gc.collect()  # the handles' real finalizers run again (idempotent) and the ffi.gc pointers go
m = pl.Model(base)
print(m.complete("The cat", n_predict=2) is not None)
print("ok")
"""
)

_ENV = {"MALLOC_PERTURB_": "165", "MALLOC_CHECK_": "3"}

KINDS = ["model-adapter", "model-context", "adapter-context", "model-sampler"]
ORDERS = ["parent-first", "child-first"]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("kind", KINDS)
def test_a_reference_cycle_is_collected_in_either_creation_order(kind, order):
    """Parent and child in one garbage cycle (the issue's reproducer, each pair): collected, no signal."""
    child = run_child(_CYCLE, kind, order, env=_ENV)
    assert child.stdout.split()[-1] == "ok" and "collected True" in child.stdout


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("kind", KINDS)
def test_finalizers_in_either_order_free_the_child_first_and_once(kind, order):
    """The handles' finalizers by hand, parent's first or child's first: each C object freed once,
    the child before its parent (a double free or a use after free ends the child process)."""
    child = run_child(_FORCED, kind, order, env=_ENV)
    assert child.stdout.split()[-1] == "ok"


def test_a_model_adapter_and_context_in_one_cycle_any_order():
    """All three in one cycle, the model's handle finalized first: the context goes first, then the
    adapter it applies, then the model."""
    code = _SETUP + textwrap.dedent(
        """
        import itertools
        for perm in itertools.permutations(range(3)):
            m = pl.Model(base)
            ad = pl.LoraAdapter(m, lora)
            ctx = m.context(n_ctx=64, n_threads=1)
            ctx.set_lora(ad, 1.0)
            ctx.prefill(m.tokenize("The cat"))
            hs = [m._h, ad._h, ctx._h]
            for i in perm:
                hs[i].__del__()
            m._h = ad._h = ctx._h = None
            del m, ad, ctx, hs
            gc.collect()
        print("ok")
        """
    )
    assert run_child(code, env=_ENV).stdout.split()[-1] == "ok"


def test_a_live_child_keeps_its_parent_and_a_closed_parent_frees_nothing_early(model_path):
    """References going one by one (no cycle): the adapter keeps the model's C object, so the model's
    close() frees nothing under it; the sampler's grammar keeps the model's vocab alive."""
    import gc
    import weakref

    import pyllamacpp as pl

    m = pl.Model(model_path)
    s = pl.Sampler(m).grammar(m, 'root ::= "yes" | "no"')
    mh = weakref.ref(m._h)
    m.close()
    gc.collect()
    assert mh() is not None  # the grammar sampler holds the model's handle
    s.close()
    gc.collect()
    assert mh() is None


class _Link:
    """What a handle asks an rpc.Link before freeing: whether the server is gone."""

    def __init__(self, answer):
        self.answer = answer

    def must_leak(self):
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


@pytest.mark.parametrize(
    ("answer", "freed"), [(False, True), (True, False), (RuntimeError("link state unknown"), False)]
)
def test_a_handle_on_a_gone_server_is_left_unfreed_and_in_doubt_too(answer, freed):
    """A server gone (or a link that cannot say): the destructor is dropped, never run (freeing
    would go through the network); a live link frees; a dependent follows its own link."""
    from pyllamacpp._handle import Handle
    from pyllamacpp._lib import ffi

    calls: list[str] = []
    parent = Handle(ffi.new("int *"), lambda p: calls.append("parent"), rpc=_Link(answer))
    child = Handle(ffi.new("int *"), lambda p: calls.append("child"), deps=(parent,), rpc=_Link(False))
    parent.__del__()  # as inside a cycle: the parent's finalizer first
    assert calls == (["child", "parent"] if freed else ["child"])
    child.__del__()
    assert calls.count("child") == 1  # once


def test_a_view_of_a_null_pointer_is_refused():
    from pyllamacpp._handle import view
    from pyllamacpp._lib import ffi

    with pytest.raises(ValueError, match="NULL"):
        view(ffi.NULL, (4,), "float32", None)
    buf = ffi.new("float[]", [1.0, 2.0])
    assert view(buf, (2,), "float32", buf).tolist() == [1.0, 2.0]


def test_a_freed_child_leaves_its_parent(model_path):
    """A context freed the ordinary way takes its freeing off the model's: a model that makes
    contexts one after another holds nothing of the ones gone."""
    import gc

    import pyllamacpp as pl

    with pl.Model(model_path) as m:
        for _ in range(3):
            with m.context(n_ctx=64, n_threads=1):
                assert len(m._h._node.dependents) == 1
            gc.collect()
        assert m._h._node.dependents == {}


def test_a_local_handle_frees_its_pointer_when_it_goes():
    """No RPC link: the destructor runs when the handle goes, dependents first."""
    import gc

    from pyllamacpp._handle import Handle
    from pyllamacpp._lib import ffi

    calls: list[str] = []
    parent = Handle(ffi.new("int *"), lambda p: calls.append("parent"))
    child = Handle(ffi.new("int *"), lambda p: calls.append("child"), deps=(parent,))
    del parent
    assert calls == []  # the child holds its parent
    del child
    gc.collect()
    assert calls == ["child", "parent"]
