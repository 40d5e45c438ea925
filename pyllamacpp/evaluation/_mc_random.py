"""How llama-perplexity picks its tasks, in Python: ``std::mt19937`` seeded with 1, libstdc++'s
``std::uniform_int_distribution`` (HellaSwag) and the float scaling of Winogrande and the
multiple-choice mode (tools/perplexity/perplexity.cpp).

- :class:`MT19937`: the 32-bit Mersenne Twister as ``std::mt19937(seed)`` seeds it (Knuth's
  initialisation, ``mt[i] = 1812433253 * (mt[i-1] ^ (mt[i-1] >> 30)) + i``). Not numpy's
  ``MT19937(seed)``, which seeds through a SeedSequence.
- :func:`uniform_int`: ``std::uniform_int_distribution<size_t>(a, b)(rng)`` as libstdc++ 11 and
  later compute it from a 32-bit engine: Lemire's nearly divisionless method (bits/uniform_int_dist.h,
  ``_S_nd``), one engine call per value except on a rejection.
- :func:`float_index`: ``int(scale * rng() * n)`` with ``scale = 1 / (1.f + (float)rng.max())``,
  each product in float as there.
- :func:`hellaswag_order`, :func:`pick_without_replacement`: the two selection loops.

Other standard libraries (libc++, MSVC's, libstdc++ before GCC 11) implement the distribution
differently and pick other HellaSwag tasks; the float scaling is the same everywhere.
"""

from __future__ import annotations

import numpy as np

_MASK32 = 0xFFFFFFFF


class MT19937:
    """``std::mt19937``: the 32-bit Mersenne Twister (MT19937 of Matsumoto and Nishimura).

    Args:
        seed: The seed, as ``std::mt19937 rng(seed)`` (llama-perplexity uses 1).
    """

    _N, _M = 624, 397

    def __init__(self, seed: int = 5489) -> None:
        mt = [0] * self._N
        mt[0] = seed & _MASK32
        for i in range(1, self._N):
            prev = mt[i - 1]
            mt[i] = (1812433253 * (prev ^ (prev >> 30)) + i) & _MASK32
        self._mt = mt
        self._i = self._N

    def _twist(self) -> None:
        mt, n, m = self._mt, self._N, self._M
        for i in range(n):
            y = (mt[i] & 0x80000000) | (mt[(i + 1) % n] & 0x7FFFFFFF)
            v = mt[(i + m) % n] ^ (y >> 1)
            mt[i] = v ^ 0x9908B0DF if y & 1 else v
        self._i = 0

    def __call__(self) -> int:
        """The next 32-bit output (``rng()``).

        Returns:
            An int in ``[0, 2**32)``.
        """
        if self._i >= self._N:
            self._twist()
        y = self._mt[self._i]
        self._i += 1
        y ^= y >> 11
        y ^= (y << 7) & 0x9D2C5680
        y ^= (y << 15) & 0xEFC60000
        return y ^ (y >> 18)


def uniform_int(rng: MT19937, a: int, b: int) -> int:
    """``std::uniform_int_distribution<size_t>(a, b)(rng)`` with libstdc++'s algorithm (GCC >= 11).

    Args:
        rng: The engine (32-bit outputs).
        a: The smallest value.
        b: The largest value (``b >= a``).

    Returns:
        An int in ``[a, b]``.

    Raises:
        ValueError: ``b < a``.
    """
    if b < a:
        raise ValueError(f"uniform_int: b {b} < a {a}")
    urange = b - a
    if urange < _MASK32:  # downscaling: 32-bit engine, 64-bit product (_S_nd)
        erange = urange + 1
        product = rng() * erange
        low = product & _MASK32
        if low < erange:
            threshold = (-erange & _MASK32) % erange
            while low < threshold:
                product = rng() * erange
                low = product & _MASK32
        return a + (product >> 32)
    if urange == _MASK32:
        return a + rng()
    # upscaling (ranges past 2**32), as libstdc++: high words from a recursive call, low from the engine
    while True:
        tmp = (_MASK32 + 1) * uniform_int(rng, 0, urange // (_MASK32 + 1))
        ret = (tmp + rng()) & 0xFFFFFFFFFFFFFFFF
        if not (ret > urange or ret < tmp):
            return a + ret


_F32 = np.float32
_SCALE = _F32(1.0) / (_F32(1.0) + _F32(float(_MASK32)))  # 1/(1.f + (float)rng.max()): 2**-32


def float_index(rng: MT19937, n: int) -> int:
    """``int(scale * rng() * n)`` in float, as Winogrande's and the multiple-choice mode's
    selection compute an index into their ``n`` remaining tasks.

    ``rng()`` rounds to float, so an output within 128 of 2**32 gives ``n`` (llama-perplexity then
    reads past its vector, undefined behaviour; one draw in 33 million): this returns ``n - 1``.

    Args:
        rng: The engine.
        n: How many tasks remain.

    Returns:
        An index in ``[0, n)``.
    """
    with np.errstate(all="ignore"):
        j = int(_SCALE * _F32(rng()) * _F32(n))
    return min(j, n - 1)


def hellaswag_order(n_available: int, n_tasks: int, seed: int = 1) -> list[int]:
    """The tasks ``hellaswag_score`` picks, in the order it scores them.

    Each pick draws ``uniform_int_distribution(0, remaining - 1)`` and erases the task picked from
    the remaining ones, so no task is picked twice.

    Args:
        n_available: Tasks in the file.
        n_tasks: Tasks to pick (at most ``n_available``).
        seed: The engine's seed (1 there).

    Returns:
        Indices into the file's tasks.
    """
    rng = MT19937(seed)
    remaining = list(range(n_available))
    return [remaining.pop(uniform_int(rng, 0, len(remaining) - 1)) for _ in range(min(n_tasks, n_available))]


def pick_without_replacement(n_available: int, n_tasks: int, seed: int = 1) -> list[int]:
    """The tasks ``winogrande_score`` and ``multiple_choice_score`` pick for ``N`` < all tasks.

    ``j = float_index(rng, len(aux))``; the task is ``aux[j]``; ``aux[j]`` is replaced by the last
    entry, which is popped.

    Args:
        n_available: Tasks in the file.
        n_tasks: Tasks to pick (at most ``n_available``).
        seed: The engine's seed (1 there).

    Returns:
        Indices into the file's tasks, in the order they are scored.
    """
    rng = MT19937(seed)
    aux = list(range(n_available))
    out = []
    for _ in range(min(n_tasks, n_available)):
        j = float_index(rng, len(aux))
        out.append(aux[j])
        aux[j] = aux[-1]
        aux.pop()
    return out
