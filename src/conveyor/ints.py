"""Integer arithmetic shared by plans, kernels and tilings, for Python or traced ints.

Design notes: docs/internals/core.md, section `ints.py`.
"""

from __future__ import annotations

from jax import lax

Int = int  # or a traced int32 scalar


def cdiv(a: int, b: int) -> int:
    """Ceiling of a / b for Python ints (b > 0)."""
    return -(-a // b)


def floordiv(a, b):
    """a // b for non-negative ints, Python or traced."""
    if isinstance(a, int) and isinstance(b, int):
        return a // b
    return lax.div(*_same_dtype(a, b))


def mod(a, b):
    """a % b for non-negative ints, Python or traced."""
    if isinstance(a, int) and isinstance(b, int):
        return a % b
    return lax.rem(*_same_dtype(a, b))


def _same_dtype(a, b):
    dtype = lax.dtype(b if isinstance(a, int) else a)
    return lax.convert_element_type(a, dtype), lax.convert_element_type(b, dtype)
