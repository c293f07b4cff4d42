"""The Mosaic TPU gmm/tgmm kernels' tiles, blocks and VMEM working set: arithmetic the kernels
(`ops/gmm/mosaic_tpu.py`) and the simulator (`cv.sim.simulate_gmm` on TPU hardware) share, so
both count the same bytes. No Pallas import: the simulator loads it without the TPU backend."""

from __future__ import annotations

import math

from typing import Any

import jax.numpy as jnp

from conveyor.ints import cdiv
from conveyor.cost import shape_bytes

Shape = tuple[Any, ...]


def clamp_tiles(
    sizes: dict[str, int], tiles: dict[str, int], sublane: str, dtype, op: str
) -> dict[str, int]:
    """Clamp tiles to the problem and enforce the TPU block rules.

    The tile named `sublane` must be a multiple of 8 (16 for bfloat16); the others are lane
    dimensions of some block and must be multiples of 128. A tile covering its whole dimension is
    always legal.
    """
    sub = 16 if jnp.dtype(dtype) == jnp.bfloat16 else 8
    out = {}
    for name, t in tiles.items():
        full = sizes[name]
        t = min(t, full)
        unit = sub if name == sublane else 128
        if t != full and t % unit:
            raise ValueError(
                f"tiling: mosaic_tpu {op} needs t{name} to be a multiple of {unit} for "
                f"{jnp.dtype(dtype).name} (or >= {name}={full}), got t{name}={t}"
            )
        out[name] = t
    return out


def gmm_tiles(m: int, k: int, n: int, tiling: tuple[int, int, int], dtype) -> tuple[int, ...]:
    """gmm's (tm, tk, tn) for an [m, k] x [k, n] problem: `tiling` clamped, tm the sublane tile."""
    t = clamp_tiles(dict(m=m, k=k, n=n), dict(zip("mkn", tiling)), "m", dtype, "gmm")
    return t["m"], t["k"], t["n"]


def tgmm_tiles(m: int, k: int, n: int, tiling: tuple[int, int, int], dtype) -> tuple[int, ...]:
    """tgmm's (tm, tk, tn) for [k, m] x [m, n] -> [G, k, n]: tk is the sublane tile."""
    t = clamp_tiles(dict(m=m, k=k, n=n), dict(zip("mkn", tiling)), "k", dtype, "tgmm")
    return t["m"], t["k"], t["n"]


def gmm_blocks(tm: int, tk: int, tn: int, transpose_rhs: bool = False) -> tuple[Shape, ...]:
    """gmm's VMEM blocks: lhs [tm, tk], rhs [tk, tn] ([tn, tk] transposed; group squeezed),
    out [tm, tn]."""
    rhs = (None, tn, tk) if transpose_rhs else (None, tk, tn)
    return (tm, tk), rhs, (tm, tn)


def tgmm_blocks(tm: int, tk: int, tn: int) -> tuple[Shape, ...]:
    """tgmm's VMEM blocks: lhs^T [tk, tm], rhs [tm, tn], out [tk, tn] (group squeezed)."""
    return (tk, tm), (tm, tn), (None, tk, tn)


def _present(block: Shape) -> tuple[int, ...]:
    return tuple(d for d in block if d is not None)


# Mosaic TPU keeps a relayout copy of a matmul's 16-bit left operand once the operand holds more
# than this many elements: libtpu's compile of 108 bf16 gmm/tgmm tilings on v5e, v6e and v5p
# reported it, and of float32 ones none (docs/internals/gmm.md, "Default tiles on TPU"); counted
# at the operand's size.
RELAYOUT_FREE_ELEMENTS = 128 * 512


def working_set(
    lhs_block: Shape,
    rhs_block: Shape,
    out_block: Shape,
    dtype,
    out_dtype,
    *,
    dot_lhs=None,
    existing_out: bool = True,
) -> int:
    """The kernel's VMEM: two buffers of each input block (lhs, rhs and, when the kernel takes
    one, the aliased existing output), two of the output block, the float32 accumulator scratch,
    and Mosaic's copy of the matmul's 16-bit left operand (`dot_lhs`, default the lhs block) when
    it is over RELAYOUT_FREE_ELEMENTS. libtpu's scoped VMEM for the kernels is this within a few
    percent (benchmarks/results/compile-check-*.md)."""
    lhs, rhs, out = _present(lhs_block), _present(rhs_block), _present(out_block)
    inputs = shape_bytes(lhs, dtype) + shape_bytes(rhs, dtype)
    if existing_out:
        inputs += shape_bytes(out, out_dtype)
    operand = lhs if dot_lhs is None else _present(dot_lhs)
    copied = jnp.dtype(dtype).itemsize < 4 and math.prod(operand) > RELAYOUT_FREE_ELEMENTS
    relayout = shape_bytes(operand, dtype) if copied else 0
    return 2 * inputs + 2 * shape_bytes(out, out_dtype) + shape_bytes(out, jnp.float32) + relayout


def gmm_index_maps(transpose_rhs: bool = False):
    """gmm's block index maps over its grid (n tile j, visit v, k tile kk), reading the visits'
    group ids and row tiles (`make_group_metadata`); the kernel's BlockSpecs and the simulator's
    replay of its grid (`cv.sim.simulate_gmm` on TPU) both use them. Returns (lhs, rhs, out)."""

    def lhs(j, v, kk, group_ids, tile_ids, *_):
        return tile_ids[v], kk

    def rhs(j, v, kk, group_ids, tile_ids, *_):
        return (group_ids[v], j, kk) if transpose_rhs else (group_ids[v], kk, j)

    def out(j, v, kk, group_ids, tile_ids, *_):
        return tile_ids[v], j

    return lhs, rhs, out


def gmm_grid(k: int, n: int, tk: int, tn: int, visits: int) -> tuple[int, int, int]:
    """gmm's grid: n tiles (parallel: split over a chip's cores), then the (row tile, group)
    visits in order, then k tiles innermost (the output block stays resident over them)."""
    return cdiv(n, tn), visits, cdiv(k, tk)


def tgmm_index_maps():
    """tgmm's block index maps over its grid (k tile i, n tile j, visit v): lhs^T, rhs and the
    output (the group's [k, n] block, resident over the group's visits). Returns (lhs, rhs,
    out)."""

    def lhs(i, j, v, group_ids, tile_ids, *_):
        return i, tile_ids[v]

    def rhs(i, j, v, group_ids, tile_ids, *_):
        return tile_ids[v], j

    def out(i, j, v, group_ids, tile_ids, *_):
        return group_ids[v], i, j

    return lhs, rhs, out


def tgmm_grid(k: int, n: int, tk: int, tn: int, visits: int) -> tuple[int, int, int]:
    """tgmm's grid: k tiles and n tiles (parallel), then the visits (the reduction) innermost."""
    return cdiv(k, tk), cdiv(n, tn), visits
