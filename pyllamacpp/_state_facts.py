"""What a :class:`~pyllamacpp.context.Context`'s dumps do not say about themselves: its
model's memory and layer map, flash attention (the V layout), and the sidecar facts that make a
dump self-describing. ``StateFacts`` is a base of ``StateMethods`` (context_state.py)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from ._lib import lib
from ._state_types import _StateBase


def _kv_has_v(m) -> bool:
    """Whether model ``m``'s KV caches hold V: the llama_kv_cache constructor makes V tensors,
    and state_write_data writes V records, unless hparams.is_mla() (attention.key_length_mla and
    value_length_mla both set)."""
    return not all(int(m.meta(f"{m.arch}.attention.{x}_length_mla") or 0) for x in ("key", "value"))


def _model_memory(m) -> tuple[str | None, dict | None]:
    """(memory, layer map) of model ``m`` from llama.cpp's metadata (llama_model_meta_val_str).
    Not from the GGUF through gguf.GGUFReader, which reads the whole vocabulary (~2 s for 49k
    tokens): only an array key the rule needs is read there (llama.cpp's metadata leaves arrays
    out), as ``Model._meta_list`` does for per-layer head counts."""
    from .state import layer_map, memory_of
    from .state._layers import arch_keys, rule_keys
    from .state._sidecar import gguf_field

    arch = m.arch

    def num(key: str) -> int | None:
        v = m.meta(f"{arch}.{key}")
        return int(v) if v is not None and v.strip().lstrip("-").isdigit() else None

    # every key the rule reads, None when absent: scalars from the metadata; the arch's own keys
    # (arrays among them) from the GGUF when the metadata lacks them
    own = arch_keys(arch)
    fields = {"general.architecture": arch}
    for k in rule_keys(arch):
        v = m.kv_head_counts() if k == "attention.head_count_kv" else num(k)
        if v is None and k in own and m.path is not None:
            v = gguf_field(m.path, f"{arch}.{k}")
        fields[f"{arch}.{k}"] = v
    layers = layer_map(fields)
    return memory_of(layers), layers


class StateFacts(_StateBase):
    """Flash attention, memory and layer map, sidecar facts of a Context (see the module docstring)."""

    @property
    def flash_attn(self) -> bool:
        """Whether flash attention is on: ``"auto"`` resolved as llama.cpp logged it when the
        context was created (``llama_init_from_model``), else the ``flash_attn_type`` asked for.
        It decides the V layout of a dump (``v_trans``)."""
        for _, text in self.creation_log:
            if "Flash Attention enabled" in text:
                return True
            if "Flash Attention disabled" in text:
                return False
        return self.params.flash_attn_type == lib.LLAMA_FLASH_ATTN_TYPE_ENABLED

    def sidecar_facts(self, tokens: npt.ArrayLike | None = None, *, flags: int = 0) -> dict:
        """What a dump of this context does not say about itself, for a ``pyllamacpp.state``
        sidecar: model name and sha256 prefix, architecture, layer map, head sizes, K/V types,
        flash attention, ``kv_unified``, ``n_ctx``, the llama.cpp commit. No llama.cpp call
        beyond the model's metadata (``llama_model_meta_val_str``).

        Args:
            tokens: the token ids the dump holds, recorded when given.
            flags: the ``llama_state_seq_flags`` the dump is made with (PARTIAL_ONLY, ON_DEVICE).

        Returns:
            A JSON-ready dict (``pyllamacpp.state.write_sidecar`` takes it as keywords).

        Raises:
            ClosedError: the context or its model is closed.
        """
        from ._lib import EXTENSION_INFO
        from .params import ggml_type_name
        from .state import model_facts

        m = self.model
        if getattr(m, "_sha256_prefix", None) is None:
            m._sha256_prefix = model_facts(str(m.path), sha256=True)["model_sha256"]
        k_len, v_len = m.kv_head_sizes()
        # llama_model_n_head_kv is layer 0's count (0 when layer 0 has no attention): give the
        # attention layers' count when they agree, and the layer map the parser uses for il
        heads = {n for n in m.kv_head_counts() if n > 0}
        facts = {
            "model": m.path.name,
            "model_sha256": m._sha256_prefix,
            "arch": m.arch,
            "n_layer": m.n_layer,
            "n_head_kv": heads.pop() if len(heads) == 1 else None,
            "layers": self._memory_layers()[1],  # the map check_state uses
            "n_embd_head_k": k_len,
            "n_embd_head_v": v_len,
            "type_k": ggml_type_name(self.params.type_k),
            "type_v": ggml_type_name(self.params.type_v),
            "flash_attn": self.flash_attn,
            "kv_unified": bool(self.params.kv_unified),
            "n_ctx": self.n_ctx,
            "llama_cpp_commit": EXTENSION_INFO.get("llama_cpp_commit"),
            "flags": int(flags),
        }
        if tokens is not None:
            facts["tokens"] = [int(t) for t in np.asarray(tokens).reshape(-1)]
        return facts

    def _memory_layers(self) -> tuple[str | None, dict | None]:
        """This context's memory as pyllamacpp.state names it (kv, iswa, hybrid, hybrid-iswa,
        recurrent) and its layer map (state._layers); (None, None) for an architecture whose rule
        that module does not know. Read once per context."""
        if self._memory_layers_cache is None:
            self._memory_layers_cache = _model_memory(self.model)
        return self._memory_layers_cache

    def _partial_differs(self) -> bool:
        """Whether PARTIAL_ONLY changes what this context's memory writes and reads (iSWA, hybrid,
        dsa-iswa, hybrid-idx, dsv4 memories; plain KV caches, recurrent memories, dsa and msa
        ignore the flag)."""
        memory, _ = self._memory_layers()
        if memory is None:
            return not self._plain_kv
        from .state import written_parts  # what each memory writes with and without the flag

        return written_parts(memory, True) != written_parts(memory, False)
