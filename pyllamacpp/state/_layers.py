"""Which model layer (llama.cpp's ``il``) each record of a dump belongs to.

A dump writes one record per layer *of that memory part*, and a part holds only some layers: an
iSWA cache's base part the non-SWA layers and its swa part the SWA ones, a hybrid memory's KV part
the attention layers and its recurrent part the others. The dump does not say which, so the map
is computed from the model's GGUF metadata, as llama.cpp's hparams and ``create_memory`` decide.

``layer_map(fields)`` returns ``{part name: [il, ...]}`` (part names as ``parse`` names them:
kv, base, swa, recurrent, mla, lid, idx; deepseek4's csa, hca, lid, csa-state, hca-state,
lid-state) or None when this module does not know the architecture's rule, or when the rule
depends on something the GGUF does not say (which context type made the dump, for most archs
with nextn/MTP layers): a wrong map would be worse than none. ``memory_for(fields)`` names the
memory of an arch whose memory is known when its layer map is not (parse then names the parts
right, with record indices for layers).

A key absent from the GGUF is ``None`` in ``fields``. For the rules in KEYED_RULES, whose keys
llama.cpp defaults when absent, a key missing from ``fields`` means the caller did not read it,
and gives no map rather than the default's.
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

# llama_model::create_memory's own cases (llama-model.cpp), main context; memory_for names the
# memory from these where layer_map gives no map (nextn layers, a key the caller did not read):
# minimax-m3 -> llama_kv_cache_msa; deepseek32, glm-dsa -> llama_kv_cache_dsa; hy_v4 -> _dsa when
# attention.indexer.top_k > 0 (else a plain cache); dots3note -> llama_kv_cache_dsa_iswa;
# glm5-next -> llama_memory_hybrid_idx; qwen4exp -> llama_memory_hybrid_idx (its default-branch
# needs_mem_idx; models/qwen4exp.cpp sets no swa_type, so never the hybrid-iswa branch);
# deepseek4 -> llama_kv_cache_dsv4 (its dump names itself: magic 'DSV4').
MEMORY_ARCHS = {
    "minimax-m3": "msa",
    "deepseek32": "dsa",
    "glm-dsa": "dsa",
    "dots3note": "dsa-iswa",
    "glm5-next": "hybrid-idx",
    "qwen4exp": "hybrid-idx",
    "deepseek4": "dsv4",
}

# llama-hparams.h: llama_model_loader::get_arr refuses a longer array
LLAMA_MAX_LAYERS = 512
# models/glm-dsa.cpp GLM_5_2_DEFAULT_INDEXER_TYPES (1: the layer owns a "full" indexer; layers past
# its 78 entries are 0), glm-dsa's is_indexer_full when attention.indexer.types is absent and
# context_length >= 1048576 (GLM 5.2); shorter contexts (GLM 5, 5.1) have an indexer everywhere
GLM_5_2_INDEXER_TYPES = (1, 1) + (1, 0, 0, 0) * 19
GLM_5_2_MIN_CONTEXT = 1048576
# per-layer arrays another rule reads (besides head_count_kv and the SWA pattern): a caller that
# reads llama.cpp's metadata (llama_model_meta_val_str leaves arrays out) reads them from the GGUF
ARRAY_KEYS: dict[str, tuple[str, ...]] = {"deepseek4": ("attention.compress_ratios",)}
# the keys (after "{arch}.") rules of several archs read
COMMON_KEYS = (
    "block_count",
    "nextn_predict_layers",
    "attention.head_count_kv",
    "attention.sliding_window",
    "leading_dense_block_count",
)
# archs whose rule reads these keys (after block_count, nextn_predict_layers): each must be in
# ``fields``, None when the GGUF lacks it (see the module docstring)
KEYED_RULES: dict[str, tuple[str, ...]] = {
    "glm-dsa": ("attention.indexer.types", "context_length"),
    "hy_v4": ("attention.indexer.top_k", "attention.indexer.types"),
    "dots3note": ("attention.sliding_window_pattern", "attention.indexer.types"),
    "glm5-next": ("attention.head_count_kv", "attention.indexer.types"),
    "qwen4exp": ("attention.recurrent_layers", "full_attention_interval"),
}


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


def _flags(value, n: int, *, exact: bool) -> list[bool] | None:
    """Per-layer flags of layers 0..n-1 (nonzero: true) from a key llama_model_loader reads into a
    uint32 array: get_key_or_arr (``exact``: a scalar for every layer, or an array of exactly n;
    it throws on another length) or get_arr (an array of at most LLAMA_MAX_LAYERS entries,
    layers past its end keep the 0 load_hparams filled in; a scalar is no array: it throws)."""
    if isinstance(value, (list, tuple)):
        if (len(value) != n) if exact else (len(value) > LLAMA_MAX_LAYERS):
            return None
        return [bool(v) for v in value[:n]] + [False] * (n - len(value))
    if exact and isinstance(value, int):
        return [bool(value)] * n
    return None


def arch_keys(arch: str | None) -> tuple[str, ...]:
    """The keys (after "{arch}.") only ``arch``'s rule reads.

    Its KEYED_RULES keys, its ARRAY_KEYS, an iSWA arch's sliding_window_pattern. A caller reading
    llama.cpp's metadata, which leaves arrays out, reads these from the GGUF when the metadata
    lacks them.

    Args:
        arch: ``general.architecture`` (llm_arch_name()).

    Returns:
        The key suffixes; empty for an arch with no keys of its own.
    """
    if arch is None:  # a GGUF without general.architecture: no rule of its own
        return ()
    pattern = ("attention.sliding_window_pattern",) if arch in ISWA_ARCHS else ()
    return KEYED_RULES.get(arch, ()) + ARRAY_KEYS.get(arch, ()) + pattern


def rule_keys(arch: str | None) -> tuple[str, ...]:
    """Every key (after "{arch}.") that layer_map and memory_for read for ``arch``.

    Args:
        arch: ``general.architecture`` (llm_arch_name()).

    Returns:
        The key suffixes a caller puts in ``fields`` (None when the GGUF lacks the key).
    """
    return COMMON_KEYS + tuple(k for k in arch_keys(arch) if k not in COMMON_KEYS)


def memory_for(fields: dict) -> str | None:
    """The memory llama_model::create_memory builds for an arch in MEMORY_ARCHS (main context).

    Args:
        fields: GGUF key -> value (arrays as lists), as for layer_map.

    Returns:
        A memory name of ``parse(memory=...)`` ("dsa", "msa", "dsv4" ...), or None when the arch
        is not in MEMORY_ARCHS or its memory depends on the context type (nextn layers).
    """
    arch = fields.get("general.architecture")
    # nextn layers: most of these archs give an MTP context a plain cache, or filters per context
    # type; qwen4exp does not (create_memory's default branch: llama_memory_hybrid_idx for both)
    if not isinstance(arch, str) or (fields.get(f"{arch}.nextn_predict_layers") and arch != "qwen4exp"):
        return None
    if arch == "hy_v4":
        top_k = fields.get(f"{arch}.attention.indexer.top_k")
        return "dsa" if isinstance(top_k, int) and top_k > 0 else None
    return MEMORY_ARCHS.get(arch)


def layer_map(fields: dict) -> dict[str, list[int]] | None:
    """Which model layer (``il``) each part of a dump holds, as llama_model::create_memory decides.

    See the module docstring for the rules and when there is no map.

    Args:
        fields: GGUF key -> value (arrays as lists): ``general.architecture`` and the keys
            ``rule_keys(arch)`` names (None for a key the GGUF lacks).

    Returns:
        ``{part name: [il, ...]}`` with part names as ``parse`` names them (kv, base, swa,
        recurrent ...), or None when the architecture's rule is unknown or depends on something
        the GGUF does not say.
    """
    arch = fields.get("general.architecture")
    n_layer = fields.get(f"{arch}.block_count")
    if not isinstance(arch, str) or not isinstance(n_layer, int) or n_layer < 1:
        return None
    layers = list(range(n_layer))

    def key(name):
        return fields.get(f"{arch}.{name}")

    nextn = key("nextn_predict_layers") or 0
    if not isinstance(nextn, int) or not 0 <= nextn <= n_layer:  # load_hparams asserts it
        return None
    if arch in KEYED_RULES:
        if any(f"{arch}.{k}" not in fields for k in KEYED_RULES[arch]):
            return None  # a key the caller did not read: its default may not be the GGUF's
        return KEYED_RULES_FN[arch](key, n_layer, nextn)
    if nextn:  # MTP layers: filtered per context type
        return None

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
            return {"base": [il for il in layers if not is_swa[il]], "swa": [il for il in layers if is_swa[il]]}
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
    return {
        "base": [],
        "swa": layers,
        "csa": csa,
        "hca": hca,
        "lid": csa,
        "csa-state": csa,
        "hca-state": hca,
        "lid-state": csa,
    }


# -- rules of the archs in KEYED_RULES: (key, n_layer_all, n_layer_nextn) -> map or None. Every
# filter below runs over il < n_layer_all in the llama_kv_cache constructor (after has_kv(il),
# always true here: n_layer_kv_from_start stays -1) and over il < n_layer() = n_layer_all -
# n_layer_nextn in llama_memory_recurrent's; both keep il order, which state_write follows.


def _glm_dsa(key, n_layer: int, nextn: int) -> dict[str, list[int]] | None:
    """glm-dsa: llama_kv_cache_dsa (create_memory, case LLM_ARCH_GLM_DSA), kv_mla over every
    layer, kv_lid over the layers with is_indexer_full(il)."""
    if nextn:  # create_memory: an MTP context gets a plain cache of the nextn layers, the main one not
        return None
    types = key("attention.indexer.types")
    if types is None:
        # models/glm-dsa.cpp load_arch_hparams: without indexer.types, context_length < 1048576
        # fills every layer with 1, else GLM_5_2_DEFAULT_INDEXER_TYPES
        n_ctx_train = key("context_length")
        if not isinstance(n_ctx_train, int):
            return None  # load_hparams requires it
        default = GLM_5_2_INDEXER_TYPES + (0,) * max(0, n_layer - len(GLM_5_2_INDEXER_TYPES))
        full = [n_ctx_train < GLM_5_2_MIN_CONTEXT or bool(default[il]) for il in range(n_layer)]
    else:
        # get_key_or_arr(LLM_KV_ATTENTION_INDEXER_TYPES, ..., n_layer(), false): scalar or n_layer() entries
        flags = _flags(types, n_layer, exact=True)
        if flags is None:
            return None
        full = flags
    # filter_mla nullptr without nextn; filter_lid: il < n_layer() && is_indexer_full(il)
    return {"mla": list(range(n_layer)), "lid": [il for il in range(n_layer) if full[il]]}


def _hy_v4(key, n_layer: int, nextn: int) -> dict[str, list[int]] | None:
    """hy_v4: create_memory (case LLM_ARCH_HY_V4, the same for every context type) builds a plain
    llama_kv_cache over every layer when indexer_top_k is 0 (attention.indexer.top_k absent or 0:
    models/hy-v4.cpp reads it optionally), else llama_kv_cache_dsa: kv_mla over every layer,
    kv_lid over is_indexer_full(il)."""
    top_k = key("attention.indexer.top_k")
    if top_k is None or top_k == 0:
        return {"kv": list(range(n_layer))}  # filter nullptr: nextn layers too
    if not isinstance(top_k, int) or nextn:
        return None  # with nextn layers filter_lid calls is_indexer_full(il >= n_layer()): GGML_ABORT
    # get_key_or_arr(LLM_KV_ATTENTION_INDEXER_TYPES, ..., n_layer(), false) over load_hparams' 0s;
    # load_arch_hparams throws unless layer 0 owns an indexer (so absent types load no model)
    full = _flags(key("attention.indexer.types"), n_layer, exact=True)
    if full is None or not full[0]:
        return None
    return {"mla": list(range(n_layer)), "lid": [il for il in range(n_layer) if full[il]]}


def _dots3note(key, n_layer: int, nextn: int) -> dict[str, list[int]] | None:
    """dots3note: llama_kv_cache_dsa_iswa (create_memory, case LLM_ARCH_DOTS3NOTE): its kv_dsa's
    kv_mla over the non-SWA layers (filter_dsa: !is_swa(il)), kv_dsa's kv_lid over
    is_indexer_full(il) whether SWA or not (filter_lid is passed on unchained), kv_swa over the
    SWA layers (filter_swa: is_swa(il))."""
    if nextn:  # create_memory: an MTP context gets a plain cache of the nextn layers
        return None
    # models/dots3note.cpp: get_arr(SLIDING_WINDOW_PATTERN, is_swa_impl) and get_arr(INDEXER_TYPES,
    # is_indexer_full_impl), both required arrays of any length (no set_swa_pattern)
    is_swa = _flags(key("attention.sliding_window_pattern"), n_layer, exact=False)
    full = _flags(key("attention.indexer.types"), n_layer, exact=False)
    if is_swa is None or full is None:
        return None
    return {
        "mla": [il for il in range(n_layer) if not is_swa[il]],
        "lid": [il for il in range(n_layer) if full[il]],
        "swa": [il for il in range(n_layer) if is_swa[il]],
    }


def _glm5_next(key, n_layer: int, nextn: int) -> dict[str, list[int]] | None:
    """glm5-next: llama_memory_hybrid_idx (create_memory, case LLM_ARCH_GLM5_NEXT): attention
    (kv) over !is_recr(il), recurrent over is_recr(il), the indexer cache (idx) over !is_recr(il)
    && is_indexer_full(il)."""
    if nextn:  # create_memory: an MTP context's filters keep the nextn layers only
        return None
    # models/glm5-next.cpp: is_recr_impl[i] = n_head_kv(i) == 0
    head_kv = _per_layer(key("attention.head_count_kv"), n_layer)
    types = key("attention.indexer.types")
    # std::fill(is_indexer_full_impl, 1), then get_key_or_arr(INDEXER_TYPES, ..., n_layer(), false)
    full = [True] * n_layer if types is None else _flags(types, n_layer, exact=True)
    if head_kv is None or full is None:
        return None
    return {
        "kv": [il for il in range(n_layer) if head_kv[il] > 0],
        "recurrent": [il for il in range(n_layer) if head_kv[il] == 0],
        "idx": [il for il in range(n_layer) if head_kv[il] > 0 and full[il]],
    }


def _qwen4exp(key, n_layer: int, nextn: int) -> dict[str, list[int]] | None:
    """qwen4exp: llama_memory_hybrid_idx (create_memory's default branch, needs_mem_idx; no
    swa_type, so never hybrid-iswa; mtp_on_hybrid_qwen leaves it out, so an MTP context builds
    the same): kv over il < n_layer() && !is_recr(il), recurrent over il < n_layer() &&
    is_recr(il), idx as kv (filter_idx, set as indexer_head_size > 0, which load_arch_hparams
    requires). The nextn layers are in no part."""
    n_trunk = n_layer - nextn
    recr = key("attention.recurrent_layers")
    if recr is not None:
        # get_key_or_arr(LLM_KV_ATTENTION_RECURRENT_LAYERS, is_recr_impl, n_layer_all, false)
        is_recr = _flags(recr, n_layer, exact=True)
        if is_recr is None:
            return None
    else:
        # else full_attention_interval (default 4, 0 refused): recurrent unless (il + 1) % interval == 0
        interval = key("full_attention_interval")
        interval = 4 if interval is None else interval
        if not isinstance(interval, int) or interval <= 0:
            return None
        is_recr = [(il + 1) % interval != 0 for il in range(n_layer)]
    attn = [il for il in range(n_trunk) if not is_recr[il]]
    return {"kv": attn, "recurrent": [il for il in range(n_trunk) if is_recr[il]], "idx": attn}


KEYED_RULES_FN = {
    "glm-dsa": _glm_dsa,
    "hy_v4": _hy_v4,
    "dots3note": _dots3note,
    "glm5-next": _glm5_next,
    "qwen4exp": _qwen4exp,
}
