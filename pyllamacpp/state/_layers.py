"""Which model layer (llama.cpp's ``il``) each record of a dump belongs to.

A dump writes one record per layer *of that memory part*, and a part holds only some layers: an
iSWA cache's base part the non-SWA layers and its swa part the SWA ones, a hybrid memory's KV part
the attention layers and its recurrent part the others. The dump does not say which, so the map
is computed from the model's GGUF metadata, as llama.cpp's hparams and ``create_memory`` decide.

``layer_map(fields)`` returns ``{part name: [il, ...]}`` (part names as ``parse`` names them:
kv, base, swa, recurrent, mla, lid, idx; deepseek4's csa, hca, lid, csa-state, hca-state,
lid-state) or None when this module does not know the architecture's rule: a wrong map would be
worse than none. ``memory_for(fields)`` names the memory of an arch
whose memory is known but whose layer rule is not read here (parse then names the parts right,
with record indices for layers).
"""
from __future__ import annotations

# llama-arch.cpp llm_arch_is_recurrent(); llama_model::load_hparams fills is_recr_impl with 1 for
# them and llama_model::create_memory builds llama_memory_recurrent with no filter: every layer.
RECURRENT_ARCHS = frozenset({"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"})

# Hybrid archs whose models/<arch>.cpp load_arch_hparams sets ``is_recr_impl[il] = n_head_kv(il)
# == 0`` and that create_memory leaves on llama_memory_hybrid's default filters (attention part:
# !is_recr(il), recurrent part: is_recr(il); llama-memory-hybrid.cpp constructor).
HYBRID_BY_HEAD_COUNT = frozenset({"jamba", "granitehybrid", "lfm2", "lfm2moe"})
# lfm2/lfm2moe with attention.sliding_window > 0: swa_type STANDARD and is_swa_impl[il] =
# !is_recr_impl[il] (models/lfm2.cpp), so create_memory picks llama_memory_hybrid_iswa.
HYBRID_SWA_ARCHS = frozenset({"lfm2", "lfm2moe"})

# iSWA archs: default sliding_window_pattern period and whether SWA is on without the
# sliding_window key (models/gemma2.cpp: always, load_swa_pattern(ml, 2); models/gemma3.cpp:
# only when attention.sliding_window > 0, load_swa_pattern(ml, 6)). dense_first is false for both.
ISWA_ARCHS = {"gemma2": (2, True), "gemma3": (6, False)}

# Archs checked to use a plain llama_kv_cache over all layers (no SWA, no filter in their
# load_arch_hparams / create_memory's default branch).
PLAIN_ARCHS = frozenset({"llama", "qwen2", "qwen3"})

# llama_model::create_memory's own cases (llama-model.cpp), main context (no nextn layers):
# minimax-m3 -> llama_kv_cache_msa; deepseek32, glm-dsa -> llama_kv_cache_dsa; hy_v4 -> _dsa when
# attention.indexer.top_k > 0 (else a plain cache); dots3note -> llama_kv_cache_dsa_iswa;
# glm5-next -> llama_memory_hybrid_idx; qwen4exp -> llama_memory_hybrid_idx (its default-branch
# needs_mem_idx; models/qwen4exp.cpp sets no swa_type, so never the hybrid-iswa branch);
# deepseek4 -> llama_kv_cache_dsv4 (its dump names itself: magic 'DSV4').
MEMORY_ARCHS = {"minimax-m3": "msa", "deepseek32": "dsa", "glm-dsa": "dsa", "dots3note": "dsa-iswa",
                "glm5-next": "hybrid-idx", "qwen4exp": "hybrid-idx", "deepseek4": "dsv4"}


def _per_layer(value, n_layer: int) -> list[int] | None:
    """A scalar or per-layer array key as llama_model_loader::get_key_or_arr reads it."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value] if len(value) == n_layer else None
    return [int(value)] * n_layer


def _swa_pattern(value, n_layer: int, default: int) -> list[bool] | None:
    """is_swa per layer: llama_model_base::load_swa_pattern (a bool array as is) and
    llama_hparams::set_swa_pattern (a period n: il % n < n - 1, every layer when n == 0)."""
    if isinstance(value, (list, tuple)):
        return [bool(v) for v in value] if len(value) == n_layer else None
    n = default if value is None else int(value)
    return [n == 0 or il % n < n - 1 for il in range(n_layer)]


def memory_for(fields: dict) -> str | None:
    """The memory of an arch in MEMORY_ARCHS (main context), or None."""
    arch = fields.get("general.architecture")
    if not isinstance(arch, str) or fields.get(f"{arch}.nextn_predict_layers"):
        return None  # nextn layers: an MTP context gets a plain cache, filtered per context type
    if arch == "hy_v4":
        top_k = fields.get(f"{arch}.attention.indexer.top_k")
        return "dsa" if isinstance(top_k, int) and top_k > 0 else None
    return MEMORY_ARCHS.get(arch)


def layer_map(fields: dict) -> dict[str, list[int]] | None:
    """``fields``: GGUF key -> value (arrays as lists). See the module docstring."""
    arch = fields.get("general.architecture")
    n_layer = fields.get(f"{arch}.block_count")
    if not isinstance(arch, str) or not isinstance(n_layer, int) or n_layer < 1:
        return None
    if fields.get(f"{arch}.nextn_predict_layers"):  # MTP layers: filtered per context type
        return None
    layers = list(range(n_layer))

    def key(name):
        return fields.get(f"{arch}.{name}")

    if arch in RECURRENT_ARCHS:
        return {"recurrent": layers}
    if arch == "falcon-h1":  # create_memory: filter_attn and filter_recr both always true
        return {"kv": layers, "recurrent": layers}
    if arch in HYBRID_BY_HEAD_COUNT:
        head_kv = _per_layer(key("attention.head_count_kv"), n_layer)
        if head_kv is None:
            return None
        attn = [il for il in layers if head_kv[il] > 0]
        recr = [il for il in layers if head_kv[il] == 0]
        if (key("attention.sliding_window") or 0) > 0:
            if arch not in HYBRID_SWA_ARCHS:
                return None
            # llama_kv_cache_iswa inside llama_memory_hybrid_iswa: base = attention and not SWA
            return {"base": [], "swa": attn, "recurrent": recr}
        return {"kv": attn, "recurrent": recr}
    if arch in ISWA_ARCHS:
        period, always = ISWA_ARCHS[arch]
        if always or (key("attention.sliding_window") or 0) > 0:
            is_swa = _swa_pattern(key("attention.sliding_window_pattern"), n_layer, period)
            if is_swa is None:
                return None
            # llama_kv_cache_iswa constructor: filter_base = !is_swa(il), filter_swa = is_swa(il)
            return {"base": [il for il in layers if not is_swa[il]],
                    "swa": [il for il in layers if is_swa[il]]}
        return {"kv": layers}
    if arch in PLAIN_ARCHS:
        return {"kv": layers}
    if arch == "deepseek32":
        # create_memory without nextn: filter_mla nullptr, filter_lid il < n_layer(): every layer
        return {"mla": layers, "lid": layers}
    if arch == "minimax-m3":
        # create_memory: kv_base unfiltered, kv_idx il >= n_layer_dense_lead
        # (models/minimax-m3.cpp: leading_dense_block_count, optional, default 0)
        lead = key("leading_dense_block_count")
        lead = 0 if lead is None else lead
        if not isinstance(lead, int):
            return None
        return {"base": layers, "idx": [il for il in layers if il >= lead]}
    if arch == "deepseek4":
        return _deepseek4(key("attention.compress_ratios"), layers)
    return None


def _deepseek4(ratios, layers: list[int]) -> dict[str, list[int]] | None:
    """llama_kv_cache_dsv4 of a main context without MTP layers (llama-kv-cache-dsv4.cpp
    constructor, models/deepseek4.cpp): every layer is SWA (set_swa_pattern(0)), so kv_raw's base
    cache holds none and its swa cache all; kv_csa, kv_lid, csa_state and lid_state hold the layers
    whose ``attention.compress_ratios`` entry is 4 (filter_csa), kv_hca and hca_state those with
    128. (The K caches and states also write their il; parse checks the map against them.)"""
    if not isinstance(ratios, (list, tuple)) or len(ratios) < len(layers):
        return None  # load_arch_hparams refuses a shorter array
    csa = [il for il in layers if int(ratios[il]) == 4]
    hca = [il for il in layers if int(ratios[il]) == 128]
    return {"base": [], "swa": layers, "csa": csa, "hca": hca, "lid": csa,
            "csa-state": csa, "hca-state": hca, "lid-state": csa}
