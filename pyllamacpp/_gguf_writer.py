"""Write a GGUF file atomically with ``gguf.GGUFWriter`` (the support layer's one GGUF writer).

Used by :mod:`pyllamacpp.testing` (synthetic models and LoRA adapters) and by the layer-skip
drafts of :mod:`pyllamacpp.speculative`. Imports only ``gguf``: nothing here needs the compiled
extension.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path

import gguf

__all__ = ["write_gguf"]


def write_gguf(
    path: str | os.PathLike, arch: str, fill: Callable[[gguf.GGUFWriter], None], split_max_tensors: int = 0
) -> Path:
    """Write a GGUF whose keys and tensors ``fill`` adds, atomically.

    The file is written to a temporary name beside ``path`` and renamed onto it once whole, so a
    reader never sees half a file (a split model is written as its shards, in place). The header,
    the key-value data and the tensors go out in ``gguf.GGUFWriter``'s order, as
    ``convert_hf_to_gguf.py`` writes them.

    Args:
        path: Where to write the file (its folder is created).
        arch: ``general.architecture``.
        fill: Adds the keys and tensors to the writer (``add_key_value``, ``add_tensor``...).
        split_max_tensors: Tensors per shard (``gguf-split``'s ``--split-max-tensors``); 0: one file.

    Returns:
        The file written: ``path``, or the first shard of a split model.

    Raises:
        OSError: The file could not be written (the temporary file is removed).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # a unique name beside the target; created by the writer, so it gets the umask's permissions
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    split = split_max_tensors > 0
    writer = gguf.GGUFWriter(path if split else tmp, arch, split_max_tensors=split_max_tensors)
    try:
        fill(writer)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        shards = writer.format_shard_names(path) if split else []
        writer.close()
        if split:
            return shards[0]
        os.replace(tmp, path)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return path
