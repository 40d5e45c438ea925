"""Graph taps: read and change the tensors of a forward pass, from Python, at the speed of C.

Every context pyllamacpp makes (unless ``taps=False`` or your own ``cb_eval``) gets a C
``cb_eval`` (``ggml_backend_sched_eval_callback``, build_support/taps.h) that answers "not wanted"
to every node until a capture or a patch is armed. Then it answers from a hash table of the exact
node names and occurrences this module resolved from a listing of the graph; a wanted node is
copied in C (``ggml_backend_tensor_get``, so CUDA and RPC too) into an arena numpy owns, and
Python builds arrays over it only when you read them, after the decode.

Names are the graph callback's (``llama_context::graph_get_cb``): ``<site>-<layer>``
(``l_out-5``, ``attn_norm-0``, ``kq_soft_max-3``) or unlayered (``embd``, ``norm``,
``result_norm``, ``result_output``). A name is not unique (``Qcur-0`` names a MUL_MAT, a RESHAPE
and a ROPE; ``norm-0`` the attention and the FFN RMS_NORM): a site means the **last** node of that
name in graph order (the value later ops read) unless ``which=`` says another. Graph inputs (the
KQ mask ``attn_inp_kq_mask``, ``inp_pos``, ``inp_tokens``, ``out_ids``, the KV cache tensors
``cache_k_l<il>``) are leaves the callback never visits: they are read, once per pass, from the
``src[]`` of the first node that reads them, before it computes.

The listing (:meth:`Graph`) comes from probe decodes in a throwaway context with the same
parameters (2 and 3 tokens, every row an output, and the shape you ask for), so the context you
tap is not touched by it: the token axis of each node is the axis whose length follows the
token count.

Pictures of a capture (matplotlib, optional): :func:`plot_attention`, :func:`plot_mask`,
:func:`plot_residual_norms`.
"""

from __future__ import annotations

from ._capture import Capture, Patch
from ._graph import Graph, GraphNode, NamesFilter, name_layer, resolve, split_name
from ._graph import _listing as graph_listing
from ._plot import plot_attention, plot_mask, plot_residual_norms
from ._rows import TapInfo, TapRecord, plan_ubatches
from ._taps import Taps, taps_of

__all__ = [
    "NamesFilter",
    "GraphNode",
    "Graph",
    "TapRecord",
    "TapInfo",
    "Capture",
    "Patch",
    "split_name",
    "name_layer",
    "resolve",
    "plot_attention",
    "plot_mask",
    "plot_residual_norms",
]
# the package's internal API, outside __all__: graph_listing (Context.graph_nodes, the pass
# counter of speculative), plan_ubatches (Context's rollback of a failed tap), Taps and taps_of
_INTERNAL = (graph_listing, plan_ubatches, Taps, taps_of)
