"""Control vectors: what ``llama_set_adapter_cvec`` takes, from an array, a dict or a GGUF file.

The file format is the one llama.cpp's ``cvector-generator`` writes and ``common_control_vector_load``
(common/common.cpp) reads: F32 1-D tensors named ``direction.<il>`` (``il >= 1``; several for one
layer add up), each ``n_embd`` long. The buffer llama.cpp takes starts at layer 1: row ``il - 1``
holds layer ``il``'s vector. Imports only numpy and ``gguf``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np
import numpy.typing as npt

__all__ = ["control_vector_data", "read_control_vector", "write_control_vector"]


def read_control_vector(path: str | os.PathLike, strength: float = 1.0) -> dict[int, np.ndarray]:
    """The ``direction.<il>`` tensors of a control-vector GGUF, as ``common_control_vector_load_one``
    reads them: ``{il: strength * sum of that layer's tensors}``.

    Args:
        path: The GGUF file.
        strength: Multiplies every vector.

    Returns:
        Layer -> float32 ``(n_embd,)`` vector.

    Raises:
        ValueError: Not a GGUF file (the message names it and says what gguf's reader found), or
            a tensor that is not ``direction.<il>`` with ``il >= 1``, not F32, not 1-D, or of
            another length than the others.
        OSError: The file cannot be read.
    """
    import gguf

    try:
        reader = gguf.GGUFReader(os.fspath(path))
    except OSError:
        raise
    except Exception as e:  # noqa: BLE001 - gguf's reader raises ValueError, IndexError... without the file
        raise ValueError(f"{path}: not a GGUF file that gguf can read ({e})") from e
    out: dict[int, np.ndarray] = {}
    n_embd = None
    for t in reader.tensors:
        head, _, tail = t.name.partition(".")
        if head != "direction" or not tail.isdigit():
            raise ValueError(f"{path}: tensor {t.name!r} is not direction.<layer>")
        il = int(tail)
        if il == 0:
            raise ValueError(f"{path}: direction.0: layer 0 has no control vector")
        if t.tensor_type != gguf.GGMLQuantizationType.F32 or len(t.shape) != 1:
            raise ValueError(f"{path}: {t.name} must be a 1-D F32 tensor")
        v = np.asarray(t.data, dtype=np.float32).reshape(-1)
        if n_embd is None:
            n_embd = v.size
        elif v.size != n_embd:
            raise ValueError(f"{path}: {t.name} has {v.size} values, the others {n_embd}")
        out[il] = out.get(il, np.zeros(v.size, np.float32)) + v * np.float32(strength)
    return out


def write_control_vector(path: str | os.PathLike, vectors: Mapping[int, npt.ArrayLike], arch: str = "llama") -> None:
    """Write ``{il: vector}`` as a control-vector GGUF (``direction.<il>`` tensors), the format
    ``cvector-generator`` writes and :func:`read_control_vector` (and llama.cpp) reads.

    Args:
        path: The file to write.
        vectors: Layer (>= 1) -> ``(n_embd,)`` vector.
        arch: ``general.architecture`` (cvector-generator writes the model's).

    Raises:
        ValueError: A layer below 1, or vectors of different lengths.
    """
    import gguf

    if any(int(il) < 1 for il in vectors):
        raise ValueError("control vectors start at layer 1")
    sizes = {np.asarray(v).size for v in vectors.values()}
    if len(sizes) > 1:
        raise ValueError(f"vectors of different lengths {sorted(sizes)}")
    w = gguf.GGUFWriter(os.fspath(path), arch)
    w.add_string("general.type", "controlvector")  # as cvector-generator's export_gguf
    w.add_string("controlvector.model_hint", arch)
    w.add_int32("controlvector.layer_count", len(vectors))
    for il in sorted(vectors):
        w.add_tensor(f"direction.{int(il)}", np.asarray(vectors[il], dtype=np.float32).reshape(-1))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def control_vector_data(
    vector: npt.ArrayLike | Mapping[int, npt.ArrayLike] | str | os.PathLike,
    *,
    n_layer: int,
    n_embd: int,
    strength: float = 1.0,
) -> np.ndarray:
    """The buffer ``llama_set_adapter_cvec`` takes: ``(n_layer - 1) x n_embd`` float32, row 0 is
    layer 1, zeros where a layer has no vector.

    Args:
        vector: A ``(n_layer - 1, n_embd)`` array, a ``{layer: vector}`` dict, or a GGUF path.
        n_layer: The model's layer count.
        n_embd: The model's embedding size.
        strength: Multiplies the vector.

    Returns:
        A C-contiguous float32 array of ``(n_layer - 1) * n_embd`` values.

    Raises:
        ValueError: Another width than ``n_embd``, a layer outside ``1..n_layer - 1``, or a bad file.
    """
    if isinstance(vector, (str, os.PathLike)):
        vector = read_control_vector(vector, strength)
        strength = 1.0
    data = np.zeros((n_layer - 1, n_embd), np.float32)
    if isinstance(vector, Mapping):
        for il, v in vector.items():
            il = int(il)
            if not 1 <= il < n_layer:
                raise ValueError(f"control vector for layer {il}: the model's layers with one are 1..{n_layer - 1}")
            a = np.asarray(v, dtype=np.float32).reshape(-1)
            if a.size != n_embd:
                raise ValueError(f"control vector for layer {il} has {a.size} values, the model's n_embd is {n_embd}")
            data[il - 1] = a
    else:
        a = np.asarray(vector, dtype=np.float32)
        if a.shape != data.shape:
            raise ValueError(f"a control vector array must be (n_layer - 1, n_embd) = {data.shape}, got {a.shape}")
        data[:] = a
    if strength != 1.0:
        data *= np.float32(strength)
    return data.reshape(-1)
