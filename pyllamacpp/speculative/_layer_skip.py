"""A layer-skip draft's GGUF: the target's first layers and its own head (:func:`layer_skip_gguf`)."""

from __future__ import annotations

import json
import os
from pathlib import Path


def layer_skip_gguf(source: str | os.PathLike, n_layer: int, *, cache: str | os.PathLike | None = None) -> Path:
    """Write (once) a GGUF of ``source``'s first ``n_layer`` layers and return its path.

    The tensors of layers ``n_layer`` and above (``blk.<il>.*``) are left out, ``block_count``
    becomes ``n_layer``, per-layer metadata arrays are cut to ``n_layer`` entries, and every other
    tensor (embeddings, output norm, output head) and key is copied as it is, quantized data
    included, with the ``gguf`` package (as ``gguf_new_metadata.py`` copies a file). The file goes
    under ``$PYLLAMACPP_CACHE/models/layer-skip`` (default ``~/.cache/pyllamacpp/...``), written
    to a temporary name and renamed; a sidecar ``.source`` names the source's path, size and
    mtime, and the file is written again when they change.

    Args:
        source: The target's GGUF.
        n_layer: How many of its first layers to keep.
        cache: The folder to write into instead of the cache's.

    Returns:
        The path of the layer-skip GGUF.

    Raises:
        ValueError: ``n_layer`` is not between 1 and the source's layers - 1, or the source has
            no ``<arch>.block_count``.
        OSError: A file cannot be read or written.
    """
    import gguf

    from .._fetch import cache_dir
    from .._gguf_writer import write_gguf

    src = Path(source).resolve()
    st = src.stat()
    ident = {"source": str(src), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "n_layer": int(n_layer), "v": 1}
    folder = Path(cache) if cache is not None else cache_dir() / "models" / "layer-skip"
    out = folder / f"{src.stem}.first{int(n_layer)}.gguf"
    side = out.with_name(out.name + ".source")
    if out.is_file() and side.is_file():
        try:
            if json.loads(side.read_text()) == ident:
                return out
        except ValueError:
            pass
    reader = gguf.GGUFReader(src)
    arch_f = reader.fields.get("general.architecture")
    if arch_f is None:
        raise ValueError(f"{src.name}: no general.architecture")
    arch = str(arch_f.contents())
    bc = reader.fields.get(f"{arch}.block_count")
    if bc is None:
        raise ValueError(f"{src.name}: no {arch}.block_count")
    n_src = int(bc.contents())
    if not 1 <= n_layer < n_src:
        raise ValueError(f"n_layer must be in [1, {n_src - 1}] for {src.name} ({n_src} layers), got {n_layer}")

    def fill(writer: gguf.GGUFWriter) -> None:
        for f in reader.fields.values():
            name = f.name
            if name == "general.architecture" or name.startswith("GGUF."):
                continue  # written by GGUFWriter itself
            vtype = f.types[0]
            sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            value = f.contents()
            if name == "general.alignment":
                writer.add_custom_alignment(int(value))
                continue
            if name == f"{arch}.block_count":
                value = int(n_layer)
            elif name == "general.name":
                value = f"{value} (first {n_layer} of {n_src} layers)"
            elif sub is not None and name.startswith(f"{arch}.") and isinstance(value, list) and len(value) == n_src:
                value = value[:n_layer]  # one entry per layer (head counts, window pattern ...)
            writer.add_key_value(name, value, vtype, sub_type=sub)
        for t in reader.tensors:
            if not _dropped_layer(t.name, n_layer):  # the bytes as they are, quantized blocks included
                writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type, tensor_endianess=reader.endianess)

    write_gguf(out, arch, fill)
    side.write_text(json.dumps(ident) + "\n")
    return out


def _dropped_layer(name: str, n_layer: int) -> bool:
    if not name.startswith("blk."):
        return False
    il = name.split(".", 2)[1]
    return il.isdigit() and int(il) >= n_layer
