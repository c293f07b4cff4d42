"""cv.dot: one matmul written once for pipeline bodies, lowered to each backend's matrix unit.

Design notes: docs/internals/core.md, section `dot.py`.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from conveyor.kernel import current_context

GPU_DTYPES = (jnp.bfloat16, jnp.float16)
WGMMA_M = 64  # a warpgroup's wgmma covers 64 rows
WGMMA_MAX_N = 256


def _check(a, b, acc) -> tuple[int, int, int]:
    if len(a.shape) != 2 or len(b.shape) != 2 or len(acc.shape) != 2:
        raise ValueError(
            f"cv.dot: a, b and acc must be 2-d refs, got shapes {tuple(a.shape)}, "
            f"{tuple(b.shape)}, {tuple(acc.shape)}"
        )
    (m, k), (k2, n) = a.shape, b.shape
    if k != k2 or tuple(acc.shape) != (m, n):
        raise ValueError(
            f"cv.dot: shapes do not chain: a {tuple(a.shape)} @ b {tuple(b.shape)} into acc "
            f"{tuple(acc.shape)}"
        )
    if jnp.dtype(acc.dtype) != jnp.float32:
        raise ValueError(
            f"cv.dot: acc must be float32 (the accumulation dtype), got {jnp.dtype(acc.dtype)}"
        )
    return m, k, n


def _check_gpu(a, b, m: int, k: int, n: int) -> None:
    if jnp.dtype(a.dtype) != jnp.dtype(b.dtype) or jnp.dtype(a.dtype) not in map(
        jnp.dtype, GPU_DTYPES
    ):
        raise NotImplementedError(
            "cv.dot on mosaic_gpu: wgmma takes bfloat16 or float16 operands of one dtype, got a "
            f"{jnp.dtype(a.dtype)} and b {jnp.dtype(b.dtype)}; cast the inputs (float32 "
            "accumulation is kept)"
        )
    itemsize = jnp.dtype(a.dtype).itemsize
    if m % WGMMA_M or n % 8 or n > WGMMA_MAX_N or (k * itemsize) % 32:
        raise ValueError(
            f"cv.dot on mosaic_gpu: a wgmma tile needs rows a multiple of {WGMMA_M}, columns a "
            f"multiple of 8 up to {WGMMA_MAX_N}, and a contraction of a multiple of 32 bytes; got "
            f"(m, k, n) = ({m}, {k}, {n}) in {jnp.dtype(a.dtype)}"
        )


def dot(a: Any, b: Any, acc: Any, *, accumulate: Any = True) -> None:
    """`acc[...] = (acc[...] if accumulate else 0) + a[...] @ b[...]` in float32, inside a kernel
    body.

    Args:
      a, b: refs (or views `ref.at[...]`) of shapes (m, k) and (k, n): pipeline blocks.
      acc: a float32 ref of shape (m, n), e.g. an output block resident across a reduction axis.
      accumulate: a bool or a traced bool (e.g. `kk > 0` for the first reduction step).
    mosaic_gpu needs bfloat16/float16 operands, m a multiple of 64, n a multiple of 8 up to 256.
    """
    ctx = current_context("cv.dot")
    m, k, n = _check(a, b, acc)
    if ctx.backend != "mosaic_gpu":
        product = jnp.dot(a[...], b[...], preferred_element_type=jnp.float32)
        acc[...] = jnp.where(accumulate, acc[...], jnp.zeros_like(product)) + product
        return
    _check_gpu(a, b, m, k, n)
    from conveyor.pipeline import gpu_tiles

    gpu_tiles.check_wgmma_operand(ctx, "a", a)
    gpu_tiles.check_wgmma_operand(ctx, "b", b)
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def issue(acc_regs):
        plgpu.wgmma(acc_regs, a, b)
        return acc_regs[...]  # reading the accumulator waits for the wgmma

    product = pl.run_scoped(issue, plgpu.ACC((m, n), jnp.float32))  # starts at zero
    if accumulate is True:
        acc[...] = acc[...] + product
    elif accumulate is False:
        acc[...] = product
    else:  # traced: branches, since Mosaic GPU has no implicit broadcast

        @pl.when(accumulate)
        def _():
            acc[...] = acc[...] + product

        @pl.when(jnp.logical_not(accumulate))
        def _():
            acc[...] = product


__all__ = ["dot"]
