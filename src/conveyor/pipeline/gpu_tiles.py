"""What Mosaic GPU's TMA copies ask of the arrays a pipeline copies, checked before its compiler
would refuse them (the GPU interpreter checks none of it): row strides of whole 16-byte units,
and array dimensions that a block's shared-memory tiling covers cut into whole tiles."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp

from conveyor.ints import cdiv
from conveyor.jaxprs import underlying_ref

TMA_STRIDE_BYTES = 16
SWIZZLES = (128, 64, 32)  # bytes: the swizzles Mosaic GPU picks for a wgmma operand, widest first
TILE_ROWS = 8


def check_strides(name: str, array_shape: Sequence[int], dtype) -> None:
    """A TMA copy needs every stride of its array but the last (contiguous, row-major) to be a
    multiple of 16 bytes: the last dimension spans whole 16-byte units."""
    if len(array_shape) < 2:
        return
    itemsize = jnp.dtype(dtype).itemsize
    row = array_shape[-1] * itemsize
    if row % TMA_STRIDE_BYTES:
        per = TMA_STRIDE_BYTES // math.gcd(TMA_STRIDE_BYTES, itemsize)
        raise ValueError(
            f"{name}: mosaic_gpu copies blocks with TMA, which needs every array stride but the "
            f"last to be a multiple of {TMA_STRIDE_BYTES} bytes; the array {tuple(array_shape)} of "
            f"{jnp.dtype(dtype).name} has rows of {row} bytes: pad its last dimension to a "
            f"multiple of {per}"
        )


def check_tiled_dims(name: str, array_shape: Sequence[int], tiling: Sequence[int], why: str):
    """Mosaic GPU cuts the dimensions a shared-memory tiling covers into whole tiles of the array
    the copy reads (`launch_context.TileTransform`): each such dimension is at most one tile or a
    multiple of it."""
    dims = range(len(array_shape) - len(tiling), len(array_shape))
    for d, t in zip(dims, tiling):
        size = array_shape[d]
        if size > t and size % t:
            raise ValueError(
                f"{name}: {why} tiles dimension {d} of the array {tuple(array_shape)} by {t}; "
                f"Mosaic GPU needs that dimension to be at most {t} or a multiple of {t} (the "
                f"cuda compile refuses {size}): pad it to {cdiv(size, t) * t}"
            )


def explicit_tiling(transforms: Sequence[Any]) -> tuple[int, ...] | None:
    """The tiling of a block's `plgpu.TilingTransform`, if it has one."""
    for t in transforms:
        tiling = getattr(t, "tiling", None)
        if tiling is not None and type(t).__name__ == "TilingTransform":
            return tuple(tiling)
    return None


def wgmma_tiling(block_shape: Sequence[int], dtype) -> tuple[int, int] | None:
    """The tiling Mosaic GPU gives a wgmma operand's untransformed shared-memory block: 8 rows by
    the widest swizzle (128, 64 or 32 bytes) that divides the block's row; None when none does
    (the compiler then finds no tiling at all)."""
    row = block_shape[-1] * jnp.dtype(dtype).itemsize
    for swizzle in SWIZZLES:
        if row % swizzle == 0:
            return (TILE_ROWS, swizzle // jnp.dtype(dtype).itemsize)
    return None


def base_shape(ref) -> tuple[int, ...]:
    """The shape of the array a ref or a view (`ref.at[...]`) looks into: what a TMA copy sees."""
    return tuple(underlying_ref(ref).shape)


def check_pipeline_arrays(operands, refs) -> None:
    """Each copied operand's array (refs in the plan's operand order): the TMA stride rule, and the
    tile rule of an explicit `plgpu.TilingTransform`."""
    for op, ref in zip(operands, refs):
        shape = base_shape(ref)
        check_strides(op.name, shape, ref.dtype)
        tiling = explicit_tiling(op.transforms)
        if tiling is not None:
            check_tiled_dims(op.name, shape, tiling, f"its plgpu.TilingTransform({tiling})")


def note_untiled_slots(ctx, operands, refs, slots) -> None:
    """Remember, for `cv.dot`, which array each untransformed shared-memory slot is copied from
    (Mosaic GPU infers a wgmma operand's tiling; the array must fit it too)."""
    for op, ref, slot in zip(operands, refs, slots):
        if not op.transforms:
            ctx.gpu_slot_arrays[id(slot)] = (op.name, base_shape(ref), slot)


def check_wgmma_operand(ctx, which: str, ref) -> None:
    """A wgmma operand that is a pipeline's untransformed slot: its block must have a tiling, and
    the array it is copied from must fit it."""
    found = ctx.gpu_slot_arrays.get(id(underlying_ref(ref)))
    if found is None:
        return
    name, array_shape, slot = found
    block = tuple(slot.shape[1:])  # the slots of one operand: [num_slots, *block]
    tiling = wgmma_tiling(block, slot.dtype)
    if tiling is None:
        raise ValueError(
            f"cv.dot on mosaic_gpu: {which} is a block of {name} of shape {block} in "
            f"{jnp.dtype(slot.dtype).name}, whose rows span "
            f"{block[-1] * jnp.dtype(slot.dtype).itemsize} bytes; wgmma reads shared memory "
            f"swizzled in rows of {SWIZZLES[-1]}, {SWIZZLES[1]} or {SWIZZLES[0]} bytes: widen the "
            "block's last dimension"
        )
    check_tiled_dims(
        name, array_shape, tiling, f"cv.dot's wgmma (its {which} operand, a {block} block)"
    )
