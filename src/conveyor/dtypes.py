"""One dtype vocabulary for the simulator, the benchmarks and the command line, and the one
accumulation rule of Conveyor's matmuls.

Each dtype has a long (NumPy / JAX) name and a short one; both are accepted everywhere, and
`canonical` maps either to the long name. Anything else is a ValueError listing what is known.
"""

from __future__ import annotations

import jax.numpy as jnp


def accumulation_dtype(*dtypes):
    """The dtype a matmul of these operand dtypes accumulates in: their promoted type, widened to
    float32 for floats narrower than 32 bits (bf16, f16, fp8) and to int32 for narrower ints."""
    dt = jnp.dtype(jnp.result_type(*dtypes))
    if dt.itemsize >= 4:
        return dt
    return jnp.dtype(jnp.float32) if jnp.issubdtype(dt, jnp.floating) else jnp.dtype(jnp.int32)


# long name -> (short name, bytes per element)
_KNOWN = {
    "bfloat16": ("bf16", 2),
    "float16": ("f16", 2),
    "float32": ("f32", 4),
    "float8_e4m3fn": ("fp8", 1),
    "int8": ("int8", 1),
    "int32": ("int32", 4),
}
_ALIASES = {
    **{long: long for long in _KNOWN},
    **{short: long for long, (short, _) in _KNOWN.items()},
    "fp16": "float16",
}

# The dtypes the benchmarks measure: Conveyor's matmuls take these as inputs (f32 accumulation).
MEASURED = ("float32", "bfloat16", "float16")


def known() -> str:
    """The accepted spellings, for error messages: 'bf16/bfloat16, f16/float16, ...'."""
    return ", ".join(
        long if short == long else f"{short}/{long}" for long, (short, _) in _KNOWN.items()
    )


def canonical(name: str) -> str:
    """The long name of `name` ('bf16' -> 'bfloat16'); a ValueError names the accepted spellings."""
    try:
        return _ALIASES[str(name)]
    except KeyError:
        raise ValueError(f"dtype: unknown {name!r}; known: {known()}") from None


def short(name: str) -> str:
    """The short name of `name` ('bfloat16' -> 'bf16'), the key of the hardware models' rates."""
    return _KNOWN[canonical(name)][0]


def itemsize(name: str) -> int:
    """Bytes per element of `name`."""
    return _KNOWN[canonical(name)][1]
