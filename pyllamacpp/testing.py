"""Synthetic GGUF models: tiny random weights in a real llama.cpp layout (``make_model``).

A model made here loads and decodes in the vendored llama.cpp like a converted checkpoint, so its
KV cache / recurrent state has the layout of the architecture and shapes you give: reproduce the
memory of a big model without its weights, or get every memory type in a test.

Tensor names and shapes follow ``load_arch_tensors`` in ``vendor/llama.cpp/src/models/<arch>.cpp``;
llama.cpp refuses a file with a tensor it did not ask for, so each arch writes exactly its list.
The vocabulary is llama.cpp's dummy ``"test"`` tokenizer (``LLAMA_VOCAB_TYPE_TEST``, the one its own
``tests/test-llama-archs.cpp`` uses): token ids are all you need, yet ``tokenize`` (a rolling hash of
5-byte chunks) and ``token_to_piece`` (the id in hex) still work. ``"none"`` would also load, but
llama.cpp aborts the process on ``llama_tokenize`` and token-attribute calls for such a vocabulary.

Imports only numpy and ``gguf``: nothing here needs the compiled extension.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from ._gguf_writer import write_gguf

__all__ = ["ARCHS", "make_lora", "make_model"]

ARCHS = ("llama", "qwen3", "gemma2", "gemma3", "mamba", "lfm2")
"""Architectures ``make_model`` writes (llama.cpp's ``general.architecture`` names)."""

_ATTENTION_ARCHS = ("llama", "qwen3", "gemma2", "gemma3")
_SWA_DEFAULT_PATTERN = {"gemma2": 2, "gemma3": 6}  # load_swa_pattern(ml, n) in models/gemma{2,3}.cpp

# arch_specific keywords per arch, with defaults (None: computed from the other sizes)
_OPTIONS: dict[str, dict[str, Any]] = {
    "llama": {"rope_freq_base": 10000.0, "norm_rms_eps": 1e-5, "n_expert": 0, "n_expert_used": 2},
    "qwen3": {"rope_freq_base": 1000000.0, "norm_rms_eps": 1e-6},
    "gemma2": {"rope_freq_base": 10000.0, "norm_rms_eps": 1e-6, "n_swa": 4096, "swa_pattern": None},
    "gemma3": {"rope_freq_base": 1000000.0, "norm_rms_eps": 1e-6, "n_swa": 4096, "swa_pattern": None},
    "mamba": {"norm_rms_eps": 1e-5, "ssm_d_conv": 4, "ssm_d_state": 16, "ssm_dt_rank": None, "ssm_d_inner": None},
    "lfm2": {"rope_freq_base": 1000000.0, "norm_rms_eps": 1e-5, "conv_l_cache": 3, "attn_layers": None, "n_swa": 0},
}

_STD = 0.02


def make_model(
    path: str | os.PathLike,
    arch: str = "llama",
    *,
    n_layer: int,
    n_embd: int,
    n_head: int | None = None,
    n_head_kv: int | None = None,
    head_dim: int | None = None,
    n_vocab: int,
    n_ff: int | None = None,
    n_ctx_train: int = 4096,
    seed: int = 0,
    dtype: str = "f32",
    tie_embeddings: bool = True,
    split_max_tensors: int = 0,
    metadata: dict[str, bool | int | str] | None = None,
    **arch_specific: Any,
) -> Path:
    """Write a random-weight GGUF of ``arch`` to ``path`` (atomically) and return the path.

    Matrices are ``normal(0, 0.02)`` from ``numpy.random.default_rng(seed)``; norms are 1 and
    vectors stay float32. llama.cpp loads the file with ``llama_model_load_from_file``.

    Args:
        path: where to write the GGUF (a temporary name, then renamed).
        arch: one of ``ARCHS`` (llama.cpp's ``general.architecture`` names).
        n_layer: number of layers (``block_count``).
        n_embd: embedding size.
        n_head: attention heads; leave unset for ``mamba`` (no attention).
        n_head_kv: KV heads; defaults to ``n_head`` (llama.cpp's default).
        head_dim: ``attention.key_length`` and ``value_length``; defaults to ``n_embd / n_head``
            (leave unset for ``lfm2``, which has no key_length).
        n_vocab: vocabulary size (llama.cpp's ``"test"`` tokenizer).
        n_ff: feed-forward size; defaults to ``4 * n_embd``.
        n_ctx_train: ``context_length``.
        seed: seed of the weights.
        dtype: ``"f32"`` or ``"f16"`` for the matrices.
        tie_embeddings: True: no ``output.weight``, the output projection is ``token_embd.weight``
            (llama.cpp's ``TENSOR_DUPLICATED`` fallback); False: an ``output.weight`` of its own
            (not for ``gemma2``, which always ties them).
        split_max_tensors: More than 0: a split model of at most that many tensors per file
            (``<stem>-00001-of-0000N.gguf`` beside ``path``, as llama-gguf-split names them; written
            in place, not atomically); the first file's path is returned.
        metadata: more keys to write, a bool, int (uint32) or str each, after the arch's own
            (``{"tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.bos_token_id": 1}``).
        **arch_specific: by arch, in llama.cpp's hparams names:

            - attention archs: ``rope_freq_base``, ``norm_rms_eps``;
            - ``llama``: ``n_expert`` (0: a dense FFN; more: a mixture of experts, as Mixtral,
              with ``ffn_gate_inp`` and ``ffn_{gate,up,down}_exps`` tensors of ``n_ff`` each) and
              ``n_expert_used`` (2);
            - ``gemma2``/``gemma3`` (iSWA cache): ``n_swa`` (``attention.sliding_window``, default
              4096), ``swa_pattern``: an int period (layer ``il`` is SWA when ``il % p < p - 1``;
              default 2 for gemma2, 6 for gemma3) or one bool per layer (True = SWA);
            - ``mamba`` (recurrent memory): ``ssm_d_conv`` (4), ``ssm_d_state`` (16),
              ``ssm_dt_rank`` (``ceil(n_embd / 16)``); ``ssm_d_inner`` must be ``2 * n_embd``, the
              only expansion llama.cpp's mamba supports;
            - ``lfm2`` (hybrid memory: a KV cache for the attention layers, then recurrent state
              for the short-convolution layers): ``attn_layers``, one bool per layer (True =
              attention; default: every other layer from layer 1), written as a per-layer
              ``attention.head_count_kv`` where 0 marks a convolution layer (models/lfm2.cpp:
              ``is_recr_impl[il] = n_head_kv(il) == 0``); ``conv_l_cache`` (``shortconv.l_cache``,
              3), ``rope_freq_base``, ``norm_rms_eps``, ``n_swa`` (``attention.sliding_window``;
              > 0 makes every attention layer a sliding-window one, so llama.cpp builds a hybrid
              iSWA memory: an empty base cache, the swa cache, the recurrent state; 0, the
              default, writes no key). Heads have ``n_embd / n_head`` values.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        ValueError: an unknown ``arch`` or ``dtype``, a size below 1, or ``tie_embeddings=False``
            for ``gemma2``.
        TypeError: a keyword ``arch`` does not take.
        OSError: the file could not be written.
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    unknown = set(arch_specific) - set(_OPTIONS[arch])
    if unknown:
        raise TypeError(
            f"make_model({arch!r}) got unexpected keywords {sorted(unknown)}; it takes {sorted(_OPTIONS[arch])}"
        )
    opt = {**_OPTIONS[arch], **arch_specific}
    if dtype not in ("f32", "f16"):
        raise ValueError(f"dtype must be 'f32' or 'f16', got {dtype!r}")
    for name, value in (("n_layer", n_layer), ("n_embd", n_embd), ("n_vocab", n_vocab), ("n_ctx_train", n_ctx_train)):
        if int(value) < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")

    kv: dict[str, tuple] = {}  # key -> (value, GGUFValueType[, array subtype])
    T = gguf.GGUFValueType
    u32, f32 = (lambda v: (int(v), T.UINT32)), (lambda v: (float(v), T.FLOAT32))
    kv["general.name"] = (f"pyllamacpp synthetic {arch}", T.STRING)
    kv[f"{arch}.context_length"] = u32(n_ctx_train)
    kv[f"{arch}.embedding_length"] = u32(n_embd)
    kv[f"{arch}.block_count"] = u32(n_layer)
    kv[f"{arch}.attention.layer_norm_rms_epsilon"] = f32(opt["norm_rms_eps"])

    tensors: list[tuple[str, tuple[int, ...], str]] = [  # (name, ggml ne, kind)
        ("token_embd.weight", (n_embd, n_vocab), "w"),
        ("output_norm.weight", (n_embd,), "norm"),
    ]  # no output.weight: every arch here falls back to token_embd (TENSOR_DUPLICATED)
    if not tie_embeddings:
        if arch == "gemma2":  # models/gemma2.cpp never asks for output.weight: llama.cpp would refuse it
            raise ValueError("gemma2 always ties its output projection to token_embd: tie_embeddings must be True")
        tensors.append(("output.weight", (n_embd, n_vocab), "w"))

    if arch == "lfm2":
        n_ff = _lfm2(
            kv,
            tensors,
            opt,
            n_layer=n_layer,
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            n_ff=n_ff,
        )
    elif arch in _ATTENTION_ARCHS:
        if not n_head or n_head < 1:
            raise ValueError(f"{arch} needs n_head >= 1")
        n_head_kv = n_head if n_head_kv is None else int(n_head_kv)
        if n_head_kv < 1 or n_head % n_head_kv:
            raise ValueError(f"n_head ({n_head}) must be a multiple of n_head_kv ({n_head_kv})")
        if head_dim is None:
            if n_embd % n_head:
                raise ValueError(f"n_embd ({n_embd}) is not a multiple of n_head ({n_head}); pass head_dim")
            hd = n_embd // n_head
        else:
            hd = int(head_dim)
        if hd % 2:
            raise ValueError(f"head_dim must be even (RoPE rotates pairs), got {hd}")
        n_ff = 4 * n_embd if n_ff is None else int(n_ff)
        kv[f"{arch}.feed_forward_length"] = u32(n_ff)
        kv[f"{arch}.attention.head_count"] = u32(n_head)
        kv[f"{arch}.attention.head_count_kv"] = u32(n_head_kv)
        if head_dim is not None:
            kv[f"{arch}.attention.key_length"] = u32(hd)
            kv[f"{arch}.attention.value_length"] = u32(hd)
        kv[f"{arch}.rope.freq_base"] = f32(opt["rope_freq_base"])
        if opt.get("n_expert"):
            kv[f"{arch}.expert_count"] = u32(int(opt["n_expert"]))
            kv[f"{arch}.expert_used_count"] = u32(int(opt["n_expert_used"]))
        if arch in _SWA_DEFAULT_PATTERN:
            kv[f"{arch}.attention.sliding_window"] = u32(opt["n_swa"])
            pattern = opt["swa_pattern"]
            if pattern is None:
                pattern = _SWA_DEFAULT_PATTERN[arch]
            if isinstance(pattern, (int, np.integer)):
                kv[f"{arch}.attention.sliding_window_pattern"] = u32(pattern)
            else:
                pattern = [bool(x) for x in pattern]
                if len(pattern) != n_layer:
                    raise ValueError(f"swa_pattern has {len(pattern)} entries, expected n_layer={n_layer}")
                kv[f"{arch}.attention.sliding_window_pattern"] = (pattern, T.ARRAY, T.BOOL)
        for i in range(n_layer):
            b = f"blk.{i}."
            tensors += [
                (b + "attn_norm.weight", (n_embd,), "norm"),
                (b + "attn_q.weight", (n_embd, hd * n_head), "w"),
                (b + "attn_k.weight", (n_embd, hd * n_head_kv), "w"),
                (b + "attn_v.weight", (n_embd, hd * n_head_kv), "w"),
                (b + "attn_output.weight", (hd * n_head, n_embd), "w"),
            ]
            if arch in ("qwen3", "gemma3"):
                tensors += [(b + "attn_q_norm.weight", (hd,), "norm"), (b + "attn_k_norm.weight", (hd,), "norm")]
            if arch in ("gemma2", "gemma3"):
                tensors += [
                    (b + "post_attention_norm.weight", (n_embd,), "norm"),
                    (b + "post_ffw_norm.weight", (n_embd,), "norm"),
                ]
            n_expert = int(opt.get("n_expert") or 0)
            if n_expert:  # models/llama.cpp: a mixture of experts when expert_count > 0
                tensors += [
                    (b + "ffn_norm.weight", (n_embd,), "norm"),
                    (b + "ffn_gate_inp.weight", (n_embd, n_expert), "w32"),
                    (b + "ffn_gate_exps.weight", (n_embd, n_ff, n_expert), "w"),
                    (b + "ffn_up_exps.weight", (n_embd, n_ff, n_expert), "w"),
                    (b + "ffn_down_exps.weight", (n_ff, n_embd, n_expert), "w"),
                ]
            else:
                tensors += [
                    (b + "ffn_norm.weight", (n_embd,), "norm"),
                    (b + "ffn_gate.weight", (n_embd, n_ff), "w"),
                    (b + "ffn_up.weight", (n_embd, n_ff), "w"),
                    (b + "ffn_down.weight", (n_ff, n_embd), "w"),
                ]
    else:  # mamba: models/mamba.cpp
        if n_head or n_head_kv or head_dim or n_ff:
            raise ValueError(
                "mamba has no attention heads or feed-forward: leave n_head, n_head_kv, head_dim and n_ff unset"
            )
        d_inner = 2 * n_embd if opt["ssm_d_inner"] is None else int(opt["ssm_d_inner"])
        if d_inner != 2 * n_embd:
            raise ValueError(
                f"ssm_d_inner must be 2 * n_embd = {2 * n_embd} (llama.cpp's mamba "
                f"supports only an expansion factor of 2), got {d_inner}"
            )
        d_conv, d_state = int(opt["ssm_d_conv"]), int(opt["ssm_d_state"])
        dt_rank = math.ceil(n_embd / 16) if opt["ssm_dt_rank"] is None else int(opt["ssm_dt_rank"])
        kv[f"{arch}.ssm.conv_kernel"] = u32(d_conv)
        kv[f"{arch}.ssm.inner_size"] = u32(d_inner)
        kv[f"{arch}.ssm.state_size"] = u32(d_state)
        kv[f"{arch}.ssm.time_step_rank"] = u32(dt_rank)
        for i in range(n_layer):
            b = f"blk.{i}."
            tensors += [
                (b + "attn_norm.weight", (n_embd,), "norm"),
                (b + "ssm_in.weight", (n_embd, 2 * d_inner), "w"),
                (b + "ssm_conv1d.weight", (d_conv, d_inner), "w32"),  # ggml_ssm_conv wants f32
                (b + "ssm_conv1d.bias", (d_inner,), "zero"),
                (b + "ssm_x.weight", (d_inner, dt_rank + 2 * d_state), "w"),
                (b + "ssm_dt.weight", (dt_rank, d_inner), "w"),
                (b + "ssm_dt.bias", (d_inner,), "dt_bias"),
                (b + "ssm_a", (d_state, d_inner), "ssm_a"),  # no ".weight" for these two
                (b + "ssm_d", (d_inner,), "norm"),
                (b + "ssm_out.weight", (d_inner, n_embd), "w"),
            ]

    # llama.cpp's dummy tokenizer (llama-vocab.cpp, tokenizer_model == "test"); names must be unique
    kv["tokenizer.ggml.model"] = ("test", T.STRING)
    kv["tokenizer.ggml.tokens"] = ([f"tok_{i}" for i in range(n_vocab)], T.ARRAY, T.STRING)
    kv["tokenizer.ggml.scores"] = ([0.0] * n_vocab, T.ARRAY, T.FLOAT32)
    kv["tokenizer.ggml.token_type"] = ([1] * n_vocab, T.ARRAY, T.INT32)  # LLAMA_TOKEN_TYPE_NORMAL
    for key, extra in (metadata or {}).items():
        kind = T.BOOL if isinstance(extra, bool) else T.UINT32 if isinstance(extra, int) else T.STRING
        kv[key] = (extra, kind)

    rng = np.random.default_rng(seed)
    wtype = np.float16 if dtype == "f16" else np.float32

    def fill(writer: gguf.GGUFWriter) -> None:
        for key, (value, vtype, *sub) in kv.items():
            writer.add_key_value(key, value, vtype, sub[0] if sub else None)
        for name, ne, kind in tensors:
            writer.add_tensor(name, _weights(rng, ne, kind, wtype))

    return write_gguf(path, arch, fill, split_max_tensors)


def _lfm2(kv: dict, tensors: list, opt: dict, *, n_layer: int, n_embd: int, n_head, n_head_kv, head_dim, n_ff) -> int:
    """Metadata and tensors of models/lfm2.cpp (load_arch_hparams, load_arch_tensors), dense FFN only
    (``n_layer_dense_lead = n_layer``: no MoE layer)."""
    T = gguf.GGUFValueType
    if not n_head or n_head < 1 or n_embd % n_head:
        raise ValueError(f"lfm2 needs n_head >= 1 dividing n_embd ({n_embd})")
    if head_dim is not None:
        raise ValueError("lfm2 heads have n_embd / n_head values: leave head_dim unset")
    n_head_kv = n_head if n_head_kv is None else int(n_head_kv)
    if n_head_kv < 1 or n_head % n_head_kv:
        raise ValueError(f"n_head ({n_head}) must be a multiple of n_head_kv ({n_head_kv})")
    attn = opt["attn_layers"]
    attn = [il % 2 == 1 for il in range(n_layer)] if attn is None else [bool(x) for x in attn]
    if len(attn) != n_layer:
        raise ValueError(f"attn_layers has {len(attn)} entries, expected n_layer={n_layer}")
    l_cache = int(opt["conv_l_cache"])
    if l_cache < 2:
        raise ValueError(f"conv_l_cache must be >= 2 (GGML_ASSERT in models/lfm2.cpp), got {l_cache}")
    hd = n_embd // n_head
    n_ff = 4 * n_embd if n_ff is None else int(n_ff)
    arch = "lfm2"
    kv[f"{arch}.feed_forward_length"] = (n_ff, T.UINT32)
    kv[f"{arch}.attention.head_count"] = (n_head, T.UINT32)
    kv[f"{arch}.attention.head_count_kv"] = ([n_head_kv if a else 0 for a in attn], T.ARRAY, T.UINT32)
    kv[f"{arch}.rope.freq_base"] = (float(opt["rope_freq_base"]), T.FLOAT32)
    kv[f"{arch}.shortconv.l_cache"] = (l_cache, T.UINT32)
    if int(opt["n_swa"]) > 0:  # every attention layer slides: llama_memory_hybrid_iswa (models/lfm2.cpp)
        kv[f"{arch}.attention.sliding_window"] = (int(opt["n_swa"]), T.UINT32)
    # the final norm is named token_embd_norm (LLM_TENSOR_OUTPUT_NORM_LFM2 in llama-arch.cpp)
    tensors[1] = ("token_embd_norm.weight", (n_embd,), "norm")
    for i, is_attn in enumerate(attn):
        b = f"blk.{i}."
        tensors += [
            (b + "attn_norm.weight", (n_embd,), "norm"),
            (b + "ffn_norm.weight", (n_embd,), "norm"),
            (b + "ffn_gate.weight", (n_embd, n_ff), "w"),
            (b + "ffn_up.weight", (n_embd, n_ff), "w"),
            (b + "ffn_down.weight", (n_ff, n_embd), "w"),
        ]
        if is_attn:
            tensors += [
                (b + "attn_q_norm.weight", (hd,), "norm"),
                (b + "attn_k_norm.weight", (hd,), "norm"),
                (b + "attn_q.weight", (n_embd, n_embd), "w"),
                (b + "attn_k.weight", (n_embd, hd * n_head_kv), "w"),
                (b + "attn_v.weight", (n_embd, hd * n_head_kv), "w"),
                (b + "attn_output.weight", (n_embd, n_embd), "w"),
            ]
        else:
            tensors += [
                (b + "shortconv.conv.weight", (l_cache, n_embd), "w32"),  # ggml_ssm_conv wants f32
                (b + "shortconv.in_proj.weight", (n_embd, 3 * n_embd), "w"),
                (b + "shortconv.out_proj.weight", (n_embd, n_embd), "w"),
            ]
    return n_ff


def _weights(rng: np.random.Generator, ne: tuple[int, ...], kind: str, wtype) -> np.ndarray:
    """One tensor's data; numpy's shape is ggml's ``ne`` reversed."""
    shape = tuple(reversed(ne))
    if kind == "w":
        return rng.normal(0.0, _STD, shape).astype(wtype)
    if kind == "w32":
        return rng.normal(0.0, _STD, shape).astype(np.float32)
    if kind == "norm":
        return np.ones(shape, np.float32)
    if kind == "zero":
        return np.zeros(shape, np.float32)
    if kind == "ssm_a":  # A = -exp(A_log) with Mamba's S4D-real init: row [-1, -2, ..., -d_state]
        return np.broadcast_to(-np.arange(1, shape[-1] + 1, dtype=np.float32), shape).copy()
    if kind == "dt_bias":  # softplus^-1(dt) for dt = 0.01, Mamba's dt init range being [1e-3, 0.1]
        return np.full(shape, math.log(math.expm1(0.01)), np.float32)
    raise AssertionError(kind)


def make_lora(
    path: str | os.PathLike,
    base: str | os.PathLike,
    targets: Any,
    *,
    rank: int = 4,
    alpha: float | None = None,
    seed: int = 0,
    std: float = _STD,
    alora_invocation_tokens: Any = None,
    metadata: dict[str, str] | None = None,
) -> Path:
    """Write a LoRA adapter GGUF for the model at ``base`` to ``path`` (atomically).

    The file is what ``llama_adapter_lora_init`` reads (``src/llama-adapter.cpp``):
    ``general.type = "adapter"``, ``general.architecture`` of the base, ``adapter.type = "lora"``,
    ``adapter.lora.alpha`` when given, and for each target weight ``W`` a pair
    ``W.lora_a`` / ``W.lora_b``. llama.cpp then adds ``scale * B @ (A @ x)`` to ``W @ x``, with
    ``scale = s * alpha / rank`` for a context scale ``s`` (``s`` alone when alpha is 0 or absent).

    Shapes, in numpy order for a weight of ggml ``ne = (n_in, n_out)``: ``A`` is ``(rank, n_in)``
    and ``B`` is ``(n_out, rank)``. ``token_embd.weight`` is the exception llama.cpp makes for the
    embedding lookup: ``A`` is ``(n_vocab, rank)`` (a row per token) and ``B`` is ``(n_embd, rank)``,
    and the input of token ``t`` gains ``scale * B @ A[t]``.

    Args:
        path: where to write the adapter (a temporary name, then renamed).
        base: the model GGUF the adapter is for (read with ``gguf.GGUFReader`` for the architecture
            and the weights' shapes; :func:`make_model` output or a real model).
        targets: weight names (``"output.weight"``, ``"blk.0.attn_q.weight"``), each given random
            ``normal(0, std)`` factors of ``rank`` from ``numpy.random.default_rng(seed)``; or a
            mapping ``name -> (A, B)`` of arrays in the shapes above (written as float32).
        rank: the rank of random factors.
        alpha: ``adapter.lora.alpha``; None writes no key (llama.cpp then reads 0: no alpha / rank factor).
        seed: seed of random factors.
        std: standard deviation of random factors.
        alora_invocation_tokens: token ids for ``adapter.alora.invocation_tokens`` (an activated
            LoRA, which llama.cpp's server applies only after these tokens); None writes no key.
        metadata: more string keys and values to write (``{"general.description": ""}``).

    Returns:
        ``path`` as a ``Path``.

    Raises:
        ValueError: no targets, a name that is not a 2-D weight of ``base``, factors of the wrong
            shape, or a rank below 1.
        OSError: ``base`` could not be read or the file could not be written.
    """
    reader = gguf.GGUFReader(base)
    shapes = {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}  # ggml ne order
    arch = reader.fields["general.architecture"].contents()
    del reader  # its memmap
    if isinstance(targets, str):
        targets = [targets]
    given = dict(targets) if hasattr(targets, "items") else {name: None for name in targets}
    if not given:
        raise ValueError("make_lora needs at least one target weight")
    if int(rank) < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    rng = np.random.default_rng(seed)
    arrays: list[tuple[str, np.ndarray]] = []
    for name, ab in given.items():
        ne = shapes.get(name)
        if ne is None or len(ne) != 2:
            weights = sorted(n for n, s in shapes.items() if len(s) == 2)
            raise ValueError(f"{name!r} is not a 2-D weight of {base}; it has {', '.join(weights[:8])} ...")
        n_in, n_out = ne
        if ab is None:
            a_shape, b_shape = (
                ((n_out, rank), (n_in, rank)) if name == "token_embd.weight" else ((rank, n_in), (n_out, rank))
            )
            a = rng.normal(0.0, std, a_shape).astype(np.float32)
            b = rng.normal(0.0, std, b_shape).astype(np.float32)
        else:
            a, b = (np.ascontiguousarray(x, dtype=np.float32) for x in ab)
            r = a.shape[-1] if name == "token_embd.weight" else a.shape[0]
            want = ((n_out, r), (n_in, r)) if name == "token_embd.weight" else ((r, n_in), (n_out, r))
            if (a.shape, b.shape) != want:
                raise ValueError(f"{name}: A {a.shape} and B {b.shape}, expected {want[0]} and {want[1]}")
        arrays += [(f"{name}.lora_a", a), (f"{name}.lora_b", b)]

    def fill(writer: gguf.GGUFWriter) -> None:
        writer.add_type("adapter")
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_string("general.name", f"pyllamacpp synthetic LoRA for {Path(base).name}")
        if alpha is not None:
            writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
        for key, value in (metadata or {}).items():
            writer.add_key_value(key, value, gguf.GGUFValueType.STRING)  # add_string drops ""
        if alora_invocation_tokens is not None:
            toks = [int(t) for t in alora_invocation_tokens]
            writer.add_key_value(
                gguf.Keys.Adapter.ALORA_INVOCATION_TOKENS, toks, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT32
            )
        for name, arr in arrays:
            writer.add_tensor(name, arr)

    return write_gguf(path, arch, fill)
