"""Mosaic TPU's memory tiles: VMEM (and tiled HBM) hold an array's last two dimensions in tiles of
(sublanes, 128 lanes), sublanes 8 for 32-bit, 16 for 16-bit and 32 for 8-bit values. A block, or
a copy's window, is tile-aligned in those dimensions or the real compiler refuses it."""

from __future__ import annotations

import jax.numpy as jnp

LANES = 128
SUBLANES = {4: 8, 2: 16, 1: 32}  # by itemsize


def tpu_tile(dtype, d: int, rank: int) -> int | None:
    """The tile size of dimension `d` of a rank-`rank` array of `dtype`: 128 for the last, the
    sublane count for the second to last, None for the others (not tiled)."""
    if d == rank - 1:
        return LANES
    if d == rank - 2:
        return SUBLANES.get(jnp.dtype(dtype).itemsize, 8)
    return None
