"""llama-perplexity's float arithmetic for the multiple-choice modes, bit for bit, in numpy.

tools/perplexity/perplexity.cpp scores a token of an ending in two ways:

- ``compute_logprobs`` (every row but the common prefix's last): ``max``, then ``sum_p`` of
  ``expf(x - max)`` accumulated in **float**, one term after the other, then
  ``x[t] - max - logf(sum_p)`` in float;
- ``softmax`` (the common prefix's last row, HellaSwag and the multiple-choice mode): the
  ``expf(x - max)`` summed in double, ``p[t] = (float)(e[t] / sum)``, then ``logf(p[t])``.

A float sum of 49,152 terms, one after the other, is off the exact sum by up to ~3e-3 relative,
so any other arithmetic moves Winogrande's printed scores (``%10.6f``) and can flip a near tie.
Here: :func:`expf` is the C library's ``expf`` of glibc 2.27 and later (and musl), the table
algorithm of ARM's optimized-routines, rewritten in numpy double operations, with the one FMA
that matters (the reduced argument ``r``) done exactly; checked against glibc's ``expf`` on every
float in [-103.97, 0] (no difference). The float sums are ``np.cumsum`` (sequential, in float32).
``logf`` is the C library's own, through ctypes (one call per row).

About 0.5 ms per row of 49,152 logits, so HellaSwag and the multiple-choice mode use it only for
the tasks whose two best endings come within :func:`tie_margin` of each other in the fast C path
(:func:`pyllamacpp.scoring.log_softmax`); Winogrande prints its scores, so all its rows go here.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
from collections.abc import Callable

import numpy as np

_H = float.fromhex
# e_exp2f_data.c: tab[i] = bits of 2^(i/32) minus (i << 47); EXP2F_TABLE_BITS = 5
_T = np.array(
    [
        0x3FF0000000000000, 0x3FEFD9B0D3158574, 0x3FEFB5586CF9890F, 0x3FEF9301D0125B51,
        0x3FEF72B83C7D517B, 0x3FEF54873168B9AA, 0x3FEF387A6E756238, 0x3FEF1E9DF51FDEE1,
        0x3FEF06FE0A31B715, 0x3FEEF1A7373AA9CB, 0x3FEEDEA64C123422, 0x3FEECE086061892D,
        0x3FEEBFDAD5362A27, 0x3FEEB42B569D4F82, 0x3FEEAB07DD485429, 0x3FEEA47EB03A5585,
        0x3FEEA09E667F3BCD, 0x3FEE9F75E8EC5F74, 0x3FEEA11473EB0187, 0x3FEEA589994CCE13,
        0x3FEEACE5422AA0DB, 0x3FEEB737B0CDC5E5, 0x3FEEC49182A3F090, 0x3FEED503B23E255D,
        0x3FEEE89F995AD3AD, 0x3FEEFF76F2FB5E47, 0x3FEF199BDD85529C, 0x3FEF3720DCEF9069,
        0x3FEF5818DCFBA487, 0x3FEF7C97337B9B5F, 0x3FEFA4AFA2A490DA, 0x3FEFD0765B6E4540,
    ],
    dtype=np.uint64,
)  # fmt: skip
_INV_LN2_N = _H("0x1.71547652b82fep+0") * 32
_SHIFT = _H("0x1.8p+52")
_C0 = _H("0x1.c6af84b912394p-5") / 32 / 32 / 32
_C1 = _H("0x1.ebfce50fac4f3p-3") / 32 / 32
_C2 = _H("0x1.62e42ff0c52d6p-1") / 32
# _INV_LN2_N split in two halves of 26 bits (Veltkamp): each times a float's 24 bits is exact
_SPLIT = _INV_LN2_N * 134217729.0
_INV_HI = _SPLIT - (_SPLIT - _INV_LN2_N)
_INV_LO = _INV_LN2_N - _INV_HI
_UNDERFLOW = np.float32(_H("-0x1.9fe368p6"))  # below log(2^-150): expf is 0
_SH47 = np.uint64(47)


def expf(x: np.ndarray) -> np.ndarray:
    """glibc's ``expf`` of each element of a float32 array (for the non-positive arguments that
    ``x - max`` gives; NaN stays NaN, -inf gives 0).

    Args:
        x: float32 values, at most 0.

    Returns:
        float32 ``expf(x)``, bit for bit as glibc (2.27 and later) computes it.
    """
    xd = x.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):  # -inf gives nan here, and 0 below
        return _expf(x, xd)


def _expf(x: np.ndarray, xd: np.ndarray) -> np.ndarray:
    kd = _INV_LN2_N * xd + _SHIFT  # round(x * 32 / ln 2) in the low bits
    ki = kd.view(np.uint64)
    kd = kd - _SHIFT
    # r = fma(InvLn2N, x, -kd), as glibc's FMA build computes it: two exact products, one rounding
    r = (_INV_HI * xd - kd) + _INV_LO * xd
    s = (_T[ki & np.uint64(31)] + (ki << _SH47)).view(np.float64)
    y = (_C0 * r + _C1) * (r * r) + (_C2 * r + 1.0)
    out = (y * s).astype(np.float32)
    out[x < _UNDERFLOW] = 0.0
    return out


def _load_logf() -> Callable[[float], float] | None:
    for name in ("libm.so.6", ctypes.util.find_library("m"), "ucrtbase", "msvcrt"):
        if not name:
            continue
        try:
            f = ctypes.CDLL(name).logf
        except (OSError, AttributeError):
            continue
        f.argtypes, f.restype = [ctypes.c_float], ctypes.c_float
        return f
    return None


_logf_c = _load_logf()


def logf(x: float | np.floating) -> np.float32:
    """The C library's ``logf`` (``std::log`` of a float), through ctypes.

    Args:
        x: A float32 value.

    Returns:
        Its natural logarithm, as float32 (where no C library is found: the double log, rounded).
    """
    if _logf_c is not None:
        return np.float32(_logf_c(float(x)))
    with np.errstate(all="ignore"):
        return np.float32(np.log(np.float64(x)))


def eval_rows(rows: np.ndarray, targets: np.ndarray, chunk: int = 16) -> np.ndarray:
    """``compute_logprobs`` of each row for its own target: ``x[t] - max - logf(sum_p)``, ``sum_p``
    the float sum of ``expf(x - max)`` one term after the other; several rows at a time.

    Args:
        rows: float32 ``(n, n_vocab)`` logits.
        targets: ``(n,)`` tokens, one per row.
        chunk: Rows per numpy pass (bounds the float64 temporaries to ``chunk * n_vocab * 8`` bytes).

    Returns:
        float32 ``(n,)`` log-probabilities.
    """
    n = rows.shape[0]
    out = np.empty(n, np.float32)
    for r0 in range(0, n, chunk):
        x = rows[r0 : r0 + chunk]
        d = x - x.max(axis=1, keepdims=True)
        sums = np.cumsum(expf(d), axis=1, dtype=np.float32)[:, -1]  # each row's terms in order, in float
        t = targets[r0 : r0 + chunk]
        logs = np.array([logf(v) for v in sums], np.float32)
        out[r0 : r0 + x.shape[0]] = d[np.arange(x.shape[0]), t] - logs
    return out


def first_logprobs(row: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """``std::log(softmax(row)[t])``: the probabilities from a double sum, each rounded to float.

    Args:
        row: float32 ``(n_vocab,)`` logits (the common prefix's last row).
        targets: Tokens whose log-probability to return.

    Returns:
        float32 log-probabilities, one per target.
    """
    e = expf(row - row.max())
    sum_exp = np.cumsum(e, dtype=np.float64)[-1]
    p = (e[targets].astype(np.float64) / sum_exp).astype(np.float32)
    return np.array([logf(v) for v in p], np.float32)


def tie_margin(n_vocab: int) -> float:
    """How far apart two endings' mean log-probabilities in the fast C path must be for
    llama-perplexity's float arithmetic to order them the same way.

    A float sum of ``n`` positive terms is within ``n * 2^-24`` (relative) of the exact one, so each
    token's log-probability within about that (plus a few float roundings); two endings' means
    move by at most twice as much.

    Args:
        n_vocab: Terms in each row's sum.

    Returns:
        The margin, in nats.
    """
    return 2.0 * (n_vocab * 2.0**-24 * 1.05 + 1e-4)


def c_format(value: float, spec: str) -> str:
    """``printf``'s ``%<spec>f`` of a double, NaN as glibc prints it (``-nan`` for the x86
    default NaN that 0/0 gives, ``nan`` otherwise).

    Args:
        value: The value.
        spec: Width and precision, as in ``"10.6"``.

    Returns:
        The formatted text.
    """
    if math.isnan(value):
        text = "-nan" if math.copysign(1.0, value) < 0 else "nan"
        width = int(spec.split(".")[0] or 0)
        return text.rjust(width)
    return format(value, spec + "f")


NEG_NAN = math.copysign(math.nan, -1.0)  # what 0.f / 0.f gives on x86 (printed "-nan")
