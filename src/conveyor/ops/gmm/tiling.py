"""Tile sizes for gmm/tgmm: validation of the user's `tiling` and per-backend defaults."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Union

Tiling = Union[None, tuple[int, int, int], Callable[[int, int, int], "tuple[int, int, int] | None"]]

# The XLA backend's default row tile is xla.GMM_TM for gmm and xla.default_tgmm_tm for tgmm (k and
# n are left whole: XLA's dot emitter tiles them itself).
# Mosaic TPU's default tiles for gmm/tgmm (`tpu_default`): rows per tile between TPU_MIN_TM and
# TPU_MAX_TM, k / n tiles of at most TPU_MAX_TKN. Why these sizes: docs/internals/gmm.md,
# "Default tiles on TPU".
TPU_MIN_TM, TPU_MAX_TM, TPU_MAX_TKN = 128, 256, 1024


def tpu_default(m: int, k: int, n: int, num_groups: int) -> tuple[int, int, int]:
    """Mosaic TPU's default (tm, tk, tn) for gmm/tgmm over `m` rows in `num_groups` groups.

    tm is the mean rows per group rounded down to a power of two, within [128, 256]: each weight
    block fetched serves more rows, while the tiles a group shares with its neighbours (computed
    once per group) waste little. tk and tn are the widest of 1024, 512, 256, 128 that divides k
    and n (1024 when none does). The kernels clamp each tile to its dimension. Depends on the
    shapes alone, never on the host or the chip."""
    mean = m // max(num_groups, 1)
    tm = TPU_MIN_TM
    while tm * 2 <= min(mean, TPU_MAX_TM):
        tm *= 2
    return (
        tm,
        _widest_dividing(TPU_MAX_TKN, k, 128),
        _widest_dividing(TPU_MAX_TKN, n, 128),
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuKernelConfig:
    """The mosaic_gpu gmm/tgmm kernels' configuration: what the kernels run, the simulator models
    (`cv.sim.simulate_gmm` / `simulate_tgmm` on GPU hardware) and the GPU benchmark reports."""

    compute_threads: int = 2  # compute warpgroups
    stages: int = 4  # pipeline slots (fewer when the output staging buffer leaves no room)
    delay_release: int = 1  # each step's wgmma stays in flight while the next is issued
    # gmm's (tm, tk, tn): one thread block's output tile. Up to tn=128 each compute warpgroup takes
    # 64 of the 128 rows (all tn columns); a wider tn is split by columns instead (each warpgroup
    # takes all 128 rows and tn / 2 columns), as upstream's Hopper matmul does: a 128 x 128
    # accumulator per warpgroup, and a 128 x 256 tile that reads 25% fewer operand bytes per flop
    # from L2 than 128 x 128.
    gmm_tiling: tuple[int, int, int] = (128, 64, 256)
    max_tn: int = 256  # both kernels' widest column tile: two warpgroups of 128 columns
    epilogue_rows: int = 64  # rows of an output staging buffer per warpgroup (stored in turn)
    grid_band: int = 8  # gmm visits column tiles in bands of this many (L2 reuse; see the kernel)
    # tgmm's (tm rows reduced per step, tk, tn): a 128 x 256 output tile, split by columns as gmm's.
    tgmm_tiling: tuple[int, int, int] = (64, 128, 256)
    min_tile: int = 16  # elements: 32 bytes of bf16/f16, the narrowest swizzled shared-memory row
    # A TMA copy's shared-memory address must be 128-byte aligned (an unaligned one faults with
    # CUDA_ERROR_MISALIGNED_ADDRESS: seen on an H200). gmm stores its output rows from any row of
    # the staging buffer (a group boundary), so each staged row spans a multiple of this.
    tma_smem_align: int = 128
    tgmm_min_tn: int = 64  # tgmm's narrowest column tile: one 128-byte swizzled row of bf16/f16

    def gmm_tiles_for(self, k: int, n: int, *, out_itemsize: int) -> tuple[int, int, int]:
        """gmm's default (tm, tk, tn) for a k x n weight: `gmm_tiling`'s tk and tn where they
        divide k and n, else the widest power-of-two halving of them that does, down to `min_tile`
        for tk and `gmm_min_tn` for tn (gpt-oss's n=2880 runs with tn=64). A dimension no
        candidate divides keeps the configured tile, which the kernel then refuses by name."""
        tm, tk, tn = self.gmm_tiling
        return (
            tm,
            _widest_dividing(tk, k, self.min_tile),
            _widest_dividing(tn, n, self.gmm_min_tn(out_itemsize)),
        )

    def gmm_min_tn(self, out_itemsize: int) -> int:
        """gmm's narrowest tn: a staged output row of `tma_smem_align` bytes (32 float32 or 64
        bfloat16 columns), a multiple of what the rhs blocks need (a 32-byte swizzled row,
        `min_tile`; 8 rows when rhs is transposed)."""
        return max(self.min_tile, self.tma_smem_align // out_itemsize)

    def split_columns(self, tn: int) -> bool:
        """Whether the compute warpgroups split a tn-column output tile by columns (tn > 128: each
        takes all the tile's rows and tn / 2 columns) rather than by rows (each takes its share of
        the rows and all tn columns). Both kernels follow this rule."""
        return tn > 128

    def thread_tile(self, tile_rows: int, tn: int) -> tuple[int, int]:
        """The (rows, columns) of the accumulator one compute warpgroup owns in a tile_rows x tn
        output tile (gmm: tm rows; tgmm: tk rows)."""
        if self.split_columns(tn):
            return tile_rows, tn // self.compute_threads
        return tile_rows // self.compute_threads, tn

    def thread_origin(self, wg, tile_rows: int, tn: int):
        """(row, column) of compute warpgroup `wg`'s accumulator inside the output tile."""
        rows, cols = self.thread_tile(tile_rows, tn)
        return (0, wg * cols) if self.split_columns(tn) else (wg * rows, 0)

    def tn_multiple(self, tn: int, narrowest: int) -> int:
        """What tn must be a multiple of: the kernel's `narrowest` column tile; split by columns,
        each warpgroup's columns must be whole 128-byte swizzled rows (64 bf16/f16 elements)."""
        return self.compute_threads * 64 if self.split_columns(tn) else narrowest

    def staging_shape(self, tile_rows: int, tn: int) -> tuple[int, int, int]:
        """The output staging buffer: per compute warpgroup, `epilogue_rows` rows (at most its
        own) of its columns; a warpgroup with more rows stages and stores them a part at a time."""
        rows, cols = self.thread_tile(tile_rows, tn)
        return self.compute_threads, min(rows, self.epilogue_rows), cols

    def stages_that_fit(self, *, block_bytes: int, staging_bytes: int, budget_bytes: int) -> int:
        """Up to `stages` pipeline slots of `block_bytes` (one step's operand blocks), as many as
        fit in `budget_bytes` of shared memory beside the output staging buffer; at least 2 (a tile
        that fits no double buffer is refused, naming its bytes, by the pipeline's check)."""
        room = budget_bytes - staging_bytes
        # + 64: the slot's barriers, generously
        return max(2, min(self.stages, room // (block_bytes + 64)))

    def tgmm_tiles_for(self, n: int) -> tuple[int, int, int]:
        """tgmm's default (tm, tk, tn): `tgmm_tiling`'s tn where it divides n, else the widest
        halving down to `tgmm_min_tn` that does; k needs no dividing tile (the kernel pads its last
        row tile and stores the rows below k)."""
        tm, tk, tn = self.tgmm_tiling
        return tm, tk, _widest_dividing(tn, n, self.tgmm_min_tn)


def _widest_dividing(tile: int, dim: int, smallest: int) -> int:
    """The largest of tile, tile / 2, ..., smallest that divides dim; else tile."""
    t = tile
    while t >= smallest:
        if dim % t == 0:
            return t
        t //= 2
    return tile


MOSAIC_GPU = GpuKernelConfig()


def check_tiling(tiling: Tiling, arg: str = "tiling") -> None:
    """Raise if `tiling` is neither None, a tuple of three positive ints, nor a callable."""
    if tiling is None or callable(tiling):
        return
    _check_tuple(tiling, arg)


def _check_tuple(t, arg):
    if (
        not isinstance(t, (tuple, list))
        or len(t) != 3
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in t)
    ):
        raise TypeError(
            f"{arg}: expected None, a (tm, tk, tn) tuple of ints, or a callable (m, k, n) -> tuple "
            f"| None, got {t!r}"
        )
    if any(v <= 0 for v in t):
        raise ValueError(f"{arg}: expected positive tile sizes (tm, tk, tn), got {tuple(t)!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tile:
    """The tile sizes one gmm/tgmm call runs with, resolved from the user's `tiling` (upstream's
    (tm, tk, tn) tuple or callable) and validated once: what every backend receives."""

    tm: int
    tk: int
    tn: int

    def __post_init__(self):
        _check_tuple((self.tm, self.tk, self.tn), "tiling")


@dataclasses.dataclass(frozen=True)
class TilingTable:
    """A tiling callable asked once, at the API, for every ordering of the problem's (m, k, n):
    the shapes the op and the ops of its derivatives take. Hashable, so the primitives' caches
    and jaxprs see its answers, not the user's function; called like the callable it replaces."""

    entries: tuple[tuple[tuple[int, int, int], tuple[int, int, int] | None], ...]

    def __call__(self, m: int, k: int, n: int) -> tuple[int, int, int] | None:
        for shape, tile in self.entries:
            if shape == (m, k, n):
                return tile
        known = ", ".join(str(shape) for shape, _ in self.entries)
        raise ValueError(
            f"tiling: the callable was asked at the call for the shapes {known}; an op of shape "
            f"{(m, k, n)} needs one too (pass a (tm, tk, tn) tuple, or report this case)"
        )


def as_static(tiling: Tiling, m: int, k: int, n: int) -> Tiling:
    """`tiling` as a hashable value: a tuple as a tuple, a callable as the `TilingTable` of its
    answers for every ordering of (m, k, n) (each answer checked as `resolve` checks it)."""
    if isinstance(tiling, TilingTable) or not callable(tiling):
        return tuple(tiling) if isinstance(tiling, list) else tiling
    entries = []
    for shape in dict.fromkeys(itertools.permutations((m, k, n))):
        tile = tiling(*shape)
        if tile is not None:
            _check_tuple(tile, f"tiling{shape} returned")
            tile = tuple(int(v) for v in tile)
        entries.append((shape, tile))
    return TilingTable(tuple(entries))


def resolve(tiling: Tiling, m: int, k: int, n: int, default: tuple[int, int, int]) -> Tile:
    """The tile to use for an (m, k, n) problem; a callable may return None for the default."""
    t = tiling(m, k, n) if callable(tiling) else tiling
    if t is None:
        t = default
    else:
        _check_tuple(t, f"tiling({m}, {k}, {n}) returned" if callable(tiling) else "tiling")
    tm, tk, tn = t
    return Tile(tm=tm, tk=tk, tn=tn)
